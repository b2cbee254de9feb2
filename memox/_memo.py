"""The memoised operation: what happens when a cached method is called in a frame.

For a planned call (`_plan.py`), `Memoised` runs one operation, built once per plan:

1. **Check** (in-graph): fingerprint the dependencies and the array arguments (the
   policy says which; a concrete array's fingerprint is kept by identity) and chain them
   onto the static key's digest (`_key.py`); it is a hit when a valid entry holds that
   key and the policy allows reusing it.
2. **Branch** (in-graph): `lax.cond` passes the slot through on a hit (its counters
   updated) and runs the method and stores its value on a miss; the value is then read
   from the slot. A hit therefore skips the computation at run time. Cached methods
   reached inside the miss branch get a frame of their own, with the slots below this
   module threaded through the branch, so nested caches fill once. Under `vmap` with a
   batched predicate both branches would run (a `select`): the operation then computes,
   stores and counts a miss, and says so (`_ledger.py`). In the loop of a `memox.scan`,
   a slot the loop cannot change is *pinned*: its value is the one the first step
   returned, closed over by the loop body (`_context.Pins.read`), with no fingerprint
   and no branch (a hit by construction).
3. **Differentiate**: the operation is a `jax.custom_jvp` with symbolic zeros. When no
   dependency or argument carries a tangent (a frozen part) it is the branch above and
   its tangent is a symbolic zero: a hit recomputes nothing, even under `jax.grad`.
   Otherwise the tangent is `jax.jvp` of the method itself, so gradients are exactly
   those of the unmemoized computation; the value is recomputed there and stored.
   Eagerly (no transformation tracing) nothing carries a tangent: the primal runs
   without the `custom_jvp`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import _context, _errors, _jax_internals, _ledger, _prehash
from ._caches import Cache
from ._fingerprint import combine
from ._plan import Call, Method, Parts, Plan
from ._policy import fresh
from ._sites import Path, path_name
from ._slot import Memo, is_memo, replaced
from ._storage import as_data, pack, retyped, strong, unpack
from ._table import counts_after, entry, entry_kept, holding, lookup, passed_on, stored


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


def memoised(call: Call) -> Any:
    """The value of `call`: read from its slot where the key says it may be reused,
    else computed and stored; the slot's new state is written to the call's frame."""
    return Memoised.of(call).run(call)


@dataclasses.dataclass(frozen=True)
class Nested:
    """Where the slots a nested cached method may fill lie, for one call (a static,
    hashable argument of the operation): the owner's path, the paths of the owner's
    slots relative to it, and those (other than the call's own) threaded through the
    miss branch."""

    owner: Path
    memo_paths: tuple[Path, ...]
    threaded: tuple[Path, ...]


class Memoised:
    """The memoised operation of one plan: its primal (check, branch, read) and tangent
    rules as methods of one `jax.custom_jvp`, made once per plan and module skeleton."""

    def __init__(self, method: Method, plan: Plan, parts: Parts, arg_parts: Parts, n: int):
        self.method, self.plan, self.parts, self.arg_parts = method, plan, parts, arg_parts
        self.policy = method.policy
        self.used = frozenset(plan.used)
        self.n_arrays = n
        self.op = jax.custom_jvp(self.primal, nondiff_argnums=(0,))
        self.op.defjvp(self.tangent, symbolic_zeros=True)

    @classmethod
    def of(cls, call: Call) -> Memoised:
        """The operation of `call`'s plan (a plan is made per static key, which holds
        both skeletons: their non-array parts are the same up to their tokens)."""
        found = _MADE.get(call.plan)
        if found is None:
            found = cls(call.method, call.plan, call.parts, call.arg_parts, len(call.arrays))
            _MADE.put(call.plan, found)
        return found

    # -- one call ------------------------------------------------------------------------

    def run(self, call: Call) -> Any:
        frame, path, policy = call.frame, call.path, self.policy
        slot = call.slot
        deps = [x for i, x in enumerate(call.arrays) if i in self.used]
        others = [x for i, x in enumerate(call.arrays) if i not in self.used]
        keyed = [*deps, *call.arg_arrays] if policy.keys_dependencies else call.arg_arrays
        # In a `memox.scan` body, a slot the loop cannot change is read without a branch.
        pins = _context.pins()
        if pins is not None and pins.claim(slot, policy.max_age, [*deps, *call.arg_arrays], keyed):
            value, slot = pins.read(slot, self.plan.spec)  # a hit by construction
            frame.write(path, slot, self.method.qualname)
            return value
        markers = _ledger.store(self.method.qualname, path_name(path))
        # In a compiled wrapper, a call whose hit its wrapper can decide on the host.
        reads = [*deps, *call.arg_arrays] if policy.snapshots else keyed
        claim = None
        if markers is None:
            claim = _prehash.claim(slot, policy.max_age, reads, self.plan.spec, self.plan.key)
        if claim is not None and claim.decided is not None:  # a hit, decided on the host
            # (its value, read from the table once on the host: an input of the program)
            index, value = claim.decided
            slot = passed_on(slot, index)
            claim.left(slot, index)
            frame.write(path, slot, self.method.qualname)
            return value
        nested = self._nested(call)
        sub = [frame.store[p] for p in nested.threaded]
        key = combine([frame.fingerprint(x) for x in keyed], self.plan.salt)
        operands = (nested, deps, others, call.arg_arrays, slot, sub, key)
        if markers is None:
            # Eagerly nothing can be differentiated: the primal runs without the
            # `custom_jvp` (its trace of every array passed was half of an eager hit).
            op = self.op if _jax_internals.transforming() else self.primal
            value, new_slot, new_sub = op(*operands)
            if claim is not None:  # the host decides the next call (`_decided.Claims.held`)
                claim.left(new_slot, holding(new_slot, key))
        else:  # the enclosing call checks that this store reaches its outputs
            with markers[0]:
                value, new_slot, new_sub = self.op(*operands)
            with markers[1]:
                new_slot = dataclasses.replace(
                    new_slot, key=lax.optimization_barrier(new_slot.key)
                )
        if pins is not None:  # the first step of a `memox.scan`: what its loop will read
            pins.filled(slot, new_slot, key, value)
        frame.write(path, new_slot, self.method.qualname)
        for p, s in zip(nested.threaded, new_sub):
            frame.write(p, s, self.method.qualname)
        return value

    def _nested(self, call: Call) -> Nested:
        """The slots below the call's module (but its own) that a nested cached method
        may fill: threaded through the miss branch, so that they fill in the same
        computation."""
        owner = call.path[:-1]
        if not self.plan.nested:
            return Nested(owner, (), ())
        memo_paths = tuple(_slot_paths(call.module))
        threaded = tuple(
            owner + p
            for p in memo_paths
            if owner + p != call.path
            and owner + p in call.frame.store
            and call.frame.store[owner + p].allocated
        )
        return Nested(owner, memo_paths, threaded)

    # -- the primal: check, branch, read ------------------------------------------------

    def primal(self, nested: Nested, deps, others, arg_arrays, slot, sub, key):
        policy, spec = self.policy, self.plan.spec
        snapshots = []
        if policy.snapshots:
            snapshots = jax.vmap(lambda b: unpack(b, self.plan.deps))(slot.snapshot)
            snapshots = [as_data(s) for s in snapshots]
        reusable = fresh(policy, slot, [as_data(d) for d in deps], snapshots)
        hit, index = lookup(slot, key, reusable)
        slot, sub = _jax_internals.varying_like((slot, sub), (deps, others, arg_arrays, key))
        operands = (nested, index, deps, others, arg_arrays, slot, sub, key)
        if _jax_internals.is_batched(hit):  # a `select`: both branches would run
            _ledger.record_uncached(self.method.qualname, _errors.BATCHED_PREDICATE)
            slot, sub, index = self.miss(*operands)
        elif isinstance(hit, jax.core.Tracer):
            # The counters move after the branch, in one operation for both (`counts_after`).
            slot, sub, index = lax.cond(
                hit,
                self.reused,
                lambda *o: self.miss(nested, *o, counted=False),
                *operands[1:],
            )
            slot = replaced(slot, {"counts": counts_after(slot.counts, index, hit)})
        else:  # eagerly
            slot, sub, index = (self.hit if bool(hit) else self.miss)(*operands)
            return entry_kept(slot, index, spec), slot, sub
        return entry(slot, index, spec), slot, sub

    # The branches return the slot, never the value: on a hit the table passes through
    # (no copy where its buffer is donated, as `memox.jit` does; eagerly the very arrays),
    # and the value is read from the table after the branch, where XLA can fuse the read
    # into its consumers.
    def hit(self, nested, index, deps, others, arg_arrays, slot, sub, key):
        return passed_on(slot, index), sub, index

    def reused(self, index, deps, others, arg_arrays, slot, sub, key):
        """A traced call's hit branch: the slot as it came (the counters move after the
        branch)."""
        return slot, sub, index

    def miss(self, nested, index, deps, others, arg_arrays, slot, sub, key, counted=True):
        value, sub = self.compute(nested, deps, others, arg_arrays, sub, caching=True)
        slot, index = self.store(slot, value, deps, key, counted)
        return slot, sub, index

    def compute(self, nested: Nested, deps, others, arg_arrays, sub, *, caching: bool):
        """The method's value (nested cached methods filling the threaded slots `sub`
        where `caching`), and `sub` after it."""
        a, k = self.arg_parts.rebuild(arg_arrays)
        arrays = self._merge(deps, others)
        if caching and self.plan.nested:
            states = dict(zip(nested.threaded, sub))
            memo = [states.get(nested.owner + p, Memo()) for p in nested.memo_paths]
            view = self.parts.rebuild(arrays, memo)
            inner = _context.Frame(view, nested.owner, method=self.method.qualname)
            with _context.active(inner):
                value = self.method.fn(view, *a, **k)
            return strong(value), [inner.store[p] for p in nested.threaded]
        with _context.active(_context.Plain()):
            value = self.method.fn(self.parts.rebuild(arrays), *a, **k)
        return strong(value), sub

    def store(
        self, slot: Memo, value: Any, deps: Sequence[Any], key: Any, counted: bool = True
    ) -> tuple[Memo, Any]:
        snapshot = pack(deps) if self.policy.snapshots else None
        return stored(slot, value, self.plan.spec, key, snapshot, counted)

    def _merge(self, deps: Sequence[Any], others: Sequence[Any]) -> list[Any]:
        deps_, others_ = iter(deps), iter(others)
        return [next(deps_) if i in self.used else next(others_) for i in range(self.n_arrays)]

    # -- the tangent ----------------------------------------------------------------------

    def tangent(self, nested: Nested, primals, tangents):
        deps, others, arg_arrays, slot, sub, key = primals
        dep_tangents, _, arg_tangents, _, _, _ = tangents
        if all(map(_is_zero, [*dep_tangents, *arg_tangents])):  # a frozen part
            out = self.primal(nested, *primals)
            return out, jtu.tree_map(SymbolicZero.from_primal_value, out)

        def value_of(deps, arg_arrays):
            return self.compute(nested, deps, others, arg_arrays, sub, caching=False)[0]

        value, value_tangent = jax.jvp(
            value_of,
            (deps, arg_arrays),
            (_instantiate(dep_tangents, deps), _instantiate(arg_tangents, arg_arrays)),
        )
        new_slot, _ = self.store(slot, value, deps, key)
        zeros = jtu.tree_map(SymbolicZero.from_primal_value, (new_slot, sub))
        return (retyped(value, self.plan.spec), new_slot, sub), (value_tangent, *zeros)


_MADE = Cache("memoised operations", 4096)  # Plan -> Memoised


def _slot_paths(module: Any) -> list[Path]:
    items = jtu.tree_flatten_with_path(module, is_leaf=is_memo)[0]
    return [p for p, leaf in items if is_memo(leaf)]


def _is_zero(tangent: Any) -> bool:
    return isinstance(tangent, SymbolicZero) or tangent.dtype == jax.dtypes.float0


def _instantiate(tangents: Sequence[Any], primals: Sequence[Any]) -> list[Any]:
    out = []
    for t, x in zip(tangents, primals):
        if isinstance(t, SymbolicZero):
            # (JAX types `aval` as `AbstractValue`; a zero of an array has a `ShapedArray`.)
            dtype = t.aval.dtype  # pyright: ignore[reportAttributeAccessIssue]
            if dtype == jax.dtypes.float0:
                t = np.zeros(x.shape, dtype)
            elif dtype == x.dtype:
                # (`zeros_like` keeps a 64-bit dtype read with x64 off, as the primal
                # has it, where `jnp.zeros(shape, float64)` would truncate it and warn.)
                t = jnp.zeros_like(x)
            else:
                t = jnp.zeros(x.shape, dtype)
        out.append(t)
    return out
