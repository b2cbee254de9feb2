"""`memox.scan`: `jax.lax.scan`, with cached values the loop does not change read as
loop constants.

Inside `lax.scan`, a cached value is read from a slot in the carry, and the carry may
change every step. So when the loop is differentiated, JAX saves the value once per step
for the backward pass (`T` copies of a Cholesky factor), where the unmemoized loop
computes the factor from loop constants and saves it once. A slot that the first step
fills is not passed through unchanged; no rewriting inside the body can make it so.

**Why the loop must not rely on JAX hoisting the read** (jax 0.12 lost it). Under
`grad`, `_scan_linearize` partially evaluates the body again with only the loop's
constants known (`_scan_known_hoisting` in `jax/_src/lax/control_flow/loops.py`) and
hoists the residuals that come out known. A pinned read used to be `entry(table,
lookup(key))` inside the cached call's `custom_jvp`, with the table's entries made
constants by `lax.scan`'s `move_to_const`; but the same `custom_jvp_call` also takes the
slot's hit counters, which are carried and change every step. jax 0.10's
`JaxprTrace.process_custom_jvp_call` inlined the primal of a `custom_jvp` whose operands
were partly unknown, so the read, from constants only, came out known and was hoisted;
jax 0.12's stages the whole call as one equation, unknown as soon as one operand is, so
the value became a per-step residual: 21.5x the unmemoized loop's temporaries (0.10's
rule patched into 0.12 gives 1.07x again).

So `memox.scan` makes the value a loop constant by construction:

1. **Probe**: trace the body once, abstractly, with every allocated slot of the carry
   pinned (`_context.Pins`), and keep the pins that held: slots whose every read depends
   on loop-invariant values only and whose entries the body passes through unchanged.
2. **First step**: run the body on the first element outside the loop. It fills the
   pinned slots exactly as `lax.scan`'s first step would, and records, per pinned slot,
   the value its first call returned and the entry that holds it.
3. **The rest**: `lax.scan` over the indices of the other elements (the body reads them
   from `xs`, closed over: slicing `xs` would copy it). The pinned slots' entries
   (`value`, `valid`, `key`, `snapshot`) leave the carry: the body closes over them and
   rebuilds each slot from them and its carried counters, and they are put back after
   the loop. A pinned call returns the first step's value, closed over by the body, and
   touches its entry (counters stay in the carry: `memox.stats` counts every read). No
   fingerprint, lookup or branch runs in the loop, and no residual depends on a
   per-step value: under `grad` the value is a loop constant, saved once, whatever JAX's
   partial evaluation hoists.

Counts are those of `lax.scan(f, init, xs)`, and results and gradients are its values
computed in another order, not always bit for bit:

- the first step is compiled outside a loop, and XLA may run the same operation with
  another kernel there: on jax 0.12's XLA:CPU a `dot` gives other bits at the top level
  than inside a `while` body (a matrix-vector product: the two differ by a summation
  order, below 2^-24 * sum |w_i x_i| per element; jax 0.10.2's XLA gives the same bits),
  and the difference goes on through the carry. Running the first step as a one-step
  `lax.scan` does not help: XLA removes a loop of one trip.
- a value whose dependencies carry a tangent is computed once, in the first step, and
  its cotangents are summed over the steps before being pulled back through the method
  once, where `lax.scan` pulls back each step's and sums those: the same sum,
  associated differently (a few ulps).

Where neither applies (elementwise bodies, frozen modules) they are bitwise equal. The
body is traced three times and compiled twice (the first step and the loop) when some
slot is pinned, and `lax.scan` is called directly when none is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _context, _errors, _jax_internals
from ._slot import ENTRY_FIELDS, Memo, Path, replace_slots, slots
from ._typing import Fn


C = TypeVar("C")
X = TypeVar("X")
Y = TypeVar("Y")


def scan(
    f: Fn[[C, X], tuple[C, Y]],
    init: C,
    xs: X | None = None,
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
    not one per step, as the same loop without memox does: the loop body closes over
    the value, whatever JAX's partial evaluation hoists. A hit in the loop costs no
    fingerprint, no branch and no copy of the slot.

    Results, gradients and `memox.stats` counts are those of `jax.lax.scan`, results
    and gradients up to rounding: the first step is compiled outside the loop, where
    XLA may pick other kernels (a dot product summed in another order), and a hoisted
    value's cotangents are summed over the steps before being pulled back through the
    method once. Where no slot can be hoisted, this is `jax.lax.scan`.

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
    recorder = _context.Pins(init, pins, outer, "first", enclosing=_context.pins())
    with _context.pinning(recorder):
        carry, y_first = f(init, jtu.tree_map(lambda x: jnp.asarray(x)[first], xs))
    reads, recorder = recorder.reads, None
    pins = pins.intersection(reads)
    # The other elements, by index: slicing `xs` would copy it.
    rest = jnp.arange(n - 1) if reverse else jnp.arange(1, n)
    while True:  # the pins held in the probe; they hold here unless `f` traces differently
        carry_out, ys, failed = _loop(f, carry, xs, rest, reverse, unroll, pins, reads, outer)
        if not failed:
            break
        pins = pins - failed  # (the loop traced is discarded: dead code under `jit`)
    return carry_out, jtu.tree_map(lambda a, b: _stack(a, b, reverse), y_first, ys)


def _loop(
    f: Callable,
    carry: Any,
    xs: Any,
    steps: Any,
    reverse: bool,
    unroll: int | bool,
    pins: frozenset[Path],
    reads: dict[Path, tuple[Any, Any]],
    outer: Any,
) -> tuple[Any, Any, frozenset[Path]]:
    """`lax.scan(f, carry, xs[steps], reverse=reverse, unroll=unroll)` with the slots at
    `pins` pinned: the first step's `reads` and the slots' entries are closed over by the
    body, not carried. Also returns the pins that did not hold (then the results are not
    those of `f`)."""
    entries = {path: slot for path, slot in slots(carry).items() if path in pins}
    verdicts: list[tuple[frozenset[Path], frozenset[Path]]] = []
    body = _pinned(f, pins, outer, verdicts, reads) if pins else f

    # A trace that raises keeps what its body closed over alive (JAX cleans a trace up
    # when it returns), so a pin that does not hold is reported, never raised.
    def loop_body(c: Any, i: Any) -> Any:
        x = jtu.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)
        c_out, y = body(_with_entries(c, entries), x)
        return _without_entries(c_out, pins), y

    carry, ys = lax.scan(loop_body, _without_entries(carry, pins), steps, None, reverse, unroll)
    failed = frozenset().union(*(failed for _, failed in verdicts))
    return _with_entries(carry, entries), ys, failed


def _without_entries(tree: Any, pins: frozenset[Path]) -> Any:
    """`tree` with the entries of the slots at `pins` left out (counters kept)."""
    out = {
        path: dataclasses.replace(slot, **dict.fromkeys(ENTRY_FIELDS))
        for path, slot in slots(tree).items()
        if path in pins
    }
    return replace_slots(tree, out)


def _with_entries(tree: Any, entries: dict[Path, Memo]) -> Any:
    """`tree` with the entries of the slots in `entries` put back (its counters kept)."""
    out = {
        path: dataclasses.replace(slot, **{f: getattr(entries[path], f) for f in ENTRY_FIELDS})
        for path, slot in slots(tree).items()
        if path in entries
    }
    return replace_slots(tree, out)


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


def _pinned(
    f: Callable,
    allowed: frozenset[Path],
    outer: Any,
    verdicts: list[tuple[frozenset[Path], frozenset[Path]]],
    reads: dict[Path, tuple[Any, Any]] | None = None,
) -> Callable:
    """`f` with the slots at paths `allowed` of its carry pinned: reading the first
    step's `reads` (in the loop), or the table (in the probe, without `reads`). Appends
    to `verdicts` the pins that were used and held, and those that did not hold."""

    def body(carry: Any, x: Any) -> Any:
        mode = "probe" if reads is None else "loop"
        pins = _context.Pins(carry, allowed, outer, mode, reads=reads)
        with _context.pinning(pins):
            out = f(carry, x)
        verdicts.append(pins.holding(_carry_of(out)))
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
