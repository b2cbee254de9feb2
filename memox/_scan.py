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
2. **First step**: run the body on the first element outside the loop, for what it
   fills only. It fills every slot exactly as `lax.scan`'s first step would, and records,
   per pinned slot, the value its first call returned and the entry that holds it. Its
   carry and output are not used (dead code under `jit`).
3. **The loop**: `lax.scan` over *all* of `xs`, step 0 included, as `lax.scan` scans
   it (with the step's index), from `init` with its slots as the first step left them.
   No slice of `xs` is copied, and under `vjp` JAX forwards `xs` to the backward pass
   where it needs an element (one read by index from `xs` closed over is a value of the
   loop, saved per step: a copy of `xs`). The pinned slots' entries (`value`, `key`,
   `snapshot`) leave the carry: the body closes over them and rebuilds each slot
   from them and its carried counters, and they are put back after the loop. A pinned
   call returns the first step's value, closed over by the body, and touches its entry.
   No fingerprint, lookup or branch runs for it in the loop, and no residual depends on
   a per-step value: under `grad` the value is a loop constant, saved once, whatever
   JAX's partial evaluation hoists. At step 0 every other cached call finds the value the
   first step stored (a hit), and every slot's counters are set to the first step's
   after it.

So the loop is `lax.scan`'s loop, from the same `init`: the carry and the outputs have
`lax.scan`'s types (weak types, shardings) by construction, `memox.stats` counts are
`lax.scan`'s (but under differentiation: see `scan`'s docstring), and every step of the
body, step 0 included, is computed in the loop. Results differ from `lax.scan`'s only
through the cached values:

- a value that step 0 computes is computed by the first step, outside the loop, where
  XLA may compile the method otherwise than inside `lax.scan`'s loop (measured: on jax
  0.12's XLA:CPU, a 64x64 matrix-vector product in the method differs by an ulp; bitwise
  on jax 0.10.0). The first step's inputs that change per step or are compile-time
  constants go through an optimization barrier: XLA would fold an operation on
  constants at compile time, with other rounding than its kernels.
- a pinned value is a loop constant, where `lax.scan` reads it from the slot in every
  step: what the body computes from it and other loop constants only is loop-invariant,
  and XLA may hoist it out of the loop and compute it once (measured: on jax 0.12's
  XLA:CPU, `W @ v` for a pinned `v` and a 64x64 `W` differs by an ulp in every step;
  bitwise on jax 0.10.0). The value goes through an optimization barrier first, so
  nothing computed from it is folded.
- a value whose dependencies carry a tangent is computed once, in the first step, and
  its cotangents are summed over the steps before being pulled back through the method
  once, where `lax.scan` pulls back each step's and sums those: the same sum,
  associated differently (a few ulps).

Elsewhere (elementwise bodies, frozen modules, values read from a filled slot) the
results are `lax.scan`'s bit for bit. (They were not when step 0's results came from
the first step: XLA constant-folds, at compile time and with other rounding than its
kernels, what the top level of a program computes from constants only, which it does not
do to a loop's carry; and eagerly, the first step ran op by op.)

The body is traced three times when some slot is pinned, and `lax.scan` is called
directly when none is. Step 0 runs twice, once outside the loop for what it fills (the
rest of it is dead code, which jax 0.10's XLA computes: see `_at_run_time`): side
effects in the body outside cached methods (`jax.debug.print`) happen twice for it, and
a cached method that step 0 makes miss again after filling it (invalidated in the body,
an entry evicted by more keys per step than the slot holds, a branch run as a `select`
under `vmap`) runs in the loop's step 0 again (counts stay `lax.scan`'s).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, SupportsInt, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _context, _errors, _jax_internals
from ._sites import Path, replace_slots, slots
from ._slot import ENTRY_FIELDS, Memo
from ._typing import Callable


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


C = TypeVar("C")
X = TypeVar("X")
Y = TypeVar("Y")


def scan(
    f: Callable[[C, X], tuple[C, Y]],
    init: C,
    xs: X | None = None,
    length: SupportsInt | None = None,
    reverse: bool = False,
    unroll: SupportsInt = 1,
    _split_transpose: bool = False,
) -> tuple[C, Y]:
    """`jax.lax.scan(f, init, xs, length, reverse, unroll, _split_transpose)`, for a
    carry that holds modules with `memox.Memo` slots.

    Cached methods whose inputs the loop does not change (their dependencies are
    passed through the carry unchanged, or come from outside the loop) are computed
    once, by the first step run outside the loop for what it fills, and read as loop
    constants in every step of the loop. Under `jax.grad` the loop then keeps one copy
    of such a value for the backward pass, not one per step, as the same loop without
    memox does: the loop body closes over the value, whatever JAX's partial evaluation
    hoists. A hit in the loop costs no fingerprint, no branch and no copy of the slot.

    The loop is `jax.lax.scan`'s, from the same `init`: the final carry and the stacked
    outputs have its types (dtypes, shapes, weak types, shardings), and every step of
    the body is computed in the loop. Results and gradients differ from `jax.lax.scan`'s
    only through the cached values, by rounding: one computed outside the loop, where
    XLA may compile the method otherwise (on jax 0.12's XLA:CPU, a dot by an ulp); what
    the body computes from a loop-constant value alone, which XLA may hoist out of the
    loop; and a differentiated value's cotangents, summed over the steps before being
    pulled back through the method once. Elsewhere they are bitwise equal.

    `memox.stats` counts are `jax.lax.scan`'s, but where a hoisted method's dependencies
    or arguments carry a tangent (`jax.grad`, `jax.jvp`, ... with respect to them):
    there `jax.lax.scan` runs the method's `jvp` at every read and counts `T` misses,
    and `memox.scan` runs it once and counts one miss (the first step) and `T - 1` hits,
    as it does undifferentiated.

    Step 0 of `f` runs twice (outside the loop, for what it fills, and in the loop): a
    side effect in `f` outside a cached method (`jax.debug.print`) happens twice for it.
    Where no slot can be hoisted, this is `jax.lax.scan`.

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
        raise TypeError(_errors.SCAN_NOT_CALLABLE.format(got=type(f).__name__))
    n = _length(xs, length)
    candidates = frozenset(path for path, slot in slots(init).items() if slot.allocated)
    if n is not None and n >= 2 and candidates:
        pins, changed = _probe(f, init, xs, candidates, _jax_internals.current())
        if pins:
            init = jtu.tree_map(_as_array, init)  # as `lax.scan` would pass them to `f`
            return _hoisted(f, init, xs, n, reverse, unroll, _split_transpose, pins, changed)
    # (JAX annotates `length` and `unroll` as `int`; it takes what `int` takes.)
    return lax.scan(f, init, xs, length, reverse, unroll, _split_transpose)  # pyright: ignore[reportArgumentType]


def _hoisted(
    f: Callable[..., Any],
    init: Any,
    xs: Any,
    n: int,
    reverse: bool,
    unroll: SupportsInt,
    split_transpose: bool,
    pins: frozenset[Path],
    changed: list[bool],
) -> tuple[Any, Any]:
    """`lax.scan(f, init, xs, n, reverse, unroll, split_transpose)`: the first step
    outside the loop, for what it fills, then `lax.scan` over every step with the slots
    at `pins` read as loop constants. `changed`: per leaf of `init`, whether `f` returns
    another value for it."""
    outer = _jax_internals.current()
    first = n - 1 if reverse else 0
    x_first = jtu.tree_map(lambda x: jnp.asarray(x)[first], xs)
    enclosing = _context.pins()
    recorder = _context.Pins(init, pins, outer, "first", enclosing=enclosing)
    with _context.pinning(recorder):
        # Only its slots are used: its carry and output are dead code.
        filled, y = f(*_opaque(init, x_first, changed, nested=enclosing is not None))
    reads, recorder = recorder.reads, None
    pins = pins.intersection(reads)
    reads = _at_run_time(reads, step0=(filled, y))
    after = {path: slot for path, slot in slots(filled).items() if slot.allocated}
    while True:  # the pins held in the probe; they hold here unless `f` traces differently
        carry, ys, failed = _loop(
            f, init, xs, n, reverse, unroll, split_transpose, pins, reads, after, outer
        )
        if not failed:
            return carry, ys
        pins = pins - failed  # (the loop traced is discarded: dead code under `jit`)


def _opaque(init: Any, x: Any, changed: list[bool], *, nested: bool) -> tuple[Any, Any]:
    """The first step's arguments, with the leaves that XLA could take for constants
    hidden (`_hidden`): those of `x`, the leaves of `init` the body does not return as
    they are, and (but inside an enclosing `memox.scan`, which recognises a
    loop-invariant dependency by its identity) the leaves that are arrays, not tracers:
    constants in the program being traced. Inside `lax.scan`'s loop the carry and `x`
    are not constants; what the first step fills outside it is then computed as the
    loop would compute it."""
    n = len(jtu.tree_leaves(init))

    def hide(i: int, a: Any) -> bool:
        return i >= n or changed[i] or (not nested and not isinstance(a, jax.core.Tracer))

    return _hidden((init, x), hide)


def _at_run_time(reads: dict[Path, tuple[Any, Any]], step0: Any) -> dict[Path, tuple[Any, Any]]:
    """The first step's `reads` as the loop reads them: behind an optimization barrier,
    known to XLA at run time only, as `lax.scan`'s loop reads the value from the slot
    (XLA would fold what the body computes from a constant); and tied to the first
    step's results `step0`, its dead code, which XLA then keeps until it has laid the
    values out.

    Without that tie, jax 0.10's XLA:CPU lays out a value that only the loop reads in
    row-major order and copies it, in a buffer of its own, into the column-major order
    that LAPACK reads in the loop (a Cholesky factor under `grad`: 1.39x the unmemoized
    loop's temporaries, N = 256, T = 50); with step 0's use of it at the top level, it
    decodes it into that order directly, as it did when step 0's results were used.
    jax 0.12's XLA then drops the dead code; jax 0.10's computes it (once)."""
    values = [value for value, _ in reads.values()]
    alive = [a for a in jtu.tree_leaves(step0) if jnp.issubdtype(jnp.result_type(a), jnp.inexact)]
    values, _ = _hidden((values, alive))
    return {path: (v, index) for (path, (_, index)), v in zip(reads.items(), values)}


def _hidden(tree: Any, hide: Callable[[int, Any], bool] = lambda i, a: True) -> Any:
    """`tree` with its floating-point leaves (those for which `hide(index, leaf)`) behind
    an optimization barrier, values XLA knows only at run time. XLA evaluates an
    operation whose operands are all compile-time constants while it compiles (`sin`,
    `exp`, a division, a reduction), with other rounding than its compiled kernels."""
    leaves, treedef = jtu.tree_flatten(tree)
    hidden = [
        i
        for i, a in enumerate(leaves)
        if jnp.issubdtype(jnp.result_type(a), jnp.inexact) and hide(i, a)
    ]
    for i, a in zip(hidden, lax.optimization_barrier([leaves[i] for i in hidden])):
        leaves[i] = a
    return jtu.tree_unflatten(treedef, leaves)


def _loop(
    f: Callable[..., Any],
    init: Any,
    xs: Any,
    n: int,
    reverse: bool,
    unroll: SupportsInt,
    split_transpose: bool,
    pins: frozenset[Path],
    reads: dict[Path, tuple[Any, Any]],
    after: dict[Path, Memo],
    outer: Any,
) -> tuple[Any, Any, frozenset[Path]]:
    """`lax.scan(f, init, xs, n, reverse, unroll, split_transpose)`, its slots starting as
    the first step left them (`after`), with the slots at `pins` pinned: the first
    step's `reads` and the slots' entries are closed over by the body, not carried. Step
    0's counters are set to those of `after`. Also returns the pins that did not hold
    (then the results are not those of `f`)."""
    entries = {path: slot for path, slot in after.items() if path in pins}
    verdicts: list[tuple[frozenset[Path], frozenset[Path]]] = []
    body = _pinned(f, pins, outer, verdicts, reads) if pins else f
    first = n - 1 if reverse else 0

    # A trace that raises keeps what its body closed over alive (JAX cleans a trace up
    # when it returns), so a pin that does not hold is reported, never raised.
    def loop_body(c: Any, ix: Any) -> Any:
        i, x = ix
        c_out, y = body(_with_entries(c, entries), x)
        return _without_entries(_counted_as(c_out, after, i == first), pins), y

    # `xs` is scanned as `lax.scan` scans it, so that JAX forwards it under `vjp`.
    start = _without_entries(replace_slots(init, after), pins)
    carry, ys = lax.scan(
        loop_body,
        start,
        (jnp.arange(n), xs),
        None,
        reverse,
        unroll,  # pyright: ignore[reportArgumentType]
        split_transpose,
    )
    failed = frozenset().union(*(failed for _, failed in verdicts))
    return _with_entries(carry, entries), ys, failed


def _counted_as(tree: Any, counted: dict[Path, Memo], where: Any) -> Any:
    """`tree` with its slots' counters (all but the entries) those of the slots in
    `counted` where `where` holds."""
    out = {}
    for path, slot in slots(tree).items():
        if path in counted:
            mine, theirs = _without_entries(slot), _without_entries(counted[path])
            mixed = jtu.tree_map(lambda a, b: jnp.where(where, b, a), mine, theirs)
            out[path] = dataclasses.replace(mixed, **{f: getattr(slot, f) for f in ENTRY_FIELDS})
    return replace_slots(tree, out)


def _without_entries(tree: Any, pins: frozenset[Path] | None = None) -> Any:
    """`tree` with the entries of the slots at `pins` (of every slot, by default) left
    out, their counters kept."""
    out = {
        path: dataclasses.replace(slot, **dict.fromkeys(ENTRY_FIELDS))
        for path, slot in slots(tree).items()
        if pins is None or path in pins
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


def _length(xs: Any, length: SupportsInt | None) -> int | None:
    """The number of steps, or `None` where `lax.scan` should say what is wrong. As
    `lax.scan`, takes any `length` that `int` takes (a NumPy or JAX integer); a traced
    one, or one that disagrees with `xs`, is left to `lax.scan` to refuse."""
    lengths = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jtu.tree_leaves(xs)}
    if length is not None:
        try:
            lengths.add(int(length))
        except (TypeError, ValueError):  # (`ConcretizationTypeError` for a tracer)
            return None
    return lengths.pop() if len(lengths) == 1 else None  # (None where a leaf is a scalar)


def _as_array(x: Any) -> Any:
    scalar_or_numpy = (bool, int, float, complex, np.ndarray, np.generic)
    return jnp.asarray(x) if isinstance(x, scalar_or_numpy) else x


def _pinned(
    f: Callable[..., Any],
    allowed: frozenset[Path],
    outer: Any,
    verdicts: list[tuple[frozenset[Path], frozenset[Path]]],
    reads: dict[Path, tuple[Any, Any]] | None = None,
) -> Callable[..., Any]:
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
    f: Callable[..., Any], init: Any, xs: Any, candidates: frozenset[Path], outer: Any
) -> tuple[frozenset[Path], list[bool]]:
    """The slots of `init` that `f` can read as loop constants (abstract traces), and
    per leaf of `init`, whether `f` returns another value for it."""
    x = jtu.tree_map(
        lambda a: jax.ShapeDtypeStruct(
            jnp.shape(a)[1:], jnp.result_type(a), weak_type=jax.typeof(a).weak_type
        ),
        xs,
    )
    allowed = candidates
    while allowed:
        verdicts: list[tuple[frozenset[Path], frozenset[Path]]] = []
        changed: list[bool] = []
        body = _pinned(f, allowed, outer, verdicts)

        def probed(carry: Any, x: Any) -> Any:
            out = body(carry, x)
            after = jtu.tree_leaves(_carry_of(out))
            changed.extend(a is not b for a, b in zip(jtu.tree_leaves(carry), after))
            return out

        out = jax.eval_shape(probed, init, x)
        if not _same_types(init, _carry_of(out)):
            return frozenset(), []  # `lax.scan` promotes weak types or says what is wrong
        held, failed = verdicts[0]
        if not failed:
            return held, changed
        allowed = allowed - failed
    return frozenset(), []


def _same_types(init: Any, out: Any) -> bool:
    """Whether the body returns a carry of the same structure, shapes and dtypes."""
    leaves, treedef = jtu.tree_flatten(init)
    out_leaves, out_treedef = jtu.tree_flatten(out)
    return treedef == out_treedef and all(
        jnp.shape(a) == b.shape and jnp.result_type(a) == b.dtype
        for a, b in zip(leaves, out_leaves)
    )
