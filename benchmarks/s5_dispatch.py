"""Scenario 5: per-call dispatch overhead, where dispatch dominates.

A small MLP (20 `Linear` layers of width 32: 40 parameter leaves) whose first layer uses
a cached derived weight (`W0 / |W0|`), called on one batch of 8 inputs. Then the same
with one frozen 64 MB parameter added (4096 x 4096 float32) that the derived weight
also depends on (`W0 / (|W0| (1 + mean(big)))`). Variants:

- memox.jit: `y, model = f(model, x)`, threading the returned model;
- filter_jit + memox.call: the user's own `eqx.filter_jit` returning `(y, model)`:
  in-graph fingerprint of W0 (and the 64 MB parameter), and XLA copies every returned
  array (FIELD-NOTES 1);
- filter_jit, unmemoized: `eqx.filter_jit` returning `y` only; recomputes the derived
  weight every call (for the large model: a pass over 64 MB);
- filter_jit returning the module: unmemoized, returns `(y, model)` (copies);
- hand-written: the derived weight computed once and passed in; returns `y`;
- jax.jit, flat arrays: `jax.jit` of the hand-written function of a flat list of arrays
  (no pytree flattening by Equinox): the floor of dispatch;
- nnx.jit graph / tree: a Flax NNX model with an `nnx.Cache` value and an `nnx.Cache`
  flag (a hand-managed cache: `lax.cond` on the flag; nothing checks staleness), under
  `nnx.jit` in graph mode (default) and tree mode (`graph=False`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import flops_of, interleaved, median, progress, timed
from flax import nnx
from jaxtyping import Array

import memox
from memox import Memo


SIZES = {
    "full": dict(width=32, depth=19, batch=8, big=(4096, 4096), rounds=(100, 12), block=5),
    "quick": dict(width=32, depth=19, batch=8, big=(4096, 4096), rounds=(30, 4), block=5),
}


class Plain(eqx.Module):
    mlp: eqx.nn.MLP
    big: Array | None

    def weight(self) -> Array:
        w = self.mlp.layers[0].weight
        scale = jnp.linalg.norm(w)
        if self.big is not None:
            scale = scale * (1 + jnp.mean(self.big))
        return w / scale

    def apply(self, x: Array, w: Array) -> Array:
        x = jax.nn.relu(x @ w.T + self.mlp.layers[0].bias)
        for layer in self.mlp.layers[1:]:
            x = jax.nn.relu(jax.vmap(layer)(x))
        return x

    def __call__(self, x: Array) -> Array:
        return self.apply(x, self.weight())


class Cached(Plain):
    weight_cache: Memo[Array] = Memo()

    @memox.cached("weight_cache")
    def weight(self) -> Array:
        return Plain.weight(self)


class NNXNet(nnx.Module):
    def __init__(self, width: int, depth: int, big: Array | None, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth + 1)])
        self.big = None if big is None else nnx.Param(big)
        self.weight = nnx.Cache(jnp.zeros((width, width)))
        self.valid = nnx.Cache(jnp.zeros((), jnp.bool_))

    def derived(self) -> Array:
        w = self.layers[0].kernel[...]
        scale = jnp.linalg.norm(w)
        if self.big is not None:
            scale = scale * (1 + jnp.mean(self.big[...]))
        return w / scale

    def __call__(self, x: Array) -> Array:
        w = jax.lax.cond(self.valid[...], lambda: self.weight[...], self.derived)
        self.weight[...] = w
        self.valid[...] = jnp.ones((), jnp.bool_)
        x = jax.nn.relu(x @ w + self.layers[0].bias[...])
        for layer in self.layers[1:]:
            x = jax.nn.relu(layer(x))
        return x


def variants(size: dict, big: Array | None) -> dict:
    width, depth = size["width"], size["depth"]
    mlp = eqx.nn.MLP(width, width, width, depth, key=jax.random.key(0))
    plain = Plain(mlp, big)
    x = jax.random.normal(jax.random.key(1), (size["batch"], width))
    state = {"memox.jit": memox.init(Cached(mlp, big)), "user": memox.init(Cached(mlp, big))}

    serve = memox.jit(Cached.__call__)
    user = eqx.filter_jit(lambda m, x: memox.call(m, Cached.__call__, x))
    unmemo = eqx.filter_jit(Plain.__call__)
    returns_module = eqx.filter_jit(lambda m, x: (m(x), m))
    hand = eqx.filter_jit(Plain.apply)
    w = eqx.filter_jit(Plain.weight)(plain)
    dynamic, static = eqx.partition(plain, eqx.is_array)
    flat, treedef = jax.tree.flatten(dynamic)

    @jax.jit
    def flat_fn(flat, x, w):
        return eqx.combine(jax.tree.unflatten(treedef, flat), static).apply(x, w)

    def threaded(key, fn):
        def call():
            y, state[key] = fn(state[key], x)
            return y

        return call

    fns = {
        "memox.jit": threaded("memox.jit", serve),
        "filter_jit + memox.call": threaded("user", user),
        "filter_jit, unmemoized": lambda: unmemo(plain, x),
        "filter_jit returning the module": lambda: returns_module(plain, x),
        "hand-written": lambda: hand(plain, x, w),
        "jax.jit, flat arrays": lambda: flat_fn(flat, x, w),
    }
    for graph in (True, False):
        net = NNXNet(width, depth, big, nnx.Rngs(0))
        f = nnx.jit(lambda m, x: m(x), graph=graph)
        fns[f"nnx.jit {'graph' if graph else 'tree'} mode, nnx.Cache"] = lambda f=f, net=net: f(
            net, x
        )
        state[f"nnx {graph}"] = net
    flops = {
        "memox.jit": flops_of(Plain.apply, plain, x, w),
        "filter_jit + memox.call": flops_of(user, state["user"], x)
        - flops_of(Plain.weight, plain),
        "filter_jit, unmemoized": flops_of(unmemo, plain, x),
        "filter_jit returning the module": flops_of(unmemo, plain, x),
        "hand-written": flops_of(Plain.apply, plain, x, w),
        "jax.jit, flat arrays": flops_of(Plain.apply, plain, x, w),
    }
    return fns, state, flops, len(jax.tree.leaves(eqx.filter(plain, eqx.is_array)))


def run(size: dict) -> dict:
    progress(
        f"s5 dispatch: MLP width {size['width']}, depth {size['depth']}, batch "
        f"{size['batch']}; then + a frozen {size['big']} float32 parameter"
    )
    rows, per_call = [], {}
    big_array = jax.random.normal(jax.random.key(2), size["big"])
    for label, big, rounds in (
        ("small", None, size["rounds"][0]),
        ("+64 MB", big_array, size["rounds"][1]),
    ):
        fns, state, flops, leaves = variants(size, big)
        for name, fn in fns.items():  # compile, and let memox.jit learn its dependencies
            for _ in range(4):
                timed(fn)
        # The caches hit: memox's counters, NNX's flag.
        for key in ("memox.jit", "user"):
            st = memox.stats(state[key])["weight_cache"]
            assert st.misses == 1 and st.hits >= 3, st
        assert all(bool(state[f"nnx {g}"].valid[...]) for g in (True, False))
        times = {name: median(ts) for name, ts in interleaved(fns, rounds, size["block"]).items()}
        per_call[label] = times
        for name, t in times.items():
            rows.append(
                {
                    "model": f"{label} ({leaves} leaves)",
                    "variant": name,
                    "median call [us]": 1e6 * t,
                    "call / memox.jit": t / times["memox.jit"],
                    "call / hand": t / times["hand-written"],
                    "FLOPs per call": flops.get(name),
                }
            )
        summary = ", ".join(f"{n} {1e6 * t:.0f}" for n, t in times.items())
        progress(f"  s5 {label}: median us per call: {summary}")
    return {
        "id": "s5",
        "title": "Dispatch overhead per call (small MLP; + one 64 MB frozen parameter)",
        "sizes": {**size, "big_bytes": int(big_array.nbytes)},
        "rows": rows,
        "metrics": {
            "median_call_us": {m: {n: 1e6 * t for n, t in d.items()} for m, d in per_call.items()}
        },
        "notes": [
            "Every variant is checked to hit (memox.stats; NNX's flag) before timing.",
            "The NNX cache is hand-managed (a flag and a value): it never checks whether "
            "the weights it was computed from changed.",
        ],
    }


def headline(result: dict) -> Iterator[tuple[str, str, Any]]:
    """This scenario's rows of the report's headline: (scenario, measure, value). `GOALS`
    name the measures they apply to."""
    for model, d in result["metrics"]["median_call_us"].items():
        for v in (
            "memox.jit",
            "hand-written",
            "filter_jit + memox.call",
            "nnx.jit graph mode, nnx.Cache",
            "nnx.jit tree mode, nnx.Cache",
        ):
            yield ("5 dispatch", f"{model}: {v} [us/call]", d[v])


if __name__ == "__main__":
    import _runner

    _runner.main(script=__file__)
