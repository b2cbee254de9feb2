"""`Hoisted`: a value `memox.hoist` read ahead, in place of its slot, which the cached
method returns with no check and no branch.

**Gradients are exact by construction.** The value is `f(x)`, the method at the view's
arrays `x`, read at one point of a program: the trace `hoist` ran in. There it carries
the derivative of every differentiation already running (the memoised read
differentiates the method exactly), and so it does in their backward passes, which run
after that program and hand the value's cotangent back to where it was read. A
differentiation *opened after the read, inside that program* (`jax.grad`, `jax.jvp`,
`jax.vjp` or `eqx.filter_grad` taken inside `fn` with respect to the view or its arrays)
instead sees the value as an input of its own, whose tangent, if it has one, is not
`f'(x) dx`. A read reached by such a differentiation is differentiated on the view:
its tangent is the method's own JVP at the view's arrays (the rule of a `custom_jvp`,
`_read`), so the derivative with respect to the view's arrays is the unmemoized one, and
the method computes at each such read, as the unmemoized code does. The value's own leaf
gets no gradient (the view's arrays get all of it).

A read knows it is reached by such a differentiation:

- when it runs under it: the differentiation's trace has the read's trace as an
  ancestor (JAX records each trace's parent). A backward pass runs after the program
  the value was read in, under other traces: there the value is used as is;
- when the differentiation is applied to a compiled function the view is passed to
  (`eqx.filter_jit`, `diffrax.diffeqsolve`, a `custom_vjp`), where it is not visible at
  the read: the view's pytree records it when it is flattened under that
  differentiation, in its tree structure (so JAX compiles and caches such a function
  apart);
- and in the rule, where a tangent moves the method's dependencies but not the value
  (a differentiation with respect to the view's arrays only): only the method's JVP
  can give it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from . import _context, _jax_internals
from ._plan import Method, Parts, plan


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


class Hoisted:
    """A slot's value read ahead by `memox.hoist`, in place of the slot: the cached
    method returns it, differentiated exactly (see the module docstring)."""

    __slots__ = ("_read_in", "_reached", "value")

    def __init__(self, value: Any, read_in: _ReadIn | None = None, reached: bool = False):
        self.value = value
        # The trace the value was read in (by default: the one current now).
        self._read_in = _ReadIn(_jax_internals.current()) if read_in is None else read_in
        # Whether the view was flattened under a differentiation opened after the read,
        # inside the program it was read in.
        self._reached = reached

    def read(self, method: Method, module: Any) -> Any:
        """The value of `method` on `module` (which holds this node in place of its slot):
        the value read ahead, whose tangent is the method's own where a differentiation
        opened after the read moves what the method reads."""
        parts, arrays = Parts.split(module)
        if not any(isinstance(x, jax.core.Tracer) for x in arrays):  # (the value's too)
            return self.value  # nothing here is being transformed
        used = plan(method, parts, arrays, *Parts.split(((), {}))).used
        deps = [x for i, x in enumerate(arrays) if i in used]
        others = [x for i, x in enumerate(arrays) if i not in used]
        reached = self._reached or self._read_in.differentiated_since()
        return _read(deps, self.value, others, _Method(method.fn, parts, used), reached)

    def __repr__(self) -> str:
        return f"Hoisted(value={eqx.tree_pformat(self.value)})"


class _ReadIn:
    """The trace a value was read in (held weakly). Equal to any other: it is not part of
    what a tree structure is compared by (two views of one module have one)."""

    __slots__ = ("_trace",)

    def __init__(self, trace: Any):
        self._trace = weakref.ref(trace)

    def differentiated_since(self) -> bool:
        """Whether a differentiation opened inside the program the value was read in,
        after the read, is running now (its trace has the read's trace as an ancestor)."""
        read_in = self._trace()
        return read_in is not None and _jax_internals.differentiated_since(read_in)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ReadIn)

    def __hash__(self) -> int:
        return hash(_ReadIn)


def _flatten(node: Hoisted) -> tuple[tuple[Any], tuple[bool, _ReadIn]]:
    reached = node._reached or node._read_in.differentiated_since()
    return (node.value,), (reached, node._read_in)


def _flatten_with_keys(node: Hoisted) -> tuple[tuple[tuple[Any, Any]], tuple[bool, _ReadIn]]:
    (value,), aux = _flatten(node)
    return ((jtu.GetAttrKey("value"), value),), aux


def _unflatten(aux: tuple[bool, _ReadIn], children: Iterable[Any]) -> Hoisted:
    reached, read_in = aux
    (value,) = children
    return Hoisted(value, read_in, reached)


jtu.register_pytree_with_keys(Hoisted, _flatten_with_keys, _unflatten, _flatten)


class _Method:
    """The method of a read, on the view's skeleton: its value from the view's arrays,
    computed as the unmemoized method (nested cached methods without their slots)."""

    def __init__(self, fn: Callable[..., Any], parts: Parts, used: tuple[int, ...]):
        self.fn, self.parts, self.used = fn, parts, used

    def __call__(self, deps: Sequence[Any], others: Sequence[Any]) -> Any:
        deps_, others_ = iter(deps), iter(others)
        n = len(deps) + len(others)
        arrays = [next(deps_) if i in self.used else next(others_) for i in range(n)]
        with _context.active(_context.Plain()):
            return self.fn(self.parts.rebuild(arrays))


@eqx.filter_custom_jvp
def _read(deps: list[Any], value: Any, others: list[Any], method: _Method, reached: bool) -> Any:
    """`value`, the method's value on the view whose arrays are `deps` (those it reads)
    and `others`; `reached`: a differentiation opened after the read reaches it."""
    return value


@_read.def_jvp
def _read_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    deps, value, others, method, reached = primals
    t_deps, t_value = tangents[:2]
    moving = [i for i, t in enumerate(t_deps) if t is not None]
    if not moving or (not reached and jtu.tree_leaves(t_value)):
        # The value's own tangent: nothing it was computed from moves, or it was read
        # under this differentiation (or is handed back to where it was read, by a
        # backward pass), where its tangent is the method's.
        return value, t_value
    # Differentiated on the view: its dependencies move and the value's tangent, if it
    # has one, is its own (a differentiation opened after the read), or it has none.

    def value_at(moved: list[Any]) -> Any:
        at = list(deps)
        for i, x in zip(moving, moved):
            at[i] = x
        return method(at, others)

    moved = [deps[i] for i in moving]
    _, t_out = jax.jvp(value_at, (moved,), ([t_deps[i] for i in moving],))
    return value, t_out
