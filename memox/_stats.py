"""`memox.stats`: how each slot of a module was used (`SlotStats`: hits, misses, and the
FLOPs of one computation of its method, counted when asked)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._cached import method_for
from ._call import check_module, check_slots
from ._plan import plan_without_arguments
from ._sites import SlotSite, path_name, slot_sites


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported

    from ._flops import FlopCount


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


def stats(module: PyTree) -> dict[str, SlotStats]:
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
    sites = list(slot_sites(module))
    check_slots("stats", module, sites)
    out = {}
    for site in sites:
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
    # The batch axes: those the counts have beyond their own two.
    batch = tuple(site.slot.counts.shape[:-2]) if site.slot.allocated else ()
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
