"""Working with a module's slots: `memox.call` (and `run`, the frame a call and the
compiled wrappers run `fn` in), `memox.init`, `memox.clear`, `memox.invalidate`,
`memox.hoist`, `memox.strip` and `memox.stats`."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Concatenate, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _context, _errors, _jax_internals, _ledger
from ._cached import CachedMethod, MethodArg, method_for
from ._context import separated
from ._fingerprint import is_concrete_array
from ._plan import plan_without_arguments
from ._slot import (
    Hoisted,
    Memo,
    Path,
    SlotSite,
    allocate,
    allocate_like,
    emptied,
    invalidated,
    is_memo,
    mesh_of,
    path_name,
    replace_slots,
    slot_sites,
    slots,
)
from ._typing import Fn, M, P, R


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported

    from ._flops import FlopCount


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


def check_module(api: str, module: Any) -> None:
    if not is_memo(module) and jtu.treedef_is_leaf(jtu.tree_structure(module)):
        raise TypeError(_errors.NOT_A_PYTREE.format(api=api, got=type(module).__name__))


def allocate_plain_slots(module: M) -> M:
    """`module` with every empty slot whose method takes no arguments allocated."""
    new = {}
    for site in slot_sites(module):
        if site.slot.allocated or site.field is None:
            continue
        method = method_for(site.owner, site.field)
        if method is not None and not method.takes_arguments:
            found = plan_without_arguments(method.spec, site.owner)
            snapshot_bytes = found.snapshot_bytes(method.policy)
            mesh = mesh_of(jtu.tree_leaves(site.owner))
            new[site.path] = allocate(site.slot, found.spec, snapshot_bytes, mesh)
    return replace_slots(module, new)


def call(
    module: M, fn: Fn[Concatenate[M, P], R], /, *args: P.args, **kwargs: P.kwargs
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
    result, module, frame = run(module, fn, args, kwargs)
    return result, replace_slots(module, changed_slots(module, frame))


def run(
    module: M,
    fn: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    discover: bool = False,
) -> tuple[R, M, _context.Frame]:
    """`fn(module, ...)` in a frame over `module`: its result, the module it ran on
    (slots revived, allocated and separated) and the frame. The call's ledger is
    settled when `fn` returns (`_ledger.py`): what did not reach the caller is reported.
    With `discover`, cached methods only allocate their slots (for `memox.init`)."""
    if not discover:
        warn_if_closed_over(module)
    module, sites = separated(allocate_plain_slots(revive(module)))
    frame = _context.Frame(module, discover=discover, sites=sites)
    with _context.active(frame), _ledger.opened(frame.trace) as ledger:
        result = fn(module, *args, **kwargs)
    if not discover:
        ledger.settle(jtu.tree_leaves((result, list(frame.store.values()))))
    return result, module, frame


def warn_if_closed_over(module: Any) -> None:
    """Warn if what this call stores cannot reach the caller: `module`'s slots come from
    outside the loop body being traced (judged by the allocated slots' arrays, or by all
    of the module's arrays if none is allocated), or the module has slots still to
    allocate and comes from outside the function being traced (`jax.jit`, a library
    tracing a vector field), which then does not take it as an argument."""
    sites = list(slot_sites(module))
    if not sites:
        return
    allocated = [site.slot for site in sites if site.slot.allocated]
    arrays = [x for x in jtu.tree_leaves(module) if isinstance(x, jax.Array)]
    loop = _jax_internals.loop_closing_over(
        [x for x in jtu.tree_leaves(allocated) if isinstance(x, jax.Array)] or arrays
    )
    if loop is not None:
        message = _errors.LOOP_CLOSES_OVER.format(loop=loop)
    elif len(allocated) < len(sites) and _jax_internals.trace_closing_over(arrays):
        message = _errors.TRACE_CLOSES_OVER
    else:
        return
    warnings.warn(message, _errors.UncachedWarning, stacklevel=4)


def changed_slots(module: Any, frame: _context.Frame) -> dict[Path, Memo]:
    """The slots of `frame` that differ from those of `module`, by path."""
    before = slots(module)
    return {p: s for p, s in frame.store.items() if before.get(p) is not s}


def revive(module: M) -> M:
    """`module` with every slot whose arrays were deleted replaced by an empty allocation:
    it recomputes, and warns. Only a donation the caller asked for deletes a slot's arrays
    (`donate=` of `eqx.filter_jit` or `memox.filter_jit`, `jax.jit`'s `donate_argnums`):
    `memox.jit` donates a slot only where nothing else holds its arrays, and gives the
    module passed in the slot it returns (`_jit.py`)."""
    new = {}
    for site in slot_sites(module):
        leaves = jtu.tree_leaves(site.slot)
        if any(is_concrete_array(x) and x.is_deleted() for x in leaves):
            new[site.path] = jtu.tree_map(
                lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), site.slot
            )
    if new:
        warnings.warn(
            _errors.DELETED_SLOTS.format(slots=", ".join(map(path_name, new))), stacklevel=3
        )
    return replace_slots(module, new)


@overload
def init(module: M, /) -> M: ...
@overload
def init(module: M, fn: Fn[Concatenate[M, P], Any], /, *args: P.args, **kwargs: P.kwargs) -> M: ...
def init(module: M, fn: Fn[..., Any] | None = None, /, *args: Any, **kwargs: Any) -> M:
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
    module = allocate_plain_slots(module)
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
        site.path: allocate_like(site.slot, mesh)
        for site in slot_sites(shapes)
        if site.slot.allocated and not _same_storage(before[site.path], site.slot)
    }
    return replace_slots(module, new)


def _same_storage(slot: Memo, shapes: Memo) -> bool:
    return slot.allocated and (slot.value.shape, slot.value.dtype) == (
        shapes.value.shape,
        shapes.value.dtype,
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


def invalidate(module: M, /, *methods: MethodArg, when: Any = True) -> M:
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
        if not isinstance(method, CachedMethod):
            raise TypeError(_errors.NOT_CACHED.format(api="invalidate", got=repr(method)))
    sites = [
        site
        for site in slot_sites(module)
        if not methods or (site.field and method_for(site.owner, site.field) in methods)
    ]
    _invalidate_running(sites, when)
    return replace_slots(module, {site.path: invalidated(site.slot, when) for site in sites})


def _invalidate_running(sites: list[SlotSite], when: Any) -> None:
    """Inside `fn`, invalidate the slots of the running call too: its frame holds their
    current states, which a cached method reads whichever copy of the module it runs on
    (an invalidation inside a transformation opened inside `fn` is refused there, as
    any write of the frame is)."""
    frame = _context.top()
    if not isinstance(frame, _context.Frame):
        return
    for site in sites:
        path = frame.find(site.owner, site.field) if site.field else None
        if path is not None:
            frame.write(path, invalidated(frame.store[path], when), "memox.invalidate")


def hoist(module: M, /, *methods: MethodArg) -> M:
    """Read cached values now, for a computation that `memox.call` cannot see into.

    Inside `memox.call` or `memox.jit`, a cached method called inside a transformation
    that rebuilds the module (`eqx.filter_jit`, `jax.jit`, a loop body, a diffrax solve)
    cannot reach its slot, and computes at every evaluation (memox warns). `hoist` reads
    the value of each cached method without arguments once, through the running call (a
    hit, or one computation that fills the slot), and returns the module with those
    values in place of their slots: inside the transformation the method returns its
    value with no check and no branch, as if you had hoisted it by hand.

    Gradients are exact: each value is the method's value at the view's arrays, and is
    differentiated as such. A gradient taken outside the call, or inside `fn` around
    `hoist` itself, reaches the value where it was read (no recomputation, diffrax's
    adjoints included). A gradient taken inside `fn` *with respect to the view* or its
    arrays (`jax.grad`, `eqx.filter_grad`, `jax.jvp`, `jax.vjp` of a function of the
    view) differentiates the method on the view where it is read, so it computes at each
    such read, as the unmemoized code does (the view's value leaves get no gradient of
    their own). To read once, call `hoist` inside the differentiated function.

    The returned module is a view for that one computation: use the module `memox.call`
    returns afterwards, not the view (its values do not follow changes made to it).

    **Arguments:**

    - `module`: the module (or a part of it) that `fn` received.
    - `*methods`: cached methods to read, unbound (`VectorField.weight`); none: every
      cached method without arguments in `module`.

    **Returns:**

    `module` with those methods' slots replaced by their values.

    !!! Example

        ```python
        def solve(model, y0):
            term = diffrax.ODETerm(memox.hoist(model))   # model.weight(): once per solve
            return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0).ys

        ys, model = memox.call(model, solve, y0)
        ```
    """
    if not isinstance(_context.top(), _context.Frame):
        raise ValueError(_errors.HOIST_OUTSIDE_CALL)
    check_module("hoist", module)
    for method in methods:
        if not isinstance(method, CachedMethod):
            raise TypeError(_errors.NOT_CACHED.format(api="hoist", got=repr(method)))
    new = {}
    for site in slot_sites(module):
        method = method_for(site.owner, site.field) if site.field else None
        if method is None or method.takes_arguments or (methods and method not in methods):
            continue
        new[site.path] = Hoisted(method(site.owner))
    return replace_slots(module, new)


def strip(module: M) -> M:
    """`module` with every slot empty: no cache arrays at all.

    An empty slot holds no arrays (its fields are the integer marker `EMPTY`), so the
    stripped module holds your parameters only: save it to checkpoint without caches,
    with any checkpointer
    (`ocp.StandardCheckpointer().save(path, memox.strip(model))`,
    `eqx.tree_serialise_leaves(path, memox.strip(model))`), and restore it into
    `memox.strip(like)` (slots refill on first use). It is a module as constructed.

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


@dataclasses.dataclass(frozen=True)
class SlotStats:
    """How one slot was used.

    - `hits`: values returned from the slot; `misses`: values computed and stored. Both
      count memox's cache *decisions*, one per call of the method that reached the slot,
      not executions of its computation: under `jax.grad` a miss is one decision, and XLA
      may still hoist, share or remove the computation it stands for (count real
      executions with `jax.debug.callback` if that is what you need). For a batched
      module (slots with leading batch axes, e.g. from `eqx.filter_vmap(memox.init)`),
      arrays of those batch axes: one count per element.
    - `flops`: floating-point operations of one computation of the method (counted from
      its jaxpr when `memox.stats` asks, nested cached methods included; see
      `memox.flops` for what is counted), or `None` where memox has not planned the
      method yet. For a batched module, those of one element's computation.
    - `flops_unknown`: primitives of the method that have no FLOP rule (counted as 0 in
      `flops`), with how many times each occurs; empty when `flops` is exact.
    - `flops_saved`: `hits * flops` (per element for a batched module).

    A pytree whose leaves are `hits` and `misses`; `flops` and `flops_unknown` are
    static (known when the module is traced). So `memox.stats` can run inside
    `jax.jit` (or `eqx.filter_jit`, `jax.vmap`, ...) and its result be returned: the
    counts come back as integer arrays, equal to those `memox.stats` gives outside.
    Two `SlotStats` are equal where their counts are; `flops` is not compared.

    !!! Example

        ```python
        counts = jax.jit(memox.stats)(foo)  # {'b_cache': SlotStats(hits=Array(2, ...), ...)}
        assert counts == memox.stats(foo)   # the counts `memox.stats` gives outside
        ```
    """

    hits: int | jax.Array
    misses: int | jax.Array
    flops: int | None = dataclasses.field(default=None, compare=False)
    flops_unknown: Mapping[str, int] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def flops_saved(self) -> int | jax.Array | None:
        return None if self.flops is None else self.hits * self.flops


def _flatten_stats(s: SlotStats) -> tuple[tuple, tuple]:
    counts = ((jtu.GetAttrKey("hits"), s.hits), (jtu.GetAttrKey("misses"), s.misses))
    # Static fields are compared and hashed as JAX's cache keys: the mapping as a tuple.
    return counts, (s.flops, tuple(s.flops_unknown.items()))


def _unflatten_stats(static: tuple, counts: Any) -> SlotStats:
    # Built without `__init__`: JAX unflattens with leaves of any type (`None`,
    # `ShapeDtypeStruct`s, tracers), which a run-time type checker would refuse.
    s = object.__new__(SlotStats)
    names = ("hits", "misses", "flops", "flops_unknown")
    for name, value in zip(names, (*counts, static[0], dict(static[1])), strict=True):
        object.__setattr__(s, name, value)
    return s


jtu.register_pytree_with_keys(SlotStats, _flatten_stats, _unflatten_stats)


def stats(module: Any) -> dict[str, SlotStats]:
    """Hit and miss counts, and FLOPs saved, of every slot of `module`.

    The counters live in the slots, so they count calls made inside `jax.jit`,
    `memox.jit` and `lax.scan` as well as eager ones. They count the cache decisions
    memox made (a hit: the stored value was returned; a miss: the method was computed
    and stored), not executions: XLA may hoist, share or remove a computation, under
    `jax.grad` for instance (see `SlotStats`).

    A batched module, whose slots have leading batch axes (`eqx.filter_vmap(memox.init)`,
    a `jax.vmap` of `memox.call`, any number of such axes), has a count per element, and
    `flops` is the FLOPs of one element's computation: the method is planned on one
    element of the module (its arrays without the batch axes, which are the axes a
    slot's counters have beyond their own shape).

    **Arguments:**

    - `module`: a pytree holding `memox.Memo` slots.

    **Returns:**

    A dict from each slot's path in `module` (e.g. `"b_cache"`, `"encoder.gram_cache"`)
    to its `SlotStats`. Counts are Python ints outside of a trace, arrays inside one or
    for a batched module (one count per element). The dict is a pytree whose leaves are
    the counts: a function traced by `jax.jit` can return it.

    !!! Example

        ```python
        memox.stats(foo)   # {'b_cache': SlotStats(hits=2, misses=1, flops=8)}
        foos = eqx.filter_vmap(lambda a: memox.init(Foo(a)))(jnp.ones((5, 3, 3)))
        memox.stats(foos)  # hits, misses: int32 arrays of shape (5,); flops=8, one Foo's
        ```
    """
    check_module("stats", module)
    out = {}
    for site in slot_sites(module):
        slot = site.slot
        counts = (0, 0) if not slot.allocated else (slot.hits, slot.misses)
        count = _flops(site)
        flops, unknown = (None, {}) if count is None else (count.flops, dict(count.unknown))
        # (Checkers cannot count the items of a `map`: the two counts.)
        out[path_name(site.path)] = SlotStats(*map(_concrete, counts), flops, unknown)  # pyright: ignore[reportCallIssue]
    return out


def _flops(site: SlotSite) -> FlopCount | None:
    """The FLOPs of one computation of the slot's method: for a batched module, planned
    on one element of the owner (its arrays' leading batch axes dropped, abstractly)."""
    method = method_for(site.owner, site.field) if site.field else None
    if method is None:
        return None
    if method.takes_arguments:  # planned when called (under `vmap`: on one element)
        return None if method.latest_plan is None else method.latest_plan.flops
    # The batch axes: those the counters have beyond their own shape (scalars).
    batch = tuple(site.slot.hits.shape) if site.slot.allocated else ()
    if not batch:
        return plan_without_arguments(method.spec, site.owner).flops

    def element(x: Any) -> Any:
        if not eqx.is_array(x) or tuple(x.shape[: len(batch)]) != batch:
            return x  # (an array without the batch axes is the same for every element)
        weak = bool(getattr(jax.typeof(x), "weak_type", False))
        return jax.ShapeDtypeStruct(x.shape[len(batch) :], x.dtype, weak_type=weak)

    one = jtu.tree_map(element, site.owner)
    # Planned in `eval_shape`, on the element's abstract arrays: nothing is computed.
    return eqx.filter_eval_shape(lambda o: plan_without_arguments(method.spec, o).flops, one)


def _concrete(x: Any) -> int | jax.Array:
    # A batched module (e.g. from `eqx.filter_vmap(memox.init)`) has a count per element.
    return x if isinstance(x, jax.core.Tracer) or jnp.ndim(x) else int(x)
