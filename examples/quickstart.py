"""How often is a cached `b = sum(a)` really computed? Three ways to cache it, side by side.

`functools.cached_property` (the classic trap: lost under `jax.jit`), a hand-made cache
field, and `memox`. `b` is always computed by `expensive`, whose `jax.debug.callback`
bumps a counter each time the computation *executes*, eagerly or inside compiled code;
tracing does not count. Every number in the table comes from that counter.
"""

import collections
import functools
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

import memox
from memox import Memo


COUNTS = collections.Counter()  # "computed": executions of `expensive`; "traces": of jits


def expensive(a: jax.Array) -> jax.Array:
    jax.debug.callback(lambda: COUNTS.update(["computed"]))  # per execution, not per trace
    return jnp.sum(a)


# (1) Equinox accepts `cached_property` on a Module (no error, no warning), so no
# `flax.struct.PyTreeNode` is needed. The value goes into the instance `__dict__`.
class PropFoo(eqx.Module):
    a: jax.Array

    @functools.cached_property
    def b(self) -> jax.Array:
        return expensive(self.a)


# (2) A hand-made cache: a pytree field, filled functionally with `eqx.tree_at`.
class FieldFoo(eqx.Module):
    a: jax.Array
    b_cache: jax.Array | None = None

    def b(self) -> tuple[jax.Array, "FieldFoo"]:
        if self.b_cache is not None:
            return self.b_cache, self
        b = expensive(self.a)
        return b, eqx.tree_at(lambda f: f.b_cache, self, b, is_leaf=lambda x: x is None)


# (3) memox.
class MemoFoo(eqx.Module):
    a: jax.Array
    b_cache: Memo[jax.Array] = Memo()

    @memox.cached("b_cache")
    def b(self) -> jax.Array:
        return expensive(self.a)


class Approach(NamedTuple):
    name: str
    cls: type
    get: Callable[[Any], tuple[jax.Array, Any]]  # foo -> (b, foo), eager or in a scan body
    jit: Callable[[Callable], Callable] = eqx.filter_jit  # how the user compiles `body`
    body: Callable[[Any], Any] | None = None  # what is compiled, if not `get`
    carry: Callable[[Any], Any] = lambda foo: foo  # makes `foo` a `lax.scan` carry


def call_b(foo: MemoFoo) -> tuple[jax.Array, MemoFoo]:
    return memox.call(foo, MemoFoo.b)


APPROACHES = [  # a scan carry needs memox's slots allocated: `memox.init`
    Approach("cached_property", PropFoo, lambda f: (f.b, f)),
    Approach("cache field", FieldFoo, FieldFoo.b),
    Approach("memox", MemoFoo, call_b, memox.jit, MemoFoo.b, memox.init),
]


def compiled(ap: Approach) -> Callable:
    def body(foo):
        COUNTS.update(["traces"])  # a Python side effect: once per trace
        return (ap.body or ap.get)(foo)

    return ap.jit(body)


def eager_twice(ap: Approach, foo: Any) -> None:
    _, foo = ap.get(foo)
    _, foo = ap.get(foo)


def eager_then_jit(ap: Approach, foo: Any) -> None:
    _, foo = ap.get(foo)
    _, foo = compiled(ap)(foo)


def jit_three_times(ap: Approach, foo: Any) -> None:
    # The returned module is threaded, as a careful user would. (2) retraces on the 2nd
    # call as `b_cache` went from `None` to an array. So does (1): the module returned by
    # `eqx.filter_jit` has no `b`, yet carries Equinox's empty wrapper metadata
    # (`__module__`, `__doc__`, ...) in its `__dict__`, which changes its treedef.
    step = compiled(ap)
    for _ in range(3):
        _, foo = step(foo)


def scan_five(ap: Approach, foo: Any) -> None:
    # XLA never hoists a callback out of a loop: a count of 1 means 4 of the 5 steps
    # really skipped the computation (memox's hit branch of a `lax.cond`).
    jax.lax.scan(lambda f, _: ap.get(f)[::-1], ap.carry(foo), length=5)


def change_a(ap: Approach, foo: Any) -> str:
    _, foo = ap.get(foo)
    foo = eqx.tree_at(lambda f: f.a, foo, 2 * foo.a)
    b, _ = ap.get(foo)
    return "" if b == jnp.sum(foo.a) else " STALE"


SCENARIOS = [  # (label, scenario, computations an ideal cache needs)
    ("(a) foo.b twice, eagerly", eager_twice, 1),
    ("(b) eagerly, then in jit", eager_then_jit, 1),
    ("(c) jitted fn called 3x", jit_three_times, 1),
    ("(d) lax.scan, 5 steps", scan_five, 1),
    ("(e) change a, then b again", change_a, 2),
]
WHY = {  # printed under an error, where we know why it happens
    ("cached_property", scan_five): "`b` in `__dict__` changes the carry's Equinox metadata.",
    ("cache field", scan_five): "`b_cache` goes from `None` to an array in the carry.",
}


def measure(ap: Approach, scenario: Callable, notes: list[str]) -> tuple[str, int | None, bool]:
    """A cell's text, its count (None on error), and whether its result was stale."""
    COUNTS.clear()
    try:
        stale = scenario(ap, ap.cls(jnp.ones((3, 3)))) or ""
        jax.effects_barrier()  # every pending callback has run
    except Exception as e:
        # The error's first line in full (JAX's first line says what went wrong), wrapped.
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        text = f"[{len(notes) + 1}] {ap.name}: {type(e).__name__}: {first}"
        notes.append(textwrap.fill(text, 88, subsequent_indent="    "))
        notes[-1] += f"\n    why: {WHY[ap.name, scenario]}" if (ap.name, scenario) in WHY else ""
        return f"error [{len(notes)}]", None, False
    n, traces = COUNTS["computed"], COUNTS["traces"]
    return f"{n}{f' ({traces} traces)' if traces > 1 else ''}{stale}", n, bool(stale)


def main() -> None:
    notes: list[str] = []
    cells = [[measure(ap, s, notes) for ap in APPROACHES] for _, s, _ in SCENARIOS]
    w0 = max(len(label) for label, _, _ in SCENARIOS)
    ws = [max(len(ap.name), *(len(row[j][0]) for row in cells)) for j, ap in enumerate(APPROACHES)]
    print("How many times is b = sum(a) computed?\n")
    print(" " * w0 + " | " + " | ".join(ap.name.ljust(w) for ap, w in zip(APPROACHES, ws)))
    print("-" * w0 + "-+-" + "-+-".join("-" * w for w in ws))
    for (label, _, _), row in zip(SCENARIOS, cells):
        print(label.ljust(w0) + " | " + " | ".join(c[0].ljust(w) for c, w in zip(row, ws)))
    print("\n" + "\n".join(notes) + "\nSTALE: the value returned is not sum(a) for the new `a`.")
    print("cached_property is used on an `eqx.Module` itself: Equinox accepts it silently.\n")
    for j, ap in enumerate(APPROACHES):
        ran = [(r[j], n) for r, (_, _, n) in zip(cells, SCENARIOS) if r[j][1] is not None]
        extra = sum(c[1] - ideal for c, ideal in ran if not c[2])  # over correct results only
        errors, stale = len(cells) - len(ran), sum(c[2] for c, _ in ran)
        print(f"{ap.name:<16} extra computations: {extra}   errors: {errors}   stale: {stale}")


if __name__ == "__main__":
    main()
