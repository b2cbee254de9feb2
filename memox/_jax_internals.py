"""Every JAX internal memox reads, each behind one function.

Which trace a value belongs to, which inputs a jaxpr uses, a value's `shard_map`
varying axes, a PRNG key's implementation, weak types, what `jax.jit` keys on. Each runs
on every JAX in CI's matrix, so a rename fails loudly rather than turning into a silent
no-op: most are pinned one by one in `tests/test_jax_internals.py`; the others through
the behaviour that reads them (the staged program and its name stacks: the ledger's
tests, `tests/test_ledger.py`; `trace_context`: `tests/test_key.py`; `is_batched`:
`tests/test_vmap.py`; `varying_like`: the `shard_map` cases of `tests/test_sharding.py`;
`trace_closing_over`: `tests/test_hoist.py`; `process_count`:
`tests/test_multiprocess.py`).

memox must refuse to store a tracer in a slot that lives at an outer level (a tracer
leak), and must know when it runs inside a loop body, where a slot cannot change its
structure. Both questions are about JAX's trace stack. Every trace JAX creates records
the trace that was current when it was created (`parent_trace`), so "is this value
visible at that level" is a walk up that chain. Loop bodies are traced by a
`DynamicJaxprTrace` whose debug info names the loop.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.extend
import numpy as np
from jax._src import (
    array as _array,
    config as _config,
    core as _core,
    source_info_util as _source_info,
    traceback_util as _traceback_util,
    tree_util as _tree_util,
)
from jax._src.interpreters import ad as _ad, batching as _batching, partial_eval as _pe


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


_LOOP_BODIES = frozenset({"scan", "while_body", "while_cond", "fori_loop"})


def is_concrete_array(x: object) -> bool:
    """Whether `x` is an immutable array with a value now (not a tracer, not NumPy).
    Its type is tested first: `jax.Array` is an abstract class, slower to test, and the
    compiled wrappers test each slot's leaves at every call."""
    return type(x) is _array.ArrayImpl or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    )


def hide_from_tracebacks(path: str) -> None:
    """Leave the files under `path` out of the tracebacks JAX filters (as Equinox does
    for its own): a user's error inside `jit` shows their code, not memox's frames."""
    _traceback_util.register_exclusion(path)


def current() -> Any:
    """The trace that operations run on right now (the eval trace outside transforms)."""
    return _core.trace_ctx.trace


def transforming() -> bool:
    """Whether a transformation (`jit`, `grad`, `vmap`, a loop, ...) is tracing right
    now; `False` only where operations run eagerly, on concrete arrays, with no named axis
    bound: there no operand can carry a tangent."""
    return not _core.trace_ctx.is_top_level()


def _lineage(trace: Any) -> Iterator[Any]:
    while trace is not None:
        yield trace
        trace = getattr(trace, "parent_trace", None)


def visible_at(value: Any, trace: Any) -> bool:
    """Whether `value` may be stored where `trace` is current (no tracer leak)."""
    if not isinstance(value, jax.core.Tracer):
        return True
    owner = value._trace
    return any(t is owner for t in _lineage(trace))


_DIFFERENTIATING = tuple(
    getattr(_ad, name) for name in ("JVPTrace", "LinearizeTrace") if hasattr(_ad, name)
)


def differentiated_since(outer: Any) -> bool:
    """Whether a differentiation (`jax.jvp`, or `jax.linearize`, which `jax.grad` and
    `jax.vjp` use) opened inside `outer`'s program is running now: the current trace has
    `outer` as an ancestor, with a differentiation trace between them."""
    opened = False
    for trace in _lineage(current()):
        if trace is outer:
            return opened
        opened |= isinstance(trace, _DIFFERENTIATING)
    return False  # elsewhere: a backward pass run after that program, or no trace


def differentiating_in(trace: Any, outer: Any) -> bool:
    """Whether `trace` is `outer`, or differentiation traces opened in it (`jax.grad`,
    `jvp`, `vjp`, `linearize`): no branch, loop, batching or staged sub-trace between
    them, so code running at `trace` runs exactly once per run of `outer`'s program."""
    for t in _lineage(trace):
        if t is outer:
            return True
        if not isinstance(t, _DIFFERENTIATING):
            return False
    return False


def _loop_body(start: Any = None) -> tuple[Any, str | None]:
    """The trace of the innermost loop body being traced (at `start`, default: now) and
    the loop's name, if any."""
    for trace in _lineage(current() if start is None else start):
        frame = getattr(trace, "frame", None)
        traced_for = getattr(getattr(frame, "debug_info", None), "traced_for", None)
        if traced_for in _LOOP_BODIES:
            return trace, traced_for
    return None, None


def inside_loop_body(trace: Any = None) -> str | None:
    """The name of the innermost loop whose body (or condition: `"while_cond"`) is being
    traced at `trace` (default: now), if any."""
    return _loop_body(trace)[1]


def loop_closing_over(values: list[Any]) -> str | None:
    """The name of the innermost loop whose body is being traced, if every one of
    `values` comes from outside that body (the body closes over them), else `None`."""
    trace, name = _loop_body()
    outside = getattr(trace, "parent_trace", None)
    if name is not None and values and all(visible_at(v, outside) for v in values):
        return name
    return None


def trace_closing_over(values: list[Any]) -> bool:
    """Whether a function is being traced to a jaxpr (`jax.jit`, `jax.make_jaxpr`, a
    loop body, a branch, ...) and every one of `values` comes from outside the innermost
    such trace (it closes over them)."""
    for trace in _lineage(current()):
        if isinstance(trace, _pe.DynamicJaxprTrace):
            outside = getattr(trace, "parent_trace", None)
            return bool(values) and all(visible_at(v, outside) for v in values)
    return False


def trace_context() -> tuple[Any, ...]:
    """What `jax.jit` keys its traces on besides the arguments: the value of every JAX
    configuration option declared `include_in_trace_context` (`jax._src.config`: x64,
    the PRNG flags, default matmul precision, dtype promotion, the mesh and device
    contexts, ...; which options, JAX decides, per version), in JAX's own order.

    Objects JAX compares by identity or that hold no plain value are given as their
    contents: the axis environment (the named axes in scope and their sizes) and the
    abstract mesh (axis names, sizes and types, device kind)."""
    return tuple(map(_plain_context, _config.trace_context()))


def jit_context() -> Any:
    """JAX's own `trace_context()` as `jax.jit` keys on it in this process (objects it
    compares by identity left as they are): for keys that stay in this process."""
    return _config.trace_context()


def _plain_context(value: Any) -> Any:
    if isinstance(value, _core.AxisEnv):
        return (
            "axis_env",
            tuple(sorted((str(k), int(v)) for k, v in value.axis_sizes.items())),
            tuple(sorted(map(str, value.spmd_axis_names))),
            tuple(sorted(map(str, value.explicit_mesh_axis_names))),
        )
    if isinstance(value, jax.sharding.AbstractMesh):
        return (
            "mesh",
            tuple(map(str, value.axis_names)),
            tuple(value.axis_sizes),
            tuple(map(str, value.axis_types)),
            getattr(value, "abstract_device", None),
        )
    return value


def staged_count(trace: Any) -> int | None:
    """How many equations `trace` has staged so far; `None` where it stages none (an
    eager or transforming trace, not a jaxpr being built)."""
    frame = getattr(trace, "frame", None) if isinstance(trace, _pe.DynamicJaxprTrace) else None
    eqns = getattr(frame, "tracing_eqns", None)
    return None if eqns is None else len(eqns)


def staged_since(trace: Any, start: int) -> list[Any]:
    """The equations `trace` staged after the first `start` (those JAX already dropped
    as dead code left out)."""
    out = []
    for eqn in trace.frame.tracing_eqns[start:]:
        # (An entry is the equation, or a callable giving it: a weak reference, or on
        # jax 0.10 a closure for one JAX keeps.)
        eqn = eqn if hasattr(eqn, "source_info") else eqn()
        if eqn is not None:
            out.append(eqn)
    return out


def scope_names(eqns: Iterable[Any], *, live: bool = False) -> Iterator[str]:
    """The `jax.named_scope`s each of `eqns` was staged under, and those of every
    equation in the jaxprs their parameters hold (loop bodies, branches, calls),
    recursively; with `live`, of those each jaxpr's outputs or effects depend on.

    Read from the name stack's entries (`Scope`s, between the `Transform`s that
    transformations add), so that no transformation can hide one."""
    for eqn in eqns:
        for entry in eqn.source_info.name_stack.stack:
            if isinstance(entry, _source_info.Scope):
                yield entry.name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    if live:
                        sub = _pe.dce_jaxpr(sub, [True] * len(sub.outvars))[0]
                    yield from scope_names(sub.eqns, live=live)


def live_equations(trace: Any, outputs: list[Any]) -> list[Any]:
    """The equations `trace` has staged that `outputs` (values of it) depend on: JAX's
    own dead-code elimination of the program (each jaxpr inside it is pruned with
    respect to its own outputs by `scope_names(..., live=True)`, so that what cannot leave a
    jaxpr counts as dead whether or not the rule of its primitive prunes it)."""
    frame = trace.frame
    outvars: list[Any] = [
        x.val for x in outputs if isinstance(x, jax.core.Tracer) and x._trace is trace
    ]
    constvars, invars = list(frame.constvar_to_val), list(frame.invars)
    info = _core.DebugInfo("memox", "the program of a memox.call", None, None)
    jaxpr = _core.Jaxpr(constvars, invars, outvars, frame.get_eqns(), frozenset(), info)
    return list(_pe.dce_jaxpr(jaxpr, [True] * len(outvars))[0].eqns)


def is_batched(x: Any) -> bool:
    """Whether `x` is batched by a `vmap` being traced right now (a `lax.cond` on it
    becomes a `select`: both branches run)."""
    trace = getattr(x, "_trace", None)
    # (Not mapped: `None` on every JAX in CI; an `int` or a ragged axis spec when mapped.)
    return isinstance(trace, _batching.BatchTrace) and x.batch_dim is not None


def used_inputs(closed: jax.extend.core.ClosedJaxpr) -> list[bool]:
    """Which inputs of `closed` its outputs or effects depend on (dead-code elimination)."""
    jaxpr = closed.jaxpr
    _, used = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return used


def lowered(value: Any) -> Any:
    """`value` at the outermost level it belongs to: a tracer that its transformation
    only passed through (unbatched under `vmap`, zero tangent under `jvp`) is replaced by
    the value it wraps."""
    return _core.full_lower(value) if isinstance(value, jax.core.Tracer) else value


def varying_axes(aval: Any) -> frozenset[Any]:
    """The `shard_map` mesh axes a value of type `aval` varies over (`check_vma`)."""
    if isinstance(aval, jax.core.ShapedArray):
        return frozenset(aval.mat.varying)  # (`aval.vma` before jax 0.10)
    return frozenset()


def _varying(x: Any) -> frozenset:
    return varying_axes(jax.typeof(x))


def is_key(dtype: Any) -> bool:
    """Whether `dtype` is a typed PRNG key's (an extended dtype)."""
    # (Public, but `jax.dtypes` does not re-export it to type checkers.)
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)  # pyright: ignore[reportPrivateImportUsage]


def key_impl_name(dtype: Any) -> str:
    """The name of the PRNG implementation of key dtype `dtype` (for `wrap_key_data`)."""
    return str(dtype._impl.name)


def weakly_typed(x: Any) -> Any:
    """`x` as a weakly typed array of the same dtype (what a Python scalar gives)."""
    from jax._src.lax import lax as _lax

    return _lax._convert_element_type(x, np.dtype(x.dtype), weak_type=True)


def varying_like(tree: Any, like: Any) -> Any:
    """`tree` cast to vary over every `shard_map` axis any leaf of `like` varies over.

    Inside `jax.shard_map` (with `check_vma`), a value's type records the mesh axes it
    varies over, and `lax.cond` needs both branches to agree: a slot passed through
    unchanged on a hit must vary like the one the miss writes from varying values."""
    axes = frozenset().union(*map(_varying, jax.tree.leaves(like)))
    if not axes:
        return tree

    def cast(x: Any) -> Any:
        missing = tuple(sorted(axes - _varying(x), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


_PROCESSES: list[int] = []


def children_and_data(node: Any) -> tuple[Any, Any] | None:
    """The children of pytree node `node` and the data its tree structure holds for it
    (JAX's flatten of one level), or None where `node` is a leaf."""
    try:
        return _tree_util.flatten_one_level(node)
    except ValueError:
        return None


def node_data(treedef: Any) -> list[Any]:
    """The data of every node of tree structure `treedef` (None for a node without), in
    one fixed order: read at once from its picklable state where that lists the nodes
    with their data third, as jaxlib 0.10 to 0.12 do (checked once against JAX's
    `node_data`), else node by node."""
    if _state_lists_node_data():
        return [node[2] for node in treedef.__getstate__()[1]]
    return _walked(treedef)


def _walked(treedef: Any) -> list[Any]:
    found, stack = [], [treedef]
    while stack:
        t = stack.pop()
        data = t.node_data()
        found.append(None if data is None else data[1])
        stack.extend(t.children())
    return found


@functools.cache
def _state_lists_node_data() -> bool:
    probe = _tree_util.tree_structure({"k": (1, {"j": 2}), "i": None})
    try:
        listed = [node[2] for node in probe.__getstate__()[1]]
    except (AttributeError, IndexError, TypeError):
        return False
    walked = _walked(probe)
    return len(listed) == len(walked) and sorted(map(repr, listed)) == sorted(map(repr, walked))


def explicit_sharding(aval: Any) -> Any:
    """The sharding of `aval` where its mesh has `Explicit` axes (part of the type
    there), else `None` (placement only: XLA propagates it, the value is the same)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return None
    return sharding


def process_count() -> int:
    """`jax.process_count()`, read once the first time it is needed (JAX fixes it when its
    backend starts: `jax.distributed.initialize` must come first)."""
    if not _PROCESSES:
        _PROCESSES.append(jax.process_count())
    return _PROCESSES[0]
