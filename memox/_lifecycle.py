"""A module's slots changed without running a cached method: allocated (`memox.init`,
and `allocated`/`allocated_once` for the compiled wrappers before their first trace),
invalidated (`memox.clear`, `memox.invalidate`, inside a call too) and emptied
(`memox.strip`)."""

from __future__ import annotations

from typing import Any, Concatenate, overload

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import ArrayLike, Bool

from . import _cached, _context, _errors
from ._cached import method_for
from ._caches import ByIdentity
from ._call import (
    allocate_plain_slots,
    changed_slots,
    check_fn,
    check_module,
    check_slots,
    revive,
    run,
)
from ._jax_internals import is_concrete_array
from ._sites import SlotSite, replace_slots, slot_sites, slots
from ._slot import EMPTY, Memo, is_empty, is_memo
from ._table import allocate_like, emptied, invalidated, mesh_of, storage
from ._typing import CachedMethod, Callable, M, P


@overload
def init(module: M, /) -> M: ...
@overload
def init(
    module: M, fn: Callable[Concatenate[M, P], Any], /, *args: P.args, **kwargs: P.kwargs
) -> M: ...
def init(module: M, fn: Callable[..., Any] | None = None, /, *args: Any, **kwargs: Any) -> M:
    """Allocate `module`'s slots without computing anything.

    **Arguments:**

    - `module`: a pytree holding `memox.Memo` slots.
    - `fn`, `*args`, `**kwargs` (optional): a function as for `memox.call`. The slots it
      would fill when called with these arguments are allocated too (for cached methods
      that take arguments). Shapes come from `jax.eval_shape`: no FLOPs are spent.

    Every slot whose cached method takes no arguments is allocated. An allocated slot
    keeps its structure whatever happens to it, so the module can be a `lax.scan` carry.

    **Returns:**

    `module` with its slots allocated and empty.

    !!! Example

        ```python
        foo = memox.init(Foo(jnp.ones((3, 3))))
        def body(foo, x):
            b, foo = memox.call(foo, Foo.b)
            return foo, b * x

        foo, ys = jax.lax.scan(body, foo, jnp.arange(4.0))   # b computed once
        ```
    """
    check_module("init", module)
    sites = list(slot_sites(module))
    check_slots("init", module, sites, args, kwargs)
    module = allocate_plain_slots(module, sites)
    if fn is None:
        return module
    check_fn("init", fn)

    def allocated(module, args, kwargs):
        _, module, frame = run(module, fn, args, kwargs, discover=True)
        return replace_slots(module, changed_slots(module, frame))

    shapes = eqx.filter_eval_shape(allocated, module, args, kwargs)
    before = slots(module)
    mesh = mesh_of(jtu.tree_leaves((module, args, kwargs)))
    new = {
        site.path: allocate_like(site.slot, mesh, before[site.path])
        for site in slot_sites(shapes)
        if site.slot.allocated and not _same_storage(before[site.path], site.slot)
    }
    return replace_slots(module, new)


def _same_storage(slot: Memo, shapes: Memo) -> bool:
    """Whether `slot` is allocated with the tables `shapes` has (the value's, with its
    sharding where that is part of its type, and the snapshot's: a `Drift` slot's
    snapshot grows with its dependencies)."""
    return (
        slot.allocated
        and jtu.tree_structure(slot) == jtu.tree_structure(shapes)
        and storage(slot) == storage(shapes)
    )


def clear(module: M) -> M:
    """Invalidate every slot of `module`, keeping its allocation (no retrace follows).

    **Arguments:**

    - `module`: a pytree holding `memox.Memo` slots.

    **Returns:**

    `module` whose slots all miss at their next use. Hit and miss counts are kept.

    !!! Example

        ```python
        foo = memox.clear(foo)
        b, foo = memox.call(foo, Foo.b)   # recomputes
        ```
    """
    check_module("clear", module)
    return invalidate(module)


def invalidate(module: M, /, *methods: CachedMethod, when: Bool[ArrayLike, ""] = True) -> M:
    """Invalidate the slots of some cached methods, where a condition holds.

    Unlike `memox.clear`, this takes a boolean array, so a traced loop can decide to
    refresh a value: a simulator refactorises when Newton fails to converge with
    `model = memox.invalidate(model, Stepper.lu, when=~converged)` inside its
    `lax.scan` body. It keeps every allocation (no retrace).

    **Arguments:**

    - `module`: a pytree holding `memox.Memo` slots.
    - `*methods`: cached methods, unbound (`Stepper.lu`); their slots anywhere in
      `module` are invalidated. None: every slot.
    - `when`: a boolean (array or Python `bool`); nothing changes where it is false.

    **Returns:**

    `module` with those slots' entries invalid where `when` holds.

    !!! Example

        ```python
        foo = memox.invalidate(foo, Foo.b, when=jnp.sum(foo.a) > 100.0)
        ```
    """
    check_module("invalidate", module)
    for method in methods:
        if not isinstance(method, _cached.CachedMethod):
            raise TypeError(_errors.NOT_CACHED.format(api="invalidate", got=repr(method)))
    sites = [
        site
        for site in slot_sites(module)
        if not methods or (site.field and method_for(site.owner, site.field) in methods)
    ]
    new = {site.path: invalidated(site.slot, when) for site in sites}
    _invalidate_running(sites, new, when)
    return replace_slots(module, new)


def _invalidate_running(sites: list[SlotSite], new: dict, when: Any) -> None:
    """Inside `fn`, invalidate the slots of the running call too: its frame holds their
    current states, which a cached method reads whichever copy of the module it runs on
    (an invalidation inside a transformation opened inside `fn` is refused there, as
    any write of the frame is). The slots `new` of the module returned are new arrays:
    the frame finds each at its site's path."""
    frame = _context.top()
    if not isinstance(frame, _context.Frame):
        return
    for site in sites:
        path = frame.find(site.owner, site.field) if site.field else None
        if path is not None:
            frame.write(path, invalidated(frame.store[path], when), "memox.invalidate")
            frame.index(path, new[site.path])


def strip(module: M) -> M:
    """`module` with every slot empty: no cache arrays at all.

    An empty slot holds no arrays. So the stripped module holds your parameters only.
    Save it to checkpoint without caches, with any checkpointer:
    `eqx.tree_serialise_leaves(path, memox.strip(model))`, or
    `ocp.StandardCheckpointer().save(path, memox.strip(model))`. Restore it into
    `memox.strip(like)`. The slots refill on first use.

    **Arguments:**

    - `module`: a pytree holding `memox.Memo` slots, typically an `eqx.Module`.

    **Returns:**

    `module` with every slot empty (as `memox.Memo()` constructs it); its other leaves
    are `module`'s own.

    !!! Example

        ```python
        foo = memox.strip(foo)   # foo.b() recomputes at its next memox.call
        ```
    """
    check_module("strip", module)
    return jtu.tree_map(lambda x: emptied(x) if is_memo(x) else x, module, is_leaf=is_memo)


# -- allocation before a compiled wrapper's first trace ---------------------------------


class _Mirror:
    """A `Memo` node that a filter emptied (`None` leaves), hidden from allocation."""

    __slots__ = ("slot",)

    def __init__(self, slot: Memo):
        self.slot = slot


def _is_mirror(x: Any) -> bool:
    return isinstance(x, _Mirror)


def allocated(tree: Any) -> Any:
    """`tree` with its empty slots allocated, as `memox.init(tree)` would: for
    `memox.jit` and `memox.filter_jit`, before their first trace.

    Only declared-empty slots (their fields the `EMPTY` marker) are allocated. A `Memo`
    node whose fields are `None` is a filter's image of a slot, not a slot: the mirror
    of the model in an optimizer state made from `eqx.filter(model, ...)` (adam's
    `mu` and `nu`), or half of an `eqx.partition`. Allocating it would change the
    optimizer state's structure, and compute the method on a module of `None`s.

    A slot left empty (its method takes arguments: allocated at its first fill) gets its
    markers back as declared where they came back as concrete 0-d arrays: static, as
    the trace needs them to allocate it (a traced one stays, for `allocate`'s error)."""
    if not any(map(is_empty, jtu.tree_leaves(tree, is_leaf=is_memo))):
        return revive(tree)
    hidden = jtu.tree_map(
        lambda x: _Mirror(x) if is_memo(x) and x.value is None else x, tree, is_leaf=is_memo
    )
    filled = allocate_plain_slots(revive(hidden))
    return jtu.tree_map(_unhidden, filled, is_leaf=lambda x: _is_mirror(x) or is_memo(x))


def _unhidden(x: Any) -> Any:
    if _is_mirror(x):
        return x.slot
    if not is_empty(x) or x.value is EMPTY:
        return x
    traced = isinstance(x.value, jax.Array) and not is_concrete_array(x.value)
    return x if traced else emptied(x)


# A module's allocated version, by the module's identity, while its slots are usable
# (none donated since; a slot still empty, such as one keyed by arguments, is as
# allocation would leave it).
_allocated = ByIdentity("allocated modules")


def allocated_once(tree: Any) -> Any:
    """`allocated(tree)`, the same allocation for the same object while its slots are
    usable: for `memox.filter_jit`, whose compiled function returns the caller's own
    trees, which it cannot map back to `tree`."""
    found = _allocated.get(tree)
    if found is None:
        try:
            found = allocated(tree)
        except Exception:
            # A method that cannot be planned on `tree` as given (half of an
            # `eqx.partition`: its parameters are `None`): its slots are left to the
            # trace, which allocates them at the first fill (one retrace, as under
            # `eqx.filter_jit`); a real error in the method surfaces there.
            return tree
        if found is not tree:  # (an entry holding its own key would never go)
            _allocated.put(tree, found)
    return found
