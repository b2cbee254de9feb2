"""s12's per-call figures of two checkouts of memox, side by side in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_checkouts.py /tmp/before . [--reps 2] [--rounds 20]

For each chain of s12 (10 and 1000 leaves with one slot; 200 leaves with 10 and 100
slots), each checkout measures in a fresh process, the two alternating, `--reps` times,
which runs first swapped at each repetition.
Each process imports memox and the s12 scenario from its own checkout and reports its
per-call medians over the reference (`eqx.filter_jit` of the unmemoized forward pass)
measured in the same process, so the ratios of the two checkouts are comparable even
where the machine's load changes between processes. Prints each run, then the median
ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


CHAINS = ((10, 1), (1000, 1), (200, 10), (200, 100))  # (leaves, slots)
REFERENCE = "eqx.filter_jit, unmemoized"

# Run in each checkout's own process: its memox, its s12.
_ONE = """
import importlib, json, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/benchmarks"]
import memox
assert memox.__file__.startswith(tree), memox.__file__
s12 = importlib.import_module("benchmarks.s12_scaling")
leaves, slots, rounds = map(int, sys.argv[2:5])
print("RESULT", json.dumps(s12.measure(leaves, slots, rounds)["per_call_us"]))
"""


def run_in(tree: Path, code: str, *args: str) -> Any:
    """Run `code` in a fresh process with `tree`'s checkout first on its path: the JSON
    it prints after `RESULT `, parsed."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "-c", code, str(tree), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"{tree}: failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(found[0].removeprefix("RESULT "))


def arguments(doc: str, reps: int, rounds: int) -> argparse.Namespace:
    """The two checkouts, and how many runs and rounds per run."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser.parse_args()


def in_turn(trees: dict[str, Path], rep: int) -> list[tuple[str, Path]]:
    """The checkouts in the order repetition `rep` runs them: swapped at each one, since a
    process's place in the sequence moves its figures, the same way each time."""
    order = list(trees.items())
    return order if rep % 2 == 0 else order[::-1]


def measure(tree: Path, leaves: int, slots: int, rounds: int) -> dict[str, float]:
    """Per-call time over the reference's, of each variant, in a fresh process."""
    per_call = run_in(tree, _ONE, str(leaves), str(slots), str(rounds))
    reference = per_call.pop(REFERENCE)
    return {name: us / reference for name, us in per_call.items()}


def main() -> None:
    options = arguments(__doc__, reps=2, rounds=20)
    trees = {"before": options.before.resolve(), "after": options.after.resolve()}
    ratios: dict[tuple[int, int, str], list[dict[str, float]]] = {}
    for leaves, slots in CHAINS:
        for rep in range(options.reps):
            for name, tree in in_turn(trees, rep):
                got = measure(tree, leaves, slots, options.rounds)
                ratios.setdefault((leaves, slots, name), []).append(got)
                shown = ", ".join(f"{v}: {r:.2f}x" for v, r in got.items())
                run = f"{leaves} leaves, {slots} slots, {name} (run {rep + 1})"
                print(f"{run}: {shown}", flush=True)
    print(f"\nMedian per-call time over {REFERENCE} (same process):")
    for (leaves, slots, name), runs in ratios.items():
        shown = ", ".join(f"{v}: {statistics.median(r[v] for r in runs):.2f}x" for v in runs[0])
        print(f"  {leaves} leaves, {slots} slots, {name} ({trees[name]}): {shown}")


if __name__ == "__main__":
    main()
