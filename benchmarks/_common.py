"""What every scenario shares: progress lines, interleaved timing, compile probes, FLOPs.

Timing rules (see README.md): every ratio is measured side by side in one run. Variants
are interleaved round by round (round `r` runs each variant once, in an order rotated by
`r`), every call ends in `jax.block_until_ready`, and medians are reported. Compilation
is never inside a timed call unless the call is labelled "first call".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax import monitoring

import memox


# jaxlib's CPU LAPACK kernels (eigh, cholesky, lu) run on scipy's OpenBLAS, loaded at
# the first such call. Left to its default thread count it competes with XLA's own
# thread pool: on a 2-core machine the same eigh then varies by orders of magnitude from
# one process to the next. One OpenBLAS thread is both stable and faster (README.md,
# "Environment"). A value set by the caller wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# The repository (`examples`, which s1-s3 time) and tests/ (s9's stiff problems,
# `tests/stiff_problems.py`) importable, for a scenario run as a script too; appended,
# so that nothing there shadows an installed module.
_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path += [str(_REPO), str(_REPO / "tests")]


@dataclasses.dataclass(frozen=True)
class Goal:
    """A scenario's target for a headline measure: `value <op> bound`.

    A scenario declares its goals in a module-level `GOALS`, by headline measure: a key
    applies to the measures it begins with, the longest key winning (so one key can
    cover a measure's sizes, "..., T=50" and "..., T=200"). `unmet` says why the measure
    misses the goal where it is known to (the mechanism, not a figure: the report adds
    the measured value); the report shows an unmet goal with it, or says that the
    scenario gives no reason.
    """

    op: str  # "<=" or ">="
    bound: float
    unmet: str = ""

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"Goal: op must be '<=' or '>=', got {self.op!r}")

    def met(self, value: float) -> bool:
        return value <= self.bound if self.op == "<=" else value >= self.bound


def goal_key(goals: dict[str, Goal], measure: str) -> str | None:
    """The key of `measure`'s goal among a scenario's `GOALS`: the longest key that
    `measure` begins with, if any."""
    keys = [k for k in goals if measure.startswith(k)]
    return max(keys, key=len) if keys else None


def flops_of(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> int:
    """FLOPs of one evaluation of `fn(*args, **kwargs)` (`memox.flops`)."""
    return memox.flops(fn, *args, **kwargs).flops


T0 = time.perf_counter()


def progress(message: str) -> None:
    """One progress line, with the time since the run started."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {message}", flush=True)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`fn()` and its wall time in seconds, waiting for every array it returns."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def interleaved(
    fns: dict[str, Callable[[], Any]], rounds: int, block: int = 1
) -> dict[str, list[float]]:
    """Wall times (s) of each zero-argument function, `rounds * block` each, interleaved.

    Round `r` calls every function `block` times in a row (each call timed on its own),
    starting from the `r`-th function, so no variant always runs first or after the same
    neighbour. With `block > 1` the median is not the call right after a neighbour that
    left work behind (freeing or faulting in large buffers). Warm up (compile) first."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            for _ in range(block):
                times[name].append(timed(fns[name])[1])
    return times


def median(xs: Any) -> float:
    return float(np.median(np.asarray(xs)))


def rate(flops: float, seconds: float) -> float:
    """Achieved FLOP/s (NaN when nothing was timed)."""
    return flops / seconds if seconds > 0 else math.nan


@functools.cache
def matmul_peak() -> float:
    """The device's practical peak, FLOP/s: a plain jitted float32 matrix product
    (4096 x 4096 on a GPU, 1024 x 1024 on a CPU), median of 10 after a warm-up. The
    achieved rates of the scenarios are put against it (`of matmul peak`)."""
    n = 4096 if is_gpu() else 1024
    a = jax.random.normal(jax.random.key(0), (n, n))
    product = jax.jit(jax.numpy.matmul)
    timed(lambda: product(a, a))
    return rate(2 * n**3, median([timed(lambda: product(a, a))[1] for _ in range(10)]))


# -- compile probes ---------------------------------------------------------------------

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_probes: list[dict[str, float]] = []


def _listener(event: str, duration: float, **_: Any) -> None:
    if event == _BACKEND_COMPILE:
        for probe in _probes:
            probe["compile_s"] += duration
            probe["compiles"] += 1


monitoring.register_event_duration_secs_listener(_listener)


@contextlib.contextmanager
def compile_probe() -> Iterator[dict[str, float]]:
    """Counts XLA compilations and sums their backend compile time inside the block.

    Tracing and lowering are not listed separately (their events nest); they are the
    rest of a first call: first-call wall time - compile time - one steady call."""
    probe = {"compile_s": 0.0, "compiles": 0}
    _probes.append(probe)
    try:
        yield probe
    finally:
        _probes.remove(probe)


def first_call(fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """`fn()` run for the first time: its result, wall time and XLA compile time."""
    with compile_probe() as probe:
        out, wall = timed(fn)
    return out, {"first_call_s": wall, **probe}


def programs(name: str) -> int:
    """How many programs variant `name`'s step may compile without retracing: memox's
    wrappers compile a second one once the host knows which slots hit (a read with no
    check, `memox._decided.Hits`); anything more is a retrace."""
    return 2 if "memox.jit" in name or "memox.filter_jit" in name else 1


class TraceCounter:
    """Counts traces of jitted functions: call `tick(name)` in the traced body."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def tick(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)


def compile_row(name: str, probe: dict[str, float], steady_s: float, traces: int) -> dict:
    """A row of scenario 6: what the first call of a variant cost beyond a steady call."""
    overhead = probe["first_call_s"] - steady_s
    return {
        "variant": name,
        "traces": traces,
        "first call [s]": probe["first_call_s"],
        "steady call [s]": steady_s,
        "XLA compiles": int(probe["compiles"]),
        "XLA compile [s]": probe["compile_s"],
        "trace+lower [s]": max(overhead - probe["compile_s"], 0.0),
    }


def slot_bytes(slot: Any) -> dict[str, int]:
    """Bytes of each leaf of an allocated `memox.Memo` slot, by field name (a field the
    slot does not use, `snapshot` but under `Drift`, holds no array: 0 bytes)."""
    fields = ("value", "valid", "key", "age", "used", "snapshot", "hits", "misses")
    return {f: int(getattr(getattr(slot, f), "nbytes", 0)) for f in fields}


def is_gpu() -> bool:
    return jax.devices()[0].platform != "cpu"
