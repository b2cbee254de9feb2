"""XLA compile time of two checkouts of memox, side by side, over the unmemoized program.

    git worktree add /tmp/before <commit>
    python benchmarks/compile_checkouts.py /tmp/before . [--reps 3] [--rounds 5]

Two programs, each lowered anew and compiled `--rounds` times per process:

- s13's training step at 16 layers (each variant of the checkout's s13: the memox
  step, its Manual variant, the hand-written cache where s13 has it, and the
  unmemoized step), under `eqx.filter_jit`;
- s12's chain of 200 leaves with 100 slots: the first program of `memox.jit`, against
  `eqx.filter_jit` of the unmemoized forward pass.

Each checkout measures in a fresh process, the two alternating, `--reps` times, which
runs first swapped at each repetition. A compile is timed in CPU seconds of the process
(`time.process_time`), which the other tenants of a shared machine do not inflate, and
in wall seconds. Prints each run's
medians over the unmemoized program compiled in the same process, then the medians of
the runs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from compare_checkouts import arguments, in_turn, run_in


# Run in each checkout's own process: its memox, its s12 and s13.
_ONE = """
import json, statistics, sys, time
tree, rounds = sys.argv[1], int(sys.argv[2])
sys.path[:0] = [tree, tree + "/benchmarks"]
import equinox as eqx, jax, jax.numpy as jnp
import memox
assert memox.__file__.startswith(tree), memox.__file__
import s12_scaling, s13_scan_layers as s13
from _common import TraceCounter

def timed(lower):
    lowered = lower()
    cpu, wall = time.process_time(), time.perf_counter()
    lowered.compile()
    return time.process_time() - cpu, time.perf_counter() - wall

model = s13.Model(64, 16, 32, TraceCounter())
lowerings = {}
for name in s13.LAYERS:
    state = s13.initial(model, name)
    lowerings["s13 " + name] = lambda name=name, state=state: model.step(name).lower(
        *state, model.x, model.y
    )
chain, x = s12_scaling.chain(200, 100), jnp.ones(4)
lowerings["s12 100 slots memox.jit"] = lambda: memox.jit(lambda m, x: m(x)).lower(chain, x)
lowerings["s12 100 slots unmemoized"] = lambda: eqx.filter_jit(
    lambda m, x: m.plain(x)
).lower(chain, x)
times = {name: [] for name in lowerings}
for _ in range(rounds):
    for name, lower in lowerings.items():
        times[name].append(timed(lower))
medians = {n: [statistics.median(t[i] for t in ts) for i in (0, 1)] for n, ts in times.items()}
print("RESULT", json.dumps(medians))
"""
REFERENCES = {"s13": "s13 unmemoized", "s12": "s12 100 slots unmemoized"}


def measure(tree: Path, rounds: int) -> dict[str, tuple[float, float]]:
    """Compile time over the unmemoized program's (CPU, wall), in a fresh process."""
    medians = run_in(tree, _ONE, str(rounds))
    out = {}
    for name, (cpu, wall) in medians.items():
        ref = medians[REFERENCES[name.split()[0]]]
        if name not in REFERENCES.values():
            out[name] = (cpu / ref[0], wall / ref[1])
    return out


def main() -> None:
    options = arguments(__doc__, reps=3, rounds=5)
    trees = {"before": options.before.resolve(), "after": options.after.resolve()}
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {name: [] for name in trees}
    for rep in range(options.reps):
        for name, tree in in_turn(trees, rep):
            got = measure(tree, options.rounds)
            runs[name].append(got)
            shown = ", ".join(f"{v}: {c:.2f}x CPU, {w:.2f}x wall" for v, (c, w) in got.items())
            print(f"{name} (run {rep + 1}): {shown}", flush=True)
    print("\nMedian compile time over the unmemoized program's (same process):")
    for name, got in runs.items():
        shown = ", ".join(
            f"{v}: {statistics.median(r[v][0] for r in got):.2f}x CPU, "
            f"{statistics.median(r[v][1] for r in got):.2f}x wall"
            for v in got[0]
        )
        print(f"  {name} ({trees[name]}): {shown}")


if __name__ == "__main__":
    main()
