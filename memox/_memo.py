"""The memoised operation: what happens when a cached method is called in a frame.

For a planned call (`_plan.py`), `memoised` runs one operation:

1. **Check** (in-graph): fingerprint the dependencies and the array arguments (the
   policy says which; a concrete array's fingerprint is kept by identity) and chain them
   onto the static key's digest (`_key.py`); it is a hit when a valid entry holds that
   key and the policy allows reusing it.
2. **Branch** (in-graph): `lax.cond` passes the slot through on a hit (its counters
   updated) and runs the method and stores its value on a miss; the value is then read
   from the slot. A hit therefore skips the computation at run time. Cached methods
   reached inside the miss branch get a frame of their own, with the slots below this
   module threaded through the branch, so nested caches fill once. In the loop of a
   `memox.scan`, a slot the loop cannot change is *pinned*: its value is the one the
   first step returned, closed over by the loop body (`_context.Pins.read`), with no
   fingerprint and no branch (a hit by construction).
3. **Differentiate**: the operation is a `jax.custom_jvp` with symbolic zeros. When no
   dependency or argument carries a tangent (a frozen part) it is the branch above and
   its tangent is a symbolic zero: a hit recomputes nothing, even under `jax.grad`.
   Otherwise the tangent is `jax.jvp` of the method itself, so gradients are exactly
   those of the unmemoized computation; the value is recomputed there and stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import _context, _jax_internals
from ._fingerprint import combine
from ._plan import Call
from ._policy import fresh
from ._slot import (
    Memo,
    Path,
    conformed,
    entry,
    is_memo,
    lookup,
    stored,
    strong,
    touched,
)
from ._storage import as_data, pack, retyped, unpack


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


def memoised(call: Call) -> Any:
    """The value of `call`: read from its slot where the key says it may be reused,
    else computed and stored; the slot's new state is written to the call's frame."""
    method, frame, path, module = call.method, call.frame, call.path, call.module
    parts, arrays, arg_parts, arg_arrays = call.parts, call.arrays, call.arg_parts, call.arg_arrays
    the_plan, slot = (
        call.plan,
        conformed(call.slot, call.plan.spec, [*call.arrays, *call.arg_arrays]),
    )
    policy = method.policy
    used = set(the_plan.used)
    deps = [x for i, x in enumerate(arrays) if i in used]
    others = [x for i, x in enumerate(arrays) if i not in used]
    keyed = [*deps, *arg_arrays] if policy.keys_dependencies else arg_arrays
    # In a `memox.scan` body, a slot the loop cannot change is read without a branch.
    pins = _context.pins()
    if pins is not None and pins.claim(slot, policy.max_age, [*deps, *arg_arrays], keyed):
        value, slot = pins.read(slot, the_plan.spec)  # a hit by construction (`_scan.py`)
        frame.write(path, slot, method.qualname)
        return value
    # A method that calls other cached methods threads the slots below its module (but
    # its own) through its miss branch, so that those fill in the same computation.
    owner_path = path[:-1]
    memo_paths = [owner_path + p for p in _slot_paths(module)] if the_plan.nested else []
    sub_paths = [
        p for p in memo_paths if p != path and p in frame.store and frame.store[p].allocated
    ]
    sub = [frame.store[p] for p in sub_paths]

    n_arrays = len(arrays)

    def merge(deps: Sequence[Any], others: Sequence[Any]) -> list[Any]:
        deps_, others_ = iter(deps), iter(others)
        return [next(deps_) if i in used else next(others_) for i in range(n_arrays)]

    def compute(deps, others, arg_arrays, sub, *, caching: bool):
        a, k = arg_parts.rebuild(arg_arrays)
        if caching and the_plan.nested:
            states = dict(zip(sub_paths, sub))
            view = parts.rebuild(merge(deps, others), [states.get(p, Memo()) for p in memo_paths])
            inner = _context.Frame(view, owner_path, method=method.qualname)
            with _context.active(inner):
                value = method.fn(view, *a, **k)
            return strong(value), [inner.store[p] for p in sub_paths]
        with _context.active(_context.Plain()):
            value = method.fn(parts.rebuild(merge(deps, others)), *a, **k)
        return strong(value), sub

    def store(slot, value, deps, key):
        snapshot = pack(deps) if policy.snapshots else jnp.zeros((0,), jnp.uint8)
        return stored(slot, value, the_plan.spec, key, snapshot)

    # The branches return the slot, never the value: on a hit the table passes through
    # (no copy where its buffer is donated, as `memox.jit` does), and the value is read
    # from the table after the branch, where XLA can fuse the read into its consumers.
    def hit_branch(index, deps, others, arg_arrays, slot, sub, key):
        return touched(slot, index), sub, index

    def miss_branch(index, deps, others, arg_arrays, slot, sub, key):
        value, sub = compute(deps, others, arg_arrays, sub, caching=True)
        slot, index = store(slot, value, deps, key)
        return slot, sub, index

    def primal(deps, others, arg_arrays, slot, sub, key):
        snapshots = []
        if policy.snapshots:
            snapshots = jax.vmap(lambda b: unpack(b, the_plan.deps))(slot.snapshot)
            snapshots = [as_data(s) for s in snapshots]
        reusable = fresh(policy, slot.age, [as_data(d) for d in deps], snapshots)
        hit, index = lookup(slot, key, reusable)
        slot, sub = _jax_internals.varying_like((slot, sub), (deps, others, arg_arrays, key))
        operands = (index, deps, others, arg_arrays, slot, sub, key)
        if isinstance(hit, jax.core.Tracer):
            slot, sub, index = lax.cond(hit, hit_branch, miss_branch, *operands)
        else:
            slot, sub, index = (hit_branch if bool(hit) else miss_branch)(*operands)
        return entry(slot, index, the_plan.spec), slot, sub

    def tangent_rule(primals, tangents):
        deps, others, arg_arrays, slot, sub, key = primals
        dep_tangents, _, arg_tangents, _, _, _ = tangents
        if all(map(_is_zero, [*dep_tangents, *arg_tangents])):
            out = primal(*primals)
            return out, jtu.tree_map(SymbolicZero.from_primal_value, out)

        def value_of(deps, arg_arrays):
            return compute(deps, others, arg_arrays, sub, caching=False)[0]

        value, value_tangent = jax.jvp(
            value_of,
            (deps, arg_arrays),
            (_instantiate(dep_tangents, deps), _instantiate(arg_tangents, arg_arrays)),
        )
        new_slot, _ = store(slot, value, deps, key)
        zeros = jtu.tree_map(SymbolicZero.from_primal_value, (new_slot, sub))
        return (retyped(value, the_plan.spec), new_slot, sub), (value_tangent, *zeros)

    memo = jax.custom_jvp(primal)
    memo.defjvp(tangent_rule, symbolic_zeros=True)
    key = combine([frame.fingerprint(x) for x in keyed], the_plan.salt)
    value, new_slot, new_sub = memo(deps, others, arg_arrays, slot, sub, key)
    if pins is not None:  # the first step of a `memox.scan`: what its loop will read
        pins.filled(slot, new_slot, key, value)
    frame.write(path, new_slot, method.qualname)
    for p, s in zip(sub_paths, new_sub):
        frame.write(p, s, method.qualname)
    return value


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
            t = (
                np.zeros(x.shape, dtype)
                if dtype == jax.dtypes.float0
                else jnp.zeros(x.shape, dtype)
            )
        out.append(t)
    return out
