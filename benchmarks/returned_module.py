"""A `memox.jit` step that returns a module with non-array leaves, for two checkouts of
memox, side by side, over `eqx.filter_jit` of the unmemoized step.

    git worktree add /tmp/before <commit>
    python benchmarks/returned_module.py /tmp/before . [--reps 4] [--rounds 2000]

The step returns its output and an `eqx.nn.MLP`, whose activation functions are leaves
that are not arrays: the wrapper must put the result back together around them. The
cached method is the norm of the first layer's weight. Each checkout measures in a fresh
process, the two alternating, which runs first swapped at each repetition; each process
interleaves `--rounds` calls of both steps and reports the ratio of their medians.
"""

from __future__ import annotations

import statistics

from compare_checkouts import arguments, in_turn, run_in


# Run in each checkout's own process: its memox.
_ONE = """
import json, sys, time
tree, rounds = sys.argv[1], int(sys.argv[2])
sys.path[:0] = [tree]
import equinox as eqx, jax, jax.numpy as jnp
import memox
assert memox.__file__.startswith(tree), memox.__file__

class Model(eqx.Module):
    mlp: eqx.nn.MLP
    cache: memox.Memo[jax.Array] = memox.Memo()

    @memox.cached("cache")
    def scale(self):
        return jnp.linalg.norm(self.mlp.layers[0].weight)

def step(m, x):
    return m.mlp(x) / m.scale(), m.mlp

def plain(m, x):
    return m.mlp(x) / jnp.linalg.norm(m.mlp.layers[0].weight), m.mlp

x = jnp.ones(4)
model = Model(eqx.nn.MLP(4, 4, 8, 4, key=jax.random.key(0)))
memox_step, reference = memox.jit(step), eqx.filter_jit(plain)
state = {"model": memox.init(model)}

def threaded():
    (y, _), state["model"] = memox_step(state["model"], x)
    return y

fns = {"memox.jit": threaded, "eqx.filter_jit": lambda: reference(model, x)[0]}
for fn in fns.values():
    for _ in range(10):
        jax.block_until_ready(fn())
times = {name: [] for name in fns}
for _ in range(rounds):
    for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times[name].append(time.perf_counter() - start)
median = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
ratio = median["memox.jit"] / median["eqx.filter_jit"]
print("RESULT", json.dumps([ratio, 1e6 * median["memox.jit"]]))
"""


def main() -> None:
    options = arguments(__doc__, reps=4, rounds=2000)
    trees = {"before": options.before.resolve(), "after": options.after.resolve()}
    ratios: dict[str, list[float]] = {name: [] for name in trees}
    for rep in range(options.reps):
        for name, tree in in_turn(trees, rep):
            ratio, us = run_in(tree, _ONE, str(options.rounds))
            ratios[name].append(ratio)
            print(f"{name} (run {rep + 1}): {ratio:.3f}x eqx.filter_jit ({us:.0f} µs)", flush=True)
    print("\nMedian per-call time over eqx.filter_jit (same process):")
    for name, runs in ratios.items():
        print(f"  {name} ({trees[name]}): {statistics.median(runs):.3f}x")


if __name__ == "__main__":
    main()
