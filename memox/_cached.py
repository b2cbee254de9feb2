"""`memox.cached`: binding a method to a slot, and what happens when it is called.

Inside a `memox.call`, calling a cached method runs one operation, `_memo`:

1. **Plan** (once per method, module structure and shapes; cached): trace the method to
   a jaxpr with caching off and ask which of the module's arrays it actually reads (dead
   code elimination). Those are its dependencies. The static part of its fingerprint
   (method, tree structure with static fields, shapes, non-array arguments) and the
   shape of its value come from the same trace.
2. **Check** (in-graph): fingerprint the dependencies and the array arguments (the
   policy says which; a concrete array's fingerprint is kept by identity); it is a hit
   when a valid entry holds that key and the policy allows reusing it.
3. **Branch** (in-graph): `lax.cond` passes the slot through on a hit (its counters
   updated) and runs the method and stores its value on a miss; the value is then read
   from the slot. A hit therefore skips the computation at run time. Cached methods
   reached inside the miss branch get a frame of their own, with the slots below this
   module threaded through the branch, so nested caches fill once. In the loop of a
   `memox.scan`, a slot the loop cannot change is *pinned*: read with no branch (a hit
   by construction), its entries passed on as the arrays that came in.
4. **Differentiate**: `_memo` is a `jax.custom_jvp` with symbolic zeros. When no
   dependency or argument carries a tangent (a frozen part) it is the branch above and
   its tangent is a symbolic zero: a hit recomputes nothing, even under `jax.grad`.
   Otherwise the tangent is `jax.jvp` of the method itself, so gradients are exactly
   those of the unmemoized computation; the value is recomputed there and stored.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import _context, _errors, _jax_internals
from ._fingerprint import combine, static_digest
from ._flops import flops_of_jaxpr
from ._policy import Exact, Policy, fresh
from ._slot import (
    ENTRY_FIELDS,
    Memo,
    Path,
    allocate,
    entry,
    is_memo,
    lookup,
    path_name,
    stored,
    strong,
    touched,
)
from ._storage import Spec, pack, packed_size, unpack


# -- the decorator --------------------------------------------------------------------


class CachedMethod:
    """A method bound to a `Memo` slot (what `memox.cached` returns)."""

    def __init__(self, fn: Callable[..., Any], slot: str, policy: Policy):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.slot = slot
        self.policy = policy
        self.flops: int | None = None  # of one computation, from the latest plan
        self.qualname: str = getattr(fn, "__qualname__", repr(fn))
        params = list(inspect.signature(fn).parameters.values())[1:]
        required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.takes_arguments = any(
            p.default is p.empty and (p.kind in required or p.kind == p.KEYWORD_ONLY)
            for p in params
        )

    def __set_name__(self, owner: type, name: str) -> None:
        self.qualname = f"{owner.__qualname__}.{name}"
        _check_slot(owner, name, self.slot)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        frame = _context.top()
        if isinstance(frame, _context.Plain):
            frame.nested = True
        elif frame is not None:
            path = frame.find(module, self.slot)
            if path is not None:
                call = _Call.prepare(self, frame, path, module, args, kwargs)
                if frame.discover:  # `memox.init`: allocate the slot, then compute
                    frame.write(path, call.slot, self.qualname)
                    return self.fn(module, *args, **kwargs)
                return _memo(call)
        return self.fn(module, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<memox.cached('{self.slot}') {self.qualname}>"


# Parameters that memox validates itself, with messages that say what to do, are typed
# for static checkers only: a runtime type checker would otherwise answer first.
SlotName = str if typing.TYPE_CHECKING else Any
PolicyArg = Policy | None if typing.TYPE_CHECKING else Any


@typing.overload
def cached(
    slot: str, /, *, policy: Policy = ...
) -> Callable[[Callable[..., Any]], CachedMethod]: ...
@typing.overload
def cached(slot: str, method: Callable[..., Any], /, *, policy: Policy = ...) -> CachedMethod: ...
def cached(
    slot: SlotName, method: Callable[..., Any] | None = None, /, *, policy: PolicyArg = None
) -> Any:
    """Bind a method of an `eqx.Module` to one of its `memox.Memo` slots.

    **Arguments:**

    - `slot`: the name of a field of the same class declared as `memox.Memo[...]`.
    - `method`: the method (usually omitted: `cached("slot")` is a decorator).
    - `policy`: when a stored value may be reused (`memox.policies`): `Exact()` (the
      default) while nothing it depends on has changed; `Drift(rtol=...)` while its
      dependencies stay within a tolerance; `Manual()` until `memox.invalidate`. Each
      takes `max_age=k` to recompute after `k` hits.

    Inside `memox.call` or `memox.jit`, the method returns the slot's value when nothing
    it depends on has changed (the module's arrays it reads, the module's static fields,
    its own arguments) and computes and stores it otherwise. Outside them it simply
    computes. Arguments the method takes are part of the cache key.

    !!! Example

        ```python
        class Gram(eqx.Module):
            x: jax.Array
            chol_cache: memox.Memo[jax.Array] = memox.Memo()

            @memox.cached("chol_cache")
            def chol(self):
                return jnp.linalg.cholesky(self.x @ self.x.T + jnp.eye(3))

        L, model = memox.call(Gram(jnp.eye(3)), Gram.chol)
        ```
    """
    if not isinstance(slot, str):
        raise TypeError(_errors.SLOT_NAME_NOT_STR.format(slot=slot))
    policy = Exact() if policy is None else policy
    if not isinstance(policy, Policy):
        raise TypeError(_errors.NOT_A_POLICY.format(got=type(policy).__name__))
    if method is None:
        return lambda fn: CachedMethod(fn, slot, policy)
    return CachedMethod(method, slot, policy)


def _check_slot(owner: type, name: str, slot: str) -> None:
    annotations: dict[str, Any] = {}
    for klass in reversed(owner.__mro__):
        annotations.update(klass.__dict__.get("__annotations__", {}))
    where = dict(slot=slot, cls=owner.__name__, name=name)
    if slot not in annotations:
        raise ValueError(_errors.UNKNOWN_SLOT.format(**where))
    default = next((k.__dict__[slot] for k in owner.__mro__ if slot in k.__dict__), None)
    annotation = annotations[slot]
    if not (isinstance(default, Memo) or _is_memo_annotation(annotation)):
        shown = getattr(annotation, "__qualname__", None) or str(annotation)
        raise ValueError(_errors.NOT_A_MEMO_FIELD.format(annotation=shown, **where))
    for other_name, other in cached_methods(owner, skip=name).items():
        if other.slot == slot:
            raise ValueError(_errors.SLOT_TAKEN.format(other=other_name, **where))


def _is_memo_annotation(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return annotation.split("[")[0].split(".")[-1].strip() == "Memo"
    return annotation is Memo or typing.get_origin(annotation) is Memo


def cached_methods(cls: type, skip: str | None = None) -> dict[str, CachedMethod]:
    """The cached methods of `cls` by attribute name (subclasses override bases)."""
    found: dict[str, CachedMethod] = {}
    for klass in reversed(cls.__mro__):
        for attr, value in klass.__dict__.items():
            if attr == skip:
                found.pop(attr, None)
            elif isinstance(value, CachedMethod):
                found[attr] = value
            else:
                found.pop(attr, None)
    return found


def method_for(owner: Any, field: str) -> CachedMethod | None:
    """The cached method bound to `owner.<field>`, if any."""
    for method in cached_methods(type(owner)).values():
        if method.slot == field:
            return method
    return None


# -- planning: dependencies, static fingerprint, value shape ------------------------


@dataclasses.dataclass(frozen=True)
class _Parts:
    """The skeleton of a module or argument pytree: its structure and its static leaves.

    It holds no array (arrays may be tracers, and a skeleton outlives the trace in the
    closures of the memoised operation): `split` hands the arrays out separately.
    """

    treedef: Any
    statics: tuple[Any, ...]  # the leaf itself where static, else None
    kinds: tuple[str, ...]  # "array", "memo" or "static", per leaf

    @classmethod
    def split(cls, tree: Any) -> tuple[_Parts, list[Any]]:
        leaves, treedef = jtu.tree_flatten(tree, is_leaf=is_memo)
        kinds = tuple(
            "memo" if is_memo(x) else "array" if eqx.is_array(x) else "static" for x in leaves
        )
        statics = tuple(x if k == "static" else None for x, k in zip(leaves, kinds))
        arrays = [x for x, k in zip(leaves, kinds) if k == "array"]
        return cls(treedef, statics, kinds), arrays

    def rebuild(self, arrays: Sequence[Any], slots: Sequence[Any] | None = None) -> Any:
        """The tree with these arrays, and these slots (default: empty ones)."""
        arrays_, slots_ = iter(arrays), iter(slots or ())
        out = []
        for leaf, kind in zip(self.statics, self.kinds):
            if kind == "array":
                out.append(next(arrays_))
            elif kind == "memo":
                out.append(next(slots_) if slots is not None else Memo())
            else:
                out.append(leaf)
        return jtu.tree_unflatten(self.treedef, out)

    def static_text(self) -> str:
        statics = [_stable_repr(x) for x, k in zip(self.statics, self.kinds) if k == "static"]
        return f"{self.treedef}|{statics}"


def _stable_repr(x: Any) -> str:
    """`repr`, but for functions and classes a name that is stable across processes."""
    if callable(x) and hasattr(x, "__qualname__"):
        return f"{getattr(x, '__module__', '?')}.{x.__qualname__}"
    return repr(x)


def _aval_text(x: Any) -> tuple[tuple[int, ...], str]:
    return tuple(x.shape), str(x.dtype)


@dataclasses.dataclass(frozen=True)
class Plan:
    used: tuple[int, ...]  # which of the module's arrays the method reads
    nested: bool  # whether it calls other cached methods
    spec: Spec  # what it returns
    deps: Spec  # what it reads (the used arrays), for snapshots
    salt: tuple[int, int]  # static part of the fingerprint
    flops: int  # of one computation, nested cached methods included

    def snapshot_bytes(self, policy: Policy) -> int:
        return packed_size(self.deps) if policy.snapshots else 0


_PLANS: dict[Any, Plan] = {}
_MAX_PLANS = 4096
_SUPPORTED = (jnp.bool_, jnp.integer, jnp.unsignedinteger, jnp.floating, jnp.complexfloating)


def plan(
    method: CachedMethod, module: _Parts, arrays: list[Any], args: _Parts, arg_arrays: list[Any]
) -> Plan:
    static = f"{module.static_text()}#{args.static_text()}"
    avals = (tuple(map(_aval_text, arrays)), tuple(map(_aval_text, arg_arrays)))
    cache_key = (method, static, avals)
    found = _PLANS.get(cache_key)
    if found is not None:
        return found

    def run(arrays: list[Any], arg_arrays: list[Any]) -> Any:
        a, k = args.rebuild(arg_arrays)
        return method.fn(module.rebuild(arrays), *a, **k)

    structs = [[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs] for xs in (arrays, arg_arrays)]
    with _context.active(_context.Plain()) as plain:
        closed, out = jax.make_jaxpr(run, return_shape=True)(*structs)
    for leaf in jtu.tree_leaves(out):
        if not any(jnp.issubdtype(leaf.dtype, t) for t in _SUPPORTED):
            raise TypeError(
                _errors.UNSUPPORTED_DTYPE.format(method=method.qualname, dtype=leaf.dtype)
            )
    used_inputs = _jax_internals.used_inputs(closed)
    used = tuple(i for i in range(len(arrays)) if used_inputs[i])
    spec = Spec.of(out)
    deps = Spec.of([structs[0][i] for i in used])
    salt = static_digest(
        method.qualname, method.policy, static, used, [avals[0][i] for i in used], avals[1], spec
    )
    found = Plan(used, plain.nested, spec, deps, salt, flops_of_jaxpr(closed))
    method.flops = found.flops
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[cache_key] = found
    return found


def plan_without_arguments(method: CachedMethod, owner: Any) -> Plan:
    """The plan of `method(owner)` (no FLOPs spent)."""
    return plan(method, *_Parts.split(owner), *_Parts.split(((), {})))


# -- the memoised operation -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a cached method found in a frame, planned, its slot fitted."""

    method: CachedMethod
    frame: _context.Frame
    path: Path
    module: Any
    parts: _Parts
    arrays: list[Any]
    arg_parts: _Parts
    arg_arrays: list[Any]
    plan: Plan
    slot: Memo

    @classmethod
    def prepare(cls, method, frame, path, module, args, kwargs) -> _Call:
        parts, arrays = _Parts.split(module)
        arg_parts, arg_arrays = _Parts.split((args, kwargs))
        the_plan = plan(method, parts, arrays, arg_parts, arg_arrays)
        slot = _fit(method, frame, path, frame.store[path], the_plan)
        return cls(
            method, frame, path, module, parts, arrays, arg_parts, arg_arrays, the_plan, slot
        )


def _memo(call: _Call) -> Any:
    method, frame, path, module = call.method, call.frame, call.path, call.module
    parts, arrays, arg_parts, arg_arrays = call.parts, call.arrays, call.arg_parts, call.arg_arrays
    the_plan, slot = call.plan, call.slot
    policy = method.policy
    used = set(the_plan.used)
    deps = [x for i, x in enumerate(arrays) if i in used]
    others = [x for i, x in enumerate(arrays) if i not in used]
    keyed = [*deps, *arg_arrays] if policy.keys_dependencies else arg_arrays
    # In a `memox.scan` body, a slot the loop cannot change is read without a branch.
    pins = _context.pins()
    pinned = pins is not None and pins.claim(slot, policy.max_age, [*deps, *arg_arrays], keyed)
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
        reusable = fresh(policy, slot.age, deps, snapshots)
        hit, index = lookup(slot, key, reusable)
        if pinned:  # a hit by construction (see `_scan.py`)
            return entry(slot, index, the_plan.spec), touched(slot, index), sub
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
        return (value, new_slot, sub), (value_tangent, *zeros)

    memo = jax.custom_jvp(primal)
    memo.defjvp(tangent_rule, symbolic_zeros=True)
    key = combine([frame.fingerprint(x) for x in keyed], the_plan.salt)
    value, new_slot, new_sub = memo(deps, others, arg_arrays, slot, sub, key)
    if pinned:  # the entries pass through as the very arrays that came in
        new_slot = dataclasses.replace(new_slot, **{f: getattr(slot, f) for f in ENTRY_FIELDS})
        new_sub = sub
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
            dtype = t.aval.dtype
            t = (
                np.zeros(x.shape, dtype)
                if dtype == jax.dtypes.float0
                else jnp.zeros(x.shape, dtype)
            )
        out.append(t)
    return out


def _fit(
    method: CachedMethod, frame: _context.Frame, path: Path, slot: Memo, the_plan: Plan
) -> Memo:
    """`slot` with room for the value of `the_plan`, allocated where the structure may change."""
    snapshot_bytes = the_plan.snapshot_bytes(method.policy)
    if slot.holds(the_plan.spec, snapshot_bytes):
        return slot
    where = dict(method=method.qualname, slot=path_name(path), new=the_plan.spec.describe())
    if frame.method is not None:
        raise ValueError(_errors.UNALLOCATED_NESTED.format(outer=frame.method, **where))
    # An empty slot is never a loop carry (its markers are not arrays), but an allocated
    # one may be, and then it cannot change shape.
    loop = _jax_internals.inside_loop_body()
    if slot.allocated and loop is not None:
        old = f"{slot.value.dtype}{list(slot.value.shape[1:])} (as stored)"
        raise ValueError(_errors.RESHAPED_IN_LOOP.format(loop=loop, old=old, **where))
    return allocate(slot, the_plan.spec, snapshot_bytes)
