"""`memox.scan`: `jax.lax.scan`, with cached values the loop does not change hoisted.

Inside `lax.scan`, a cached value is read from a slot in the carry, and the carry may
change every step. So when the loop is differentiated, JAX saves the value once per step
for the backward pass (`T` copies of a Cholesky factor), where the unmemoized loop
computes the factor from loop constants and saves it once: JAX hoists a residual out of
a loop only when it depends on the loop's constants alone, and only a carry the body
passes through unchanged becomes a constant (`jax/_src/lax/control_flow/loops.py`:
`_scan_impl`'s `move_to_const`, `_scan_partial_eval`'s loop-invariant residuals). A slot
that the first step fills is not passed through unchanged; no rewriting inside the body
can make it so.

`memox.scan` moves the fill before the loop instead:

1. **Probe**: trace the body once, abstractly, with every allocated slot of the carry
   pinned (`_context.Pins`), and keep the pins that held: slots whose every read depends
   on loop-invariant values only and whose entries the body passes through unchanged.
2. **First step**: run the body on the first element outside the loop. It fills the
   pinned slots exactly as `lax.scan`'s first step would.
3. **The rest**: `lax.scan` over the remaining elements with the pins. A pinned read is
   `entry(table, lookup(key))` with no branch: a hit by construction, since nothing it
   depends on changes and nothing in the body writes the slot. Its entries come out of
   the body as the arrays that went in, so `lax.scan` makes them loop constants, and the
   read itself becomes a loop-invariant residual, saved once. Hit counters stay in the
   carry, so `memox.stats` counts every read.

Results, gradients and counts are those of `lax.scan(f, init, xs)`. The body is traced
three times and compiled twice (the first step and the loop) when some slot is pinned,
and `lax.scan` is called directly when none is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _context, _errors, _jax_internals
from ._slot import Path, slots


C = TypeVar("C")
Y = TypeVar("Y")

# Validated with a message that says what to do; typed for static checkers only, so that
# a runtime type checker does not answer first.
Body = Callable[[C, Any], tuple[C, Y]] if TYPE_CHECKING else Any


def scan(
    f: Body,
    init: C,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
) -> tuple[C, Y]:
    """`jax.lax.scan(f, init, xs, length, reverse, unroll)`, for a carry that holds
    modules with `memox.Memo` slots.

    Cached methods whose inputs the loop does not change (their dependencies are
    passed through the carry unchanged, or come from outside the loop) are computed in
    the first step, run outside the loop, and read as loop constants in the others.
    Under `jax.grad` the loop then keeps one copy of such a value for the backward pass,
    not one per step, as the same loop without memox does; a hit also costs no branch
    and no copy of the slot.

    Results, gradients and `memox.stats` counts are those of `jax.lax.scan`. Where no
    slot can be hoisted, this is `jax.lax.scan`.

    **Arguments:** as for `jax.lax.scan`.

    **Returns:**

    `(final_carry, stacked_ys)`, as `jax.lax.scan`.

    !!! Example

        ```python
        def loss(w, foo):
            def body(foo, x):
                b, foo = memox.call(foo, Foo.b)
                return foo, w * b * x

            foo, ys = memox.scan(body, foo, jnp.arange(4.0))   # b: once, before the loop
            return jnp.sum(ys)

        jax.grad(loss)(2.0, memox.init(Foo(jnp.ones((3, 3)))))
        ```
    """
    if not callable(f):
        raise TypeError(_errors.NOT_CALLABLE.format(api="scan", got=type(f).__name__))
    n = _length(xs, length)
    candidates = frozenset(path for path, slot in slots(init).items() if slot.allocated)
    if n is None or n < 2 or not candidates:
        return lax.scan(f, init, xs, length, reverse, unroll)
    outer = _jax_internals.current()
    pins = _probe(f, init, xs, candidates, outer)
    if not pins:
        return lax.scan(f, init, xs, length, reverse, unroll)

    first = n - 1 if reverse else 0
    init = jtu.tree_map(_as_array, init)  # as `lax.scan` would pass them to `f`
    carry, y_first = f(init, jtu.tree_map(lambda x: x[first], xs))
    rest = jtu.tree_map(lambda x: x[:-1] if reverse else x[1:], xs)
    while True:  # the pins held in the probe; they hold here unless `f` traces differently
        try:
            carry, ys = lax.scan(_pinned(f, pins, outer), carry, rest, n - 1, reverse, unroll)
            break
        except _Unpinned as e:
            pins = pins - e.failed
    return carry, jtu.tree_map(lambda a, b: _stack(a, b, reverse), y_first, ys)


def _length(xs: Any, length: int | None) -> int | None:
    """The number of steps, or `None` where `lax.scan` should say what is wrong."""
    lengths = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jtu.tree_leaves(xs)}
    if length is not None:
        lengths.add(length)
    return lengths.pop() if len(lengths) == 1 else None  # (None where a leaf is a scalar)


def _as_array(x: Any) -> Any:
    scalar_or_numpy = (bool, int, float, complex, np.ndarray, np.generic)
    return jnp.asarray(x) if isinstance(x, scalar_or_numpy) else x


def _stack(first: Any, rest: Any, reverse: bool) -> Any:
    first = jnp.expand_dims(first, 0)
    return jnp.concatenate([rest, first] if reverse else [first, rest])


class _Unpinned(Exception):
    """Raised out of a body trace whose pins did not all hold."""

    def __init__(self, failed: frozenset[Path]):
        super().__init__(failed)
        self.failed = failed


def _pinned(f: Callable, allowed: frozenset[Path], outer: Any, verdicts: list | None = None):
    """`f` with the slots at paths `allowed` of its carry pinned. With `verdicts`, appends
    to it the pins that were used and held and those that did not hold; without, raises
    `_Unpinned` if some did not hold."""

    def body(carry: Any, x: Any) -> Any:
        pins = _context.Pins(carry, allowed, outer)
        with _context.pinning(pins):
            out = f(carry, x)
        held, failed = pins.holding(_carry_of(out))
        if verdicts is not None:
            verdicts.append((held, failed))
        elif failed:
            raise _Unpinned(failed)
        return out

    return body


def _carry_of(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) and len(out) == 2 else None


def _probe(
    f: Callable, init: Any, xs: Any, candidates: frozenset[Path], outer: Any
) -> frozenset[Path]:
    """The slots of `init` that `f` can read as loop constants (abstract traces)."""
    x = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), xs)
    allowed = candidates
    while allowed:
        verdicts: list[tuple[frozenset[Path], frozenset[Path]]] = []
        out = jax.eval_shape(_pinned(f, allowed, outer, verdicts), init, x)
        if not _same_types(init, _carry_of(out)):
            return frozenset()  # `lax.scan` promotes weak types or says what is wrong
        held, failed = verdicts[0]
        if not failed:
            return held
        allowed = allowed - failed
    return frozenset()


def _same_types(init: Any, out: Any) -> bool:
    """Whether the body returns a carry of the same structure, shapes and dtypes."""
    leaves, treedef = jtu.tree_flatten(init)
    out_leaves, out_treedef = jtu.tree_flatten(out)
    return treedef == out_treedef and all(
        jnp.shape(a) == b.shape and jnp.result_type(a) == b.dtype
        for a, b in zip(leaves, out_leaves)
    )
