"""Scenario 4: a dependency that changes every k steps inside one `lax.scan`.

A kernel solver: the cached value is the Cholesky factor of `K(Z, Z) + s^2 I` for `n`
points `Z`; each scan step solves against a new right-hand side (two triangular solves,
O(n^2)). Every `k` steps (at t = 0, k, 2k, ...) the points move, so the factor must be
recomputed `ceil(T / k)` times. The change is data-dependent inside the scan carry, so
XLA cannot hoist the factorisation out of the loop (unlike scenario 1's scan).

- naive: factorise at every step;
- memox: `memox.call(model, Solver.solve, b)` in the scan body, the model (slots
  allocated by `memox.init`) as the carry; Exact policy: the check fingerprints Z and
  the hyperparameters (n x d + 2 words) in-graph every step;
- hand-written: the factor is carried in the scan state and recomputed under
  `lax.cond` exactly when the points moved;
- hand-written, blocked: knowing the schedule statically, an outer scan over the T/k
  blocks factorises once per block and an inner scan solves with the (loop-invariant)
  factor. The floor: no cond and no carried factor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from _common import (
    TraceCounter,
    first_call,
    flops_of,
    interleaved,
    median,
    programs,
    progress,
    rate,
)
from jax import lax
from jaxtyping import Array, Float

import memox
from memox import Memo


SIZES = {
    "full": dict(n=1024, dim=2, steps=200, ks=(1, 10, 100), rounds=5),
    "quick": dict(n=256, dim=2, steps=40, ks=(1, 10, 100), rounds=2),
}
HAND = "hand-written"
BLOCKED = "hand-written, blocked"


class Points(eqx.Module):
    """The unmemoized model: points and kernel hyperparameters."""

    Z: Float[Array, "n d"]
    log_lengthscale: Float[Array, ""]
    log_noise_var: Float[Array, ""]

    def gram(self) -> Float[Array, "n n"]:
        d2 = jnp.sum((self.Z[:, None, :] - self.Z[None, :, :]) ** 2, axis=-1)
        K = jnp.exp(-0.5 * d2 / jnp.exp(2 * self.log_lengthscale))
        return K + jnp.exp(self.log_noise_var) * jnp.eye(self.Z.shape[0])


class Solver(Points):
    factor_cache: Memo[Float[Array, "n n"]] = Memo()

    @memox.cached("factor_cache")
    def factor(self) -> Float[Array, "n n"]:
        return jnp.linalg.cholesky(self.gram())

    def solve(self, b: Float[Array, " n"]) -> Float[Array, " n"]:
        return solve_with(self.factor(), b)


def solve_with(L: Array, b: Array) -> Array:
    return jsl.cho_solve((L, True), b)


def moved(solver: Points, t: Array, k: int, step: Array) -> tuple[Points, Array]:
    """The solver at step `t`: its points move by `step` when `t % k == 0`."""
    change = t % k == 0
    Z = jnp.where(change, solver.Z + step, solver.Z)
    return eqx.tree_at(lambda s: s.Z, solver, Z), change


def loops(k: int, traces: TraceCounter):
    """The three scans over `(t, step, b)` for this `k`; each returns (outputs, count)."""

    def naive(solver, xs):
        traces.tick(f"naive k={k}")

        def body(solver, x):
            solver, _ = moved(solver, x[0], k, x[1])
            return solver, solve_with(jnp.linalg.cholesky(solver.gram()), x[2])

        return lax.scan(body, solver, xs)[1], jnp.arange(1, len(xs[0]) + 1)

    def memo(solver, xs):
        traces.tick(f"memox k={k}")

        def body(solver, x):
            solver, _ = moved(solver, x[0], k, x[1])
            out, solver = memox.call(solver, Solver.solve, x[2])
            return solver, (out, memox.stats(solver)["factor_cache"].misses)

        solver, (outs, misses) = lax.scan(body, solver, xs)
        return outs, misses

    def hand(solver, xs):
        traces.tick(f"{HAND} k={k}")
        L0 = jnp.zeros((solver.Z.shape[0],) * 2)

        def body(carry, x):
            solver, L, count = carry
            solver, change = moved(solver, x[0], k, x[1])
            L = lax.cond(change, lambda: jnp.linalg.cholesky(solver.gram()), lambda: L)
            count = count + change.astype(jnp.int32)
            return (solver, L, count), (solve_with(L, x[2]), count)

        (_, _, count), (outs, counts) = lax.scan(body, (solver, L0, jnp.zeros((), jnp.int32)), xs)
        return outs, counts

    def blocked(solver, xs):
        traces.tick(f"{BLOCKED} k={k}")
        steps = len(xs[0])
        block = min(k, steps)
        assert steps % block == 0, "T must be a multiple of k (or k >= T)"
        xs = jax.tree.map(lambda a: a.reshape(steps // block, block, *a.shape[1:]), xs)

        def outer(solver, x):
            solver, _ = moved(solver, x[0][0], k, x[1][0])
            L = jnp.linalg.cholesky(solver.gram())  # loop-invariant in the inner scan
            return solver, lax.scan(lambda c, b: (c, solve_with(L, b)), None, x[2])[1]

        outs = lax.scan(outer, solver, xs)[1]
        n_blocks = steps // block
        counts = jnp.repeat(jnp.arange(1, n_blocks + 1), block)
        return outs.reshape(steps, -1), counts

    return {
        "naive": eqx.filter_jit(naive),
        "memox": eqx.filter_jit(memo),
        HAND: eqx.filter_jit(hand),
        BLOCKED: eqx.filter_jit(blocked),
    }


def run(size: dict) -> dict:
    n, steps = size["n"], size["steps"]
    progress(f"s4 dependency changing every k steps: n={n}, T={steps}, k={size['ks']}")
    kz, kb, ks = jax.random.split(jax.random.key(0), 3)
    Z = jax.random.uniform(kz, (n, size["dim"]), minval=-3.0, maxval=3.0)
    points = Points(Z, jnp.asarray(0.0), jnp.log(jnp.asarray(0.1)))
    solver = Solver(points.Z, points.log_lengthscale, points.log_noise_var)
    xs = (
        jnp.arange(steps),
        0.01 * jax.random.normal(ks, (steps, n, size["dim"])),
        jax.random.normal(kb, (steps, n)),
    )
    traces = TraceCounter()
    f_factor = flops_of(Solver.factor, solver)
    rows, series, compile_rows = [], {}, []
    for k in size["ks"]:
        fns_ = loops(k, traces)
        inits = {"naive": points, "memox": memox.init(solver), HAND: points, BLOCKED: points}
        fns = {name: (lambda f=f, s=inits[name]: f(s, xs)) for name, f in fns_.items()}
        outs = {}
        for name, fn in fns.items():
            outs[name], probe = first_call(fn)
            compile_rows.append({"variant": f"s4 {name} k={k}", **probe})
        times = {name: median(ts) for name, ts in interleaved(fns, size["rounds"]).items()}
        retraced = {
            t: c for t, c in traces.counts.items() if t.endswith(f" k={k}") and c > programs(t)
        }
        assert not retraced, f"a timed loop retraced: {retraced}"
        expected = math.ceil(steps / k)
        counts = {name: np.asarray(outs[name][1]) for name in fns}
        computed = {name: int(counts[name][-1]) for name in fns}
        assert computed["naive"] == steps, computed
        assert computed["memox"] == computed[HAND] == computed[BLOCKED] == expected, computed
        err = float(jnp.max(jnp.abs(outs["memox"][0] - outs["naive"][0])))
        # FLOPs: memox's accounting (misses x FLOPs of one factor) plus the rest of a step
        # counted from the scan body's jaxpr (for memox, the in-graph check included).
        step_flops = {
            name: flops_of(fns_[name], inits[name], jax.tree.map(lambda a: a[:1], xs))
            for name in fns
        }
        per_step = {}
        for name in fns:
            new = np.diff(np.concatenate([[0], counts[name]]))
            per_step[name] = (step_flops[name] - f_factor + new * f_factor).astype(np.float64)
        total = {name: float(per_step[name].sum()) for name in fns}
        series[f"k={k}"] = {name: per_step[name].tolist() for name in fns}
        for name in fns:
            rows.append(
                {
                    "variant": f"{name}, k={k}",
                    "factorisations": computed[name],
                    "ceil(T/k)": expected,
                    "FLOPs": total[name],
                    "FLOPs / hand": total[name] / total[HAND],
                    "scan wall [ms]": 1e3 * times[name],
                    "per step [ms]": 1e3 * times[name] / steps,
                    "wall / hand": times[name] / times[HAND],
                    "wall / naive": times[name] / times["naive"],
                    "GFLOP/s": rate(total[name], times[name]) / 1e9,
                }
            )
        progress(
            f"  s4 k={k}: factorisations naive {steps}, memox {computed['memox']}, hand "
            f"{computed[HAND]}; wall memox/hand {times['memox'] / times[HAND]:.2f}, "
            f"naive/memox {times['naive'] / times['memox']:.1f}"
        )
        assert err < 1e-2, err
    return {
        "id": "s4",
        "title": "A dependency changing every k steps inside one lax.scan",
        "sizes": size,
        "rows": rows,
        "metrics": {
            "flops_factor": f_factor,
            "wall_over_hand": {r["variant"]: r["wall / hand"] for r in rows},
            "flops_over_hand": {r["variant"]: r["FLOPs / hand"] for r in rows},
        },
        "notes": [
            "memox's and the hand-written loop's factorisation counts are read from the "
            "scan outputs (memox.stats inside the body; the hand-written counter) and "
            "equal ceil(T/k).",
            f"memox's in-graph check hashes Z and two scalars ({n * size['dim'] + 2} words) "
            "per step.",
        ],
        "compile": compile_rows,
        "series": {"step_flops": series},
    }


def headline(result: dict) -> Iterator[tuple[str, str, Any]]:
    """This scenario's rows of the report's headline: (scenario, measure, value). `GOALS`
    name the measures they apply to."""
    for r in result["rows"]:
        if r["variant"].startswith("memox"):
            k = r["variant"].split("k=")[1]
            yield (
                "4 change every k",
                f"k={k}: factorisations (ceil(T/k))",
                f"{r['factorisations']} ({r['ceil(T/k)']})",
            )
            yield ("4 change every k", f"k={k}: FLOPs memox / hand-written", r["FLOPs / hand"])
            yield ("4 change every k", f"k={k}: wall memox / hand-written", r["wall / hand"])
            yield ("4 change every k", f"k={k}: wall memox / naive", r["wall / naive"])


if __name__ == "__main__":
    import _runner

    _runner.main(script=__file__)
