"""Scenario 8: reverse mode through a scan that reads a frozen cached factor.

`jax.grad` (with respect to `theta`) of `T` steps `h <- tanh(cho_solve(L, h * theta + x))`
where `L` is the Cholesky factor of a frozen `N x N` matrix (the module is not
differentiated). What the backward pass keeps is the question: JAX saves a residual once
when it is computed from loop constants, and once per step otherwise.

- unmemoized: the factor is computed in the body from the module closed over (JAX saves
  it once; XLA:CPU hoists the computation out of the loop);
- hand-written: the factor computed once before the loop and closed over (the floor);
- memox, `lax.scan`: the module is the carry and the body reads `memox.call(m, chol)`;
- `memox.scan`: the same body and carry, through `memox.scan`.

Reports `Compiled.memory_analysis().temp_size_in_bytes` of each compiled gradient (its
ratio to the unmemoized one, and in units of one factor, N x N x 4 bytes), the
gradient's wall time (interleaved, relative to hand-written), and for the memox
variants the factorisations counted by the slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from _common import Goal, interleaved, median, progress
from jax import lax

import memox
from memox import Memo


SIZES = {
    "full": dict(n=256, steps=(50, 200), rounds=7),
    "quick": dict(n=128, steps=(20,), rounds=2),
}

# The headline's goals (`_common.Goal`): memox.scan's. The module as a `lax.scan` carry
# is measured against the same goal to show why memox.scan exists.
GOALS = {
    "temp memory / unmemoized, memox, lax.scan": Goal(
        "<=",
        2,
        "the module as a lax.scan carry: reverse mode saves the cached factor once per step "
        "(a slot the loop fills is no loop constant to JAX); memox.scan, which fills it in a "
        "first step outside the loop, is the placement for this goal",
    ),
    "temp memory / unmemoized, memox.scan": Goal("<=", 2),
}
PLAIN, HAND, CARRIED, MSCAN = "unmemoized", "hand-written", "memox, lax.scan", "memox.scan"


class Model(eqx.Module):
    a: jax.Array  # (N, N), frozen
    chol_cache: Memo[jax.Array] = Memo()

    @memox.cached("chol_cache")
    def chol(self) -> jax.Array:
        return chol_of(self.a)


def chol_of(a: jax.Array) -> jax.Array:
    n = a.shape[0]
    return jnp.linalg.cholesky(a @ a.T / n + jnp.eye(n))


def step(L: jax.Array, theta: jax.Array, h: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(jsl.cho_solve((L, True), h * theta + x))


def losses() -> dict:
    """Each variant as `loss(theta, model, xs) -> (loss, factorisations)`."""

    def plain(theta, m, xs):
        h0 = jnp.zeros_like(theta)
        h, _ = lax.scan(lambda h, x: (step(chol_of(m.a), theta, h, x), None), h0, xs)
        return jnp.sum(h**2), jnp.int32(len(xs))

    def hand(theta, m, xs):
        L = chol_of(m.a)
        h, _ = lax.scan(lambda h, x: (step(L, theta, h, x), None), jnp.zeros_like(theta), xs)
        return jnp.sum(h**2), jnp.int32(1)

    def memoised(scan):
        def loss(theta, m, xs):
            def body(carry, x):
                m, h = carry
                L, m = memox.call(m, Model.chol)
                return (m, step(L, theta, h, x)), None

            (m, h), _ = scan(body, (m, jnp.zeros_like(theta)), xs)
            return jnp.sum(h**2), memox.stats(m)["chol_cache"].misses

        return loss

    return {PLAIN: plain, HAND: hand, CARRIED: memoised(lax.scan), MSCAN: memoised(memox.scan)}


def run(size: dict) -> dict:
    n, rounds = size["n"], size["rounds"]
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(n, n)), jnp.float32)
    theta = jnp.asarray(rng.normal(size=n), jnp.float32)
    model = memox.init(Model(a))
    rows = []
    for steps in size["steps"]:
        progress(f"s8 grad through a scan with a frozen factor: N={n}, T={steps}")
        xs = jnp.asarray(rng.normal(size=(steps, n)), jnp.float32)
        grads = {
            name: jax.jit(jax.value_and_grad(loss, has_aux=True))
            for name, loss in losses().items()
        }
        temp, out = {}, {}
        for name, g in grads.items():
            temp[name] = g.lower(theta, model, xs).compile().memory_analysis().temp_size_in_bytes
            out[name] = jax.block_until_ready(g(theta, model, xs))
        fns = {name: (lambda g=g: g(theta, model, xs)) for name, g in grads.items()}
        times = {name: median(ts) for name, ts in interleaved(fns, rounds).items()}
        ref = np.asarray(out[PLAIN][1])
        for name in grads:
            (_, computed), grad = out[name]
            err = float(np.max(np.abs(np.asarray(grad) - ref)))
            assert err < 1e-3 * max(1.0, float(np.max(np.abs(ref)))), (name, err)
            rows.append(
                {
                    "variant": f"{name}, T={steps}",
                    "temp [MiB]": temp[name] / 2**20,
                    "temp / unmemoized": temp[name] / temp[PLAIN],
                    "temp / factor size": temp[name] / (n * n * 4),
                    "factorisations": int(computed),
                    "grad wall [ms]": 1e3 * times[name],
                    "wall / hand": times[name] / times[HAND],
                    "max |grad - unmemoized|": err,
                }
            )
        progress(
            f"  s8 T={steps}: temp / unmemoized: lax.scan {temp[CARRIED] / temp[PLAIN]:.2f}, "
            f"memox.scan {temp[MSCAN] / temp[PLAIN]:.2f}; wall / hand: lax.scan "
            f"{times[CARRIED] / times[HAND]:.2f}, memox.scan {times[MSCAN] / times[HAND]:.2f}"
        )
    return {
        "id": "s8",
        "title": "Reverse mode through a scan reading a frozen cached factor",
        "sizes": size,
        "rows": rows,
        "metrics": {
            "temp_over_unmemoized": {r["variant"]: r["temp / unmemoized"] for r in rows},
            "wall_over_hand": {r["variant"]: r["wall / hand"] for r in rows},
        },
        "notes": [
            "temp = Compiled.memory_analysis().temp_size_in_bytes of the jitted "
            "value_and_grad; with lax.scan the cached factor is saved once per step.",
            "Unmemoized 'factorisations' is the number of steps that compute it in the "
            "program; XLA:CPU may hoist them.",
        ],
    }


def headline(result: dict) -> Iterator[tuple[str, str, Any]]:
    """This scenario's rows of the report's headline: (scenario, measure, value). `GOALS`
    name the measures they apply to."""
    m = result["metrics"]
    for variant, r in m["temp_over_unmemoized"].items():
        if variant.startswith("memox"):
            yield ("8 grad through scan", f"temp memory / unmemoized, {variant}", r)
    for variant, r in m["wall_over_hand"].items():
        if variant.startswith("memox"):
            yield ("8 grad through scan", f"grad wall / hand-written, {variant}", r)


if __name__ == "__main__":
    import _runner

    _runner.main(script=__file__)
