"""Where a `memox.jit` call's time goes, on s12's chain, and what `jax.jit` charges per
array it takes and returns.

    python benchmarks/call_breakdown.py [--leaves 200] [--slots 100] [--calls 300]

Part 1 times each step of a threaded `memox.jit` hit (a timer around each function,
which adds about a microsecond per step): taking the call apart (`Signature.split`),
deciding the hits on the host, dispatching the compiled program, handing the returned
slots to the module's slot nodes (or, where not all were donated, putting them into a
new module). Part 2 times a plain `jax.jit` of tiny arrays, as the number of arrays in
and out grows: the floor that a slot's buffers add to a call, whatever memox does on the
host. Part 3 times a decided hit's program with each slot's counters in one array, as
memox keeps them, in three, and with none.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import median
from s12_scaling import chain

import memox
from memox import _decided, _partition, _table


_spent: collections.Counter = collections.Counter()


def _add_time(label: str, fn: Callable, *args: Any) -> Any:
    """`fn(*args)`, its time added to `_spent[label]`."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        _spent[label] += time.perf_counter() - start


def _timed(owner: Any, name: str, label: str) -> None:
    """Replace the method or attribute `owner.name` by one adding its time to `_spent`."""
    original = getattr(owner, name)
    setattr(owner, name, lambda *args: _add_time(label, original, *args))


def _times_us(fn: Callable[[], Any], calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e6 * (time.perf_counter() - start))
    return times


def _median_us(fn: Callable[[], Any], calls: int) -> float:
    return median(_times_us(fn, calls))


def breakdown(leaves: int, slots: int, calls: int) -> None:
    x = jnp.ones(4)
    model = chain(leaves, slots)
    step = memox.jit(lambda m, x: m(x))
    reference = eqx.filter_jit(lambda m, x: m.plain(x))
    state = {"model": model}

    def threaded() -> Any:
        y, state["model"] = step(state["model"], x)
        return y

    for _ in range(5):  # both programs compiled, the hits decided on the host
        threaded()
        reference(model, x)
    _timed(_decided.Hits, "decide", "decide the hits (Hits.decide)")
    _timed(_partition._Split, "parted", "pass the entries apart (parted)")
    _timed(_partition._Split, "hand_over", "hand the slots over, or put them in a new module")
    _timed(step, "_compiled", "dispatch and program (jax.jit)")
    split = _partition.Signature.split  # (a class method: bound already)

    def timed_split(*args: Any) -> Any:
        found = _add_time("take the call apart (Signature.split)", split, *args)
        put = found.put
        found.put = lambda new_slots: _add_time(
            "put the slots into the module (put)", put, new_slots
        )
        return found

    _partition.Signature.split = staticmethod(timed_split)
    _spent.clear()
    times = _times_us(threaded, calls)
    parts = {k: 1e6 * v / calls for k, v in _spent.items()}
    unmemoized = _median_us(lambda: reference(model, x), calls)
    print(
        f"{leaves} leaves, {slots} slots: memox.jit hit {median(times):.0f} us a "
        f"call (median), {sum(times) / calls:.0f} us (mean)"
    )
    print(f"  reference, eqx.filter_jit of the unmemoized model: {unmemoized:.0f} us")
    for part, us in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"  {part}: {us:.0f} us (mean)")


def dispatch_floor(calls: int) -> None:
    print("jax.jit of tiny arrays (f32[4]): per call, median")
    for inputs, outputs in ((200, 1), (500, 1), (1400, 1), (200, 101), (200, 301)):
        xs = [jnp.ones(4) + i for i in range(inputs)]
        fn = jax.jit(lambda xs, n=outputs: (xs[0].sum(), [x + 1 for x in xs[: n - 1]]))
        fn(xs)
        print(f"  {inputs} in, {outputs} out: {_median_us(lambda: fn(xs), calls):.0f} us")


def counts_floor(slots: int, calls: int) -> None:
    """A decided hit's program at `slots` slots: a small forward pass reading each slot's
    value, plus each slot's counters, written as memox writes them (one array,
    `_table._hit_counts`) and as three arrays updated at the entry's index (age, last
    use, hits: the layout before `counts`), and without counters."""
    params = [jnp.ones(4) + i for i in range(2 * slots)]
    values = [jnp.ones(4) + i for i in range(slots)]
    index = [jnp.int32(0) for _ in range(slots)]
    counts = [jnp.zeros((2, 2), jnp.int32) for _ in range(slots)]
    apart = [(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.int32(0)) for _ in counts]

    def forward(params: list, values: list) -> Any:
        x = jnp.ones(4)
        for p, v in zip(params[::2], values):
            x = jnp.tanh(p * x + v)
        return x.sum()

    @jax.jit
    def one_array(params: list, values: list, index: list, counts: list) -> Any:
        return forward(params, values), [_table._hit_counts(c, i) for c, i in zip(counts, index)]

    @jax.jit
    def three_arrays(params: list, values: list, index: list, apart: list) -> Any:
        moved = [
            (age.at[i].add(1), used.at[i].set(hits + 1), hits + 1)
            for (age, used, hits), i in zip(apart, index)
        ]
        return forward(params, values), moved

    @jax.jit
    def none(params: list, values: list) -> Any:
        return forward(params, values)

    print(f"a decided hit's program, {slots} slots: per call, median")
    runs = {
        "counts in one array per slot": lambda: one_array(params, values, index, counts),
        "counts in three arrays per slot": lambda: three_arrays(params, values, index, apart),
        "no counts": lambda: none(params, values),
    }
    for fn in runs.values():
        fn()
    for name, fn in runs.items():
        print(f"  {name}: {_median_us(fn, calls):.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=200)
    parser.add_argument("--slots", type=int, default=100)
    parser.add_argument("--calls", type=int, default=300)
    options = parser.parse_args()
    breakdown(options.leaves, options.slots, options.calls)
    dispatch_floor(options.calls)
    counts_floor(options.slots, options.calls)


if __name__ == "__main__":
    main()
