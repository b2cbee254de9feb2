"""`memox.call`, and `run`: the frame a call and the compiled wrappers run `fn` in, over
the module with its slots revived (after a donation) and allocated (those of methods
without arguments), the call's ledger settled when `fn` returns. Also the checks of the
arguments the public functions share (`check_fn`, `check_module`)."""

from __future__ import annotations

import warnings
from typing import Any, Concatenate

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _context, _errors, _jax_internals, _ledger
from ._cached import method_for
from ._context import separated
from ._hoisted import Hoisted
from ._jax_internals import is_concrete_array
from ._plan import plan_without_arguments
from ._sites import Path, SlotSite, path_name, replace_slots, slot_sites
from ._slot import Memo, is_memo
from ._table import allocate, mesh_of
from ._typing import Callable, M, P, R


def check_fn(api: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(_errors.NOT_CALLABLE.format(api=api, got=type(fn).__name__))
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, eqx.Module):
        name = getattr(fn, "__name__", "method")
        raise TypeError(
            _errors.BOUND_METHOD.format(
                api=api,
                method=f"{type(owner).__name__}(...).{name}",
                cls=type(owner).__name__,
                name=name,
            )
        )


def check_module(api: str, module: Any, args: tuple = (), kwargs: dict | None = None) -> None:
    """Raise where `module` is a single leaf (an array, a plain Python object). For
    `memox.jit`, whose `module` is the wrapped function's first argument, the message
    says so, and names a later argument that holds slots."""
    if isinstance(module, eqx.Module):  # (a pytree node: no walk of it needed)
        return
    if not is_memo(module) and jtu.treedef_is_leaf(jtu.tree_structure(module)):
        got = "a `jax.Array`" if isinstance(module, jax.Array) else type(module).__name__
        if api == "jit":
            where = _holding_slots(args, kwargs or {})
            where = f"; {where} holds the slots" if where else ""
            raise TypeError(_errors.FIRST_ARGUMENT.format(got=got, where=where))
        raise TypeError(_errors.NOT_A_PYTREE.format(api=api, got=got))


def check_slots(
    api: str, module: Any, sites: list[SlotSite], args: tuple = (), kwargs: dict | None = None
) -> None:
    """Raise where `module` (whose slot sites are `sites`) holds no slot: nothing to
    cache, allocate or count. A later argument holding slots is named (the arguments are
    in the wrong order). A view of a module by `memox.hoist` holds its values in place
    of its slots: a call on it reads them."""
    if sites or any(map(_hoisted, jtu.tree_leaves(module, is_leaf=_hoisted))):
        return
    check_slots_first(api, args, kwargs or {})
    what = _errors.NO_SLOTS_MEANS[api]
    raise TypeError(_errors.NO_SLOTS.format(api=api, got=type(module).__name__, what=what))


def _hoisted(x: Any) -> bool:
    return isinstance(x, Hoisted)


def check_slots_first(api: str, args: tuple, kwargs: dict) -> None:
    """Raise where a call's module holds no slot but a later argument does: the arguments
    are in the wrong order (the method would compute at every call, silently)."""
    where = _holding_slots(args, kwargs)
    if where is not None:
        raise TypeError(_errors.SLOTS_IN_A_LATER_ARGUMENT.format(api=api, where=where))


def _holding_slots(args: tuple, kwargs: dict) -> str | None:
    """The first of `args` and `kwargs` that holds a slot, in words, or None."""
    for i, x in enumerate(args):
        if next(iter(slot_sites(x)), None) is not None:
            return f"argument {i + 2} (a `{type(x).__name__}`)"
    for name, x in kwargs.items():
        if next(iter(slot_sites(x)), None) is not None:
            return f"keyword argument `{name}`"
    return None


def allocate_plain_slots(module: M, sites: list[SlotSite] | None = None) -> M:
    """`module` with every empty slot whose method takes no arguments allocated (given
    its slot sites, where the caller has walked it already)."""
    return _allocated_plain(module, list(slot_sites(module)) if sites is None else sites)[0]


def _allocated_plain(module: M, sites: list[SlotSite]) -> tuple[M, list[SlotSite]]:
    """`allocate_plain_slots`, given `module`'s slot sites; with the result's sites."""
    new = {}
    for site in sites:
        if site.slot.allocated or site.field is None:
            continue
        method = method_for(site.owner, site.field)
        if method is not None and not method.takes_arguments:
            found = plan_without_arguments(method.spec, site.owner)
            snapshot_bytes = found.snapshot_bytes(method.policy)
            mesh = mesh_of(jtu.tree_leaves(site.owner))
            new[site.path] = allocate(site.slot, found.spec, snapshot_bytes, mesh)
    return _replaced(module, sites, new)


def _replaced(module: M, sites: list[SlotSite], new: dict[Path, Memo]) -> tuple[M, list[SlotSite]]:
    """`module` with the slots at the paths in `new` replaced, and its slot sites (walked
    again only where something was replaced)."""
    if not new:
        return module, sites
    module = replace_slots(module, new)
    return module, list(slot_sites(module))


def call(
    module: M, fn: Callable[Concatenate[M, P], R], /, *args: P.args, **kwargs: P.kwargs
) -> tuple[R, M]:
    """Run `fn(module, *args, **kwargs)` with `module`'s cache slots live.

    **Arguments:**

    - `module`: any pytree holding `memox.Memo` slots, typically an `eqx.Module`.
    - `fn`: the function to run. Cached methods reached inside it (on `module` or any
      module inside it) read and fill their slots. Pass methods unbound (`Foo.b`).
    - `*args`, `**kwargs`: passed on to `fn`.

    Works eagerly and inside `jax.jit`, `eqx.filter_jit` and a `lax.scan` body (with the
    module as the carry: allocate its slots first with `memox.init`).

    **Returns:**

    A pair `(result, new_module)`: `new_module` is `module` with its slots updated. The
    module passed in is never modified.

    !!! Example

        ```python
        b, foo = memox.call(foo, Foo.b)              # a miss: computes and stores
        b, foo = memox.call(foo, lambda f: f.b())    # a hit: reads the slot
        ```
    """
    check_fn("call", fn)
    check_module("call", module)
    result, module, frame = run(module, fn, args, kwargs, api="call")
    return result, replace_slots(module, changed_slots(module, frame))


def run(
    module: M,
    fn: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    discover: bool = False,
    api: str | None = None,
) -> tuple[R, M, _context.Frame]:
    """`fn(module, ...)` in a frame over `module`: its result, the module it ran on
    (slots revived, allocated and separated) and the frame. The call's ledger is
    settled when `fn` returns (`_ledger.py`): what did not reach the caller is reported.
    With `discover`, cached methods only allocate their slots (for `memox.init`). With
    `api`, the public function running it, a module holding no slot is refused."""
    # One walk of the module; each step below walks it again only if it changed it.
    sites = list(slot_sites(module))
    if api is not None:
        check_slots(api, module, sites, args, kwargs)
    if not discover:
        warn_if_closed_over(module, sites)
    module, sites = separated(*_allocated_plain(*_revived(module, sites)))
    frame = _context.Frame(module, discover=discover, sites=sites)
    with _context.active(frame), _ledger.opened(frame.trace) as ledger:
        result = fn(module, *args, **kwargs)
    if not discover:
        ledger.settle(jtu.tree_leaves((result, list(frame.store.values()))))
    return result, module, frame


def warn_if_closed_over(module: Any, sites: list[SlotSite]) -> None:
    """Warn if what this call stores cannot reach the caller: `module`'s slots come from
    outside the loop body being traced (judged by the allocated slots' arrays, or by all
    of the module's arrays if none is allocated), or the module has slots still to
    allocate and comes from outside the function being traced (`jax.jit`, a library
    tracing a vector field), which then does not take it as an argument. `sites`:
    `module`'s slot sites."""
    if not sites:
        return
    allocated = [site.slot for site in sites if site.slot.allocated]
    slot_arrays = [x for x in jtu.tree_leaves(allocated) if isinstance(x, jax.Array)]
    to_allocate = len(allocated) < len(sites)
    # The module's arrays: a walk of the whole module, only where they are read.
    arrays = []
    if not slot_arrays or to_allocate:
        arrays = [x for x in jtu.tree_leaves(module) if isinstance(x, jax.Array)]
    loop = _jax_internals.loop_closing_over(slot_arrays or arrays)
    if loop is not None:
        message = _errors.LOOP_CLOSES_OVER.format(loop=loop)
    elif to_allocate and _jax_internals.trace_closing_over(arrays):
        message = _errors.TRACE_CLOSES_OVER
    else:
        return
    warnings.warn(message, _errors.UncachedWarning, stacklevel=4)


def changed_slots(module: Any, frame: _context.Frame) -> dict[Path, Memo]:
    """The slots of `frame` that differ from those of `module`, the tree `frame` was
    opened over (what `run` returns), by path."""
    return {p: s for p, s in frame.store.items() if frame.given.get(p) is not s}


def revive(module: M) -> M:
    """`module` with every slot whose arrays were deleted replaced by an empty allocation:
    it recomputes, and warns. Only a donation the caller asked for deletes a slot's arrays
    (`donate=` of `eqx.filter_jit` or `memox.filter_jit`, `jax.jit`'s `donate_argnums`):
    `memox.jit` donates a slot only where nothing else holds its arrays, and gives the
    module passed in the slot it returns (`_donation.py`)."""
    return _revived(module, list(slot_sites(module)))[0]


def _revived(module: M, sites: list[SlotSite]) -> tuple[M, list[SlotSite]]:
    """`revive`, given `module`'s slot sites; with the result's sites."""
    new = {}
    for site in sites:
        leaves = jtu.tree_leaves(site.slot)
        if any(is_concrete_array(x) and x.is_deleted() for x in leaves):
            new[site.path] = jtu.tree_map(
                lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), site.slot
            )
    if new:
        warnings.warn(
            _errors.DELETED_SLOTS.format(slots=", ".join(map(path_name, new))), stacklevel=4
        )
    return _replaced(module, sites, new)
