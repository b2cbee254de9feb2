"""The first call at many slots against what a hand-written cache compiles to: s12's
chain of 200 leaves, `--slots` of its 100 layers cached.

    python benchmarks/first_call_floor.py [--slots 100] [--reps 3]

Variants, each its first call (trace, lower, XLA compile, run) in a fresh process:

- unmemoized: `eqx.filter_jit` of the forward pass, as s12's reference;
- hand-written cache, checked: each cached layer's normalised weight and a flag saying
  it is filled, as arrays passed in and returned; the forward pass reads each weight
  through a `lax.cond` on its flag. The least any reuse decided in the program compiles
  to: no key, no counters, no check of the weight;
- hand-written cache, decided outside: the caller knows the caches are empty and
  calls a program that computes and returns the weights, with no branch;
- memox.jit: its first call, and its trace and lowering (`lower`) and its XLA compile
  (`compile`) apart, lowered and compiled anew in the same process after the call.

The processes alternate, `--reps` times. Prints each variant's median first call and
its ratio to the unmemoized one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from compare_checkouts import in_turn, run_in


_ONE = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import equinox as eqx, jax, jax.numpy as jnp
from jax import lax
import memox
from s12_scaling import _normalised, chain

variant, slots = sys.argv[2], int(sys.argv[3])
x, model = jnp.ones(4), chain(200, slots)
weights = [layer.w for layer in model.layers]
biases = [layer.b for layer in model.layers]


def forward(weights, biases, x):
    for w, b in zip(weights, biases):
        x = jnp.tanh(w @ x + b)
    return x


def read(weights, caches):
    # What the forward pass reads: the cached layers' weights, then the others' own.
    return caches + weights[len(caches):]


if variant == "unmemoized":
    fn = eqx.filter_jit(lambda m, x: m.plain(x))
    call = lambda: fn(model, x)
elif variant == "hand-written cache, checked":
    caches = [jnp.zeros((4, 4)) for _ in range(slots)]
    filled = [jnp.array(False) for _ in range(slots)]

    @jax.jit
    def fn(weights, biases, caches, filled, x):
        new = [
            lax.cond(f, lambda c, w: c, lambda c, w: _normalised(w), c, w)
            for c, f, w in zip(caches, filled, weights)
        ]
        y = forward(read(weights, new), biases, x)
        return y, new, [jnp.array(True) for _ in new]

    call = lambda: fn(weights, biases, caches, filled, x)
elif variant == "hand-written cache, decided outside":

    @jax.jit
    def fn(weights, biases, x):
        new = [_normalised(w) for w in weights[:slots]]
        return forward(read(weights, new), biases, x), new

    call = lambda: fn(weights, biases, x)
else:
    fn = memox.jit(lambda m, x: m(x))
    call = lambda: fn(model, x)
start = time.perf_counter()
jax.block_until_ready(call())
out = {"first_call_s": time.perf_counter() - start}
if variant == "memox.jit":
    allocated = memox.init(model, lambda m, x: m(x), x)
    start = time.perf_counter()
    lowered = memox.jit(lambda m, x: m(x)).lower(allocated, x)
    out["lower_s"] = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    out["compile_s"] = time.perf_counter() - start
print("RESULT", json.dumps(out))
"""
VARIANTS = (
    "unmemoized",
    "hand-written cache, checked",
    "hand-written cache, decided outside",
    "memox.jit",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    options = parser.parse_args()
    here = Path(__file__).resolve().parent
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for rep in range(options.reps):
        for variant, _ in in_turn({v: here for v in VARIANTS}, rep):
            runs[variant].append(run_in(here, _ONE, variant, str(options.slots)))
        print(f"repetition {rep + 1} of {options.reps} done", file=sys.stderr, flush=True)
    reference = statistics.median(r["first_call_s"] for r in runs["unmemoized"])
    print(f"200 leaves, {options.slots} slots: first call, median of {options.reps} processes")
    print("| variant | first call [s] | / unmemoized |")
    print("|---|---|---|")
    for variant, got in runs.items():
        first = statistics.median(r["first_call_s"] for r in got)
        print(f"| {variant} | {first:.3f} | {first / reference:.2f} |")
    got = runs["memox.jit"]
    lower = statistics.median(r["lower_s"] for r in got)
    compiled = statistics.median(r["compile_s"] for r in got)
    print(
        f"memox.jit, lowered and compiled again: trace and lower {lower:.3f} s, "
        f"XLA compile {compiled:.3f} s"
    )


if __name__ == "__main__":
    main()
