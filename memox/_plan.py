"""Planning a cached call: what the method reads, its static key, and its slot.

A plan is made once per method and static key (`_key.py`: the module's structure and
non-array parts, the types of all its arrays and arguments) and cached: the method is
traced to a jaxpr with caching off, and dead-code elimination says which of the module's
arrays reach its output. Those are its dependencies, whose values the dynamic part of the
key fingerprints. The same trace gives the type of the value the slot will store.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _context, _errors, _jax_internals
from ._caches import Cache
from ._flops import FlopCount, count_jaxpr
from ._jax_internals import explicit_sharding, trace_context
from ._key import StaticKey, signature, static_key
from ._partition import ARRAY, hashable_combine, hashable_partition
from ._policy import Policy
from ._sites import Path, path_name
from ._slot import Memo, is_memo
from ._storage import Spec, packed_size
from ._table import allocate, conformed, mesh_of
from ._token import node_token, token


@dataclasses.dataclass(frozen=True, eq=False)
class Method:
    """What planning needs of a cached method (`CachedMethod.method` makes it): its
    function, slot name, policy and qualified name, and the token the static key
    takes of it (`_token.token` of the cached method: its importable name where it has
    one). Planning never sees the cached method itself."""

    fn: Any
    slot: str
    policy: Policy
    qualname: str
    token: Any


@dataclasses.dataclass(frozen=True)
class Parts:
    """The skeleton of a module or argument pytree: its structure and its non-array
    leaves (`_partition.hashable_partition`, with each slot marked too). It holds no array
    (arrays may be tracers, and a skeleton outlives the trace in the closures of the
    memoised operation): `split` hands the arrays out separately. `tokens` are the exact
    tokens (`_token.py`) of its nodes' data and of its non-array leaves, made in the same
    walk."""

    treedef: Any
    statics: tuple[Any, ...]  # the leaf itself where static, else `ARRAY` or `_SLOT`
    kinds: str  # "a" (array), "m" (memo) or "s" (static), per leaf
    tokens: tuple[Any, ...]

    @classmethod
    def split(cls, tree: Any) -> tuple[Parts, list[Any]]:
        node_tokens: list[Any] = []

        def visit(x: Any) -> bool:
            if is_memo(x):
                return True
            found = node_token(x)
            if found is not None:
                node_tokens.append(found)
            return False

        leaves, treedef = jtu.tree_flatten(tree, is_leaf=visit)
        arrays: list[Any] = []
        statics = hashable_partition([_SLOT if is_memo(x) else x for x in leaves], arrays)
        kinds = "".join("a" if x is ARRAY else "m" if x is _SLOT else "s" for x in statics)
        static_tokens = tuple(token(x) for x, k in zip(statics, kinds) if k == "s")
        return cls(treedef, statics, kinds, (tuple(node_tokens), static_tokens)), arrays

    def rebuild(self, arrays: Sequence[Any], slots: Sequence[Any] | None = None) -> Any:
        """The tree with these arrays, and these slots (default: empty ones)."""
        slots_ = iter(slots) if slots is not None else None
        leaves = [
            (Memo() if slots_ is None else next(slots_)) if x is _SLOT else x
            for x in hashable_combine(self.statics, iter(arrays))
        ]
        return jtu.tree_unflatten(self.treedef, leaves)


_SLOT = object()  # marks a slot in `Parts.statics`


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What a cached method does for one static key."""

    used: tuple[int, ...]  # which of the module's arrays the method reads
    nested: bool  # whether it calls other cached methods
    spec: Spec  # what it returns
    deps: Spec  # what it reads (the used arrays), for snapshots
    key: StaticKey  # the static part of the cache key (its digest salts the fingerprint)
    count: Any  # () -> FlopCount of one computation, nested cached methods included

    @property
    def salt(self) -> tuple[int, int]:
        return self.key.digest

    @functools.cached_property
    def flops(self) -> FlopCount:
        """FLOPs of one computation (counted on first request, never while caching)."""
        return self.count()

    def snapshot_bytes(self, policy: Policy) -> int | None:
        """The bytes of a snapshot of the dependencies, or None: no snapshot table."""
        return packed_size(self.deps) if policy.snapshots else None


_PLANS = Cache("plans", 4096)  # (method, static key) -> Plan
_LATEST = Cache("latest plans", 4096)  # method -> Plan
_SUPPORTED = (jnp.bool_, jnp.integer, jnp.unsignedinteger, jnp.floating, jnp.complexfloating)


def latest(method: Method) -> Plan | None:
    """The plan `method` was last called with (for `memox.stats` of a method with
    arguments, whose slot does not say which arguments it holds)."""
    return _LATEST.get(method)


def plan(
    method: Method, module: Parts, arrays: list[Any], args: Parts, arg_arrays: list[Any]
) -> Plan:
    """The plan of `method` on a module and arguments of these skeletons and arrays.

    Decides the static key (the rule of `_key.py`: the method and its policy, both
    skeletons, and the type of every array, read or not) and, once per static key, by
    tracing the method with caching off: which of the module's arrays it reads (the
    dependencies), whether it calls other cached methods, and the type of its value.
    """
    key = _static_key(method, module, arrays, args, arg_arrays)
    found = _PLANS.get((method, key))
    if found is not None:
        return _LATEST.put(method, found)

    def run(arrays: list[Any], arg_arrays: list[Any]) -> Any:
        a, k = args.rebuild(arg_arrays)
        return method.fn(module.rebuild(arrays), *a, **k)

    # Traced on the arrays' own types (weak types, shardings, extended dtypes kept);
    # nothing runs.
    structs = [[_struct(x) for x in xs] for xs in (arrays, arg_arrays)]
    with _context.active(_context.Plain()) as plain:
        closed, out = jax.make_jaxpr(run, return_shape=True)(*structs)
    for leaf in jtu.tree_leaves(out):
        if not (_jax_internals.is_key(leaf.dtype) or _supported(leaf.dtype)):
            raise TypeError(
                _errors.UNSUPPORTED_DTYPE.format(method=method.qualname, dtype=leaf.dtype)
            )
    used_inputs = _jax_internals.used_inputs(closed)
    used = tuple(i for i in range(len(arrays)) if used_inputs[i])
    found = Plan(
        used,
        plain.nested,
        Spec.of(out),
        Spec.of([structs[0][i] for i in used]),
        key,
        functools.partial(_count, method, run, structs),
    )
    _PLANS.put((method, key), found)
    return _LATEST.put(method, found)


_KEYS = Cache("static keys", 4096)  # the parts of a call -> StaticKey


def _static_key(
    method: Method, module: Parts, arrays: list[Any], args: Parts, arg_arrays: list[Any]
) -> StaticKey:
    """The static key of a call (`_key.py`), remembered per the same parts: the method by
    identity, the tree structures by `PyTreeDef.__eq__` together with the exact tokens
    of their nodes' data and non-array leaves, the arrays' abstract values, and the
    trace context's token. As exact as the key: a repeated call does not encode again."""
    context = token(trace_context())
    policy = token(method.policy)
    avals = tuple(map(_aval, arrays)), tuple(map(_aval, arg_arrays))
    fast = (method, policy, context, avals, module.treedef, module.kinds, module.tokens)
    fast = (*fast, args.treedef, args.kinds, args.tokens)
    try:
        found = _KEYS.get(fast)
    except (TypeError, ValueError):  # nodes' data Python cannot hash or compare (arrays)
        fast, found = None, None
    if found is None:
        found = static_key(
            method.token,
            policy,
            context,
            token(module.treedef),
            module.kinds,
            module.tokens[1],
            token(tuple(map(signature, arrays))),
            token(args.treedef),
            args.kinds,
            args.tokens[1],
            token(tuple(map(signature, arg_arrays))),
        )
        if fast is not None:
            _KEYS.put(fast, found)
    return found


def _aval(x: Any) -> Any:
    aval = getattr(x, "aval", None)  # a `jax.Array` or a tracer: its abstract value
    return aval if aval is not None else jax.typeof(x)


def _struct(x: Any) -> Any:
    """What the method is planned on for array `x`: a `ShapeDtypeStruct` of its type,
    or its abstract value itself where its dtype is not canonical (a 64-bit array made
    under `jax.enable_x64` and read with x64 off: JAX keeps such an array's type, but
    truncates a `ShapeDtypeStruct`'s, with a warning, on jax >= 0.12)."""
    aval = jax.typeof(x)
    if not _jax_internals.is_key(aval.dtype) and (
        jax.dtypes.canonicalize_dtype(aval.dtype) != aval.dtype
    ):
        return aval
    sharding = getattr(aval, "sharding", None)
    return jax.ShapeDtypeStruct(
        aval.shape,
        aval.dtype,
        weak_type=bool(getattr(aval, "weak_type", False)),
        sharding=sharding if explicit_sharding(aval) is not None else None,
    )


def _supported(dtype: Any) -> bool:
    return any(jnp.issubdtype(dtype, t) for t in _SUPPORTED)


def _count(method: Method, run: Any, structs: list[list[Any]]) -> FlopCount:
    with _context.active(_context.Plain()):
        return count_jaxpr(jax.make_jaxpr(run)(*structs))


def plan_without_arguments(method: Method, owner: Any) -> Plan:
    """The plan of `method(owner)` (no FLOPs spent)."""
    return plan(method, *Parts.split(owner), *Parts.split(((), {})))


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a cached method found in a frame, planned, its slot fitted."""

    method: Method
    frame: _context.Frame
    path: Path
    module: Any
    parts: Parts
    arrays: list[Any]
    arg_parts: Parts
    arg_arrays: list[Any]
    plan: Plan
    slot: Memo

    @classmethod
    def prepare(
        cls,
        method: Method,
        frame: _context.Frame,
        path: Path,
        module: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Call:
        """Split the module and arguments, plan the method, and fit its slot."""
        parts, arrays = Parts.split(module)
        arg_parts, arg_arrays = Parts.split((args, kwargs))
        the_plan = plan(method, parts, arrays, arg_parts, arg_arrays)
        slot = fit(method, frame, path, frame.store[path], the_plan, [*arrays, *arg_arrays])
        return cls(
            method, frame, path, module, parts, arrays, arg_parts, arg_arrays, the_plan, slot
        )


def fit(
    method: Method,
    frame: _context.Frame,
    path: Path,
    slot: Memo,
    the_plan: Plan,
    inputs: Sequence[Any] = (),
) -> Memo:
    """`slot` with room for the value of `the_plan`, allocated where the structure may
    change (on the mesh of the concrete `inputs`, the module's arrays and the call's);
    an error where it may not (inside a loop body, or another cached method). Its table
    is typed as the value is (`conformed`: sharded like it where that is its type)."""
    snapshot_bytes = the_plan.snapshot_bytes(method.policy)
    if slot.holds(the_plan.spec, snapshot_bytes):
        return conformed(slot, the_plan.spec, list(inputs))
    where = dict(method=method.qualname, slot=path_name(path), new=the_plan.spec.describe())
    if frame.method is not None:
        raise ValueError(_errors.UNALLOCATED_NESTED.format(outer=frame.method, **where))
    # An empty slot allocated in a loop's carry makes the loop raise (JAX names the
    # marker's type, which says to call `memox.init`); an allocated one cannot change
    # shape there.
    loop = _jax_internals.inside_loop_body()
    if slot.allocated and loop is not None:
        old = f"{slot.value.dtype}{list(slot.value.shape[1:])} (as stored)"
        if slot.holds(the_plan.spec, slot.snapshot_bytes):  # the value fits: not its snapshot
            where["new"] += f" reading {snapshot_bytes} bytes of dependencies"
            old = f"a snapshot of {slot.snapshot_bytes} bytes"
        raise ValueError(_errors.RESHAPED_IN_LOOP.format(loop=loop, old=old, **where))
    # (Inside a trace, where no concrete mesh is known, `conformed` gives the table the
    # value's sharding where it is part of the type: `memox.init`'s discovery reads it.)
    new = allocate(slot, the_plan.spec, snapshot_bytes, mesh_of(inputs))
    return conformed(new, the_plan.spec, list(inputs))
