"""Scenario 13: scan over layers, memox against the same model unmemoized.

The model and idiom of docs/howto/scan-over-layers.md: `depth` layers of width `width`
built with `eqx.filter_vmap`, each dividing its frozen weight by its spectral norm (an
SVD), run in a `lax.scan`, and a head trained by `optax.sgd` on a batch of inputs. Each
training step is under `eqx.filter_jit`:

- memox: each layer has a `Memo` slot for its norm (Exact, the default policy),
  allocated with `eqx.filter_vmap(memox.init)`; the scan body calls the layer through
  `memox.call` and returns the updated layer as its output, and the step returns the
  layers with their slots;
- memox Manual: the same with `policies.Manual()`: no fingerprint of the weight;
- unmemoized: the same layers without slots, the scan over
  `eqx.filter(layers, eqx.is_array)`: an SVD per layer at every step;
- hand-written cache: each layer holds its norm and a flag saying it is filled, as
  arrays, and the scan body reads the norm with a `lax.cond` on the flag. No check of
  the weight: the least a cache whose reuse is decided in the program compiles to,
  the floor of memox's first call here.

At each depth:

- first call: wall time of the first step (trace, lower, XLA compile, run) and its XLA
  compile time. All variants are warmed up first on a smaller model of another width,
  so that no variant pays the process's first trace of the pieces they share (the SVD,
  optax); `eqx.filter_vmap(memox.init)` is timed apart;
- outputs: the first `steps` losses of each variant, from the same head, against the
  unmemoized ones, bit for bit;
- recomputation: `memox.stats` per layer after those steps, and the SVDs that really run
  (`jax.debug.callback`) in counting copies of the memox and unmemoized steps;
- per step: medians of interleaved steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import Goal, TraceCounter, first_call, interleaved, median, progress, timed
from jaxtyping import Array

import memox
from memox import Memo
from memox.policies import Manual


SIZES = {
    "full": dict(width=64, depths=(16, 64), batch=32, steps=5, rounds=100),
    "quick": dict(width=16, depths=(16, 64), batch=8, steps=5, rounds=10),
}
REFERENCE = "unmemoized"
HAND = "hand-written cache"
GOALS = {
    "first call memox / unmemoized": Goal(
        "<=",
        1.3,
        "XLA compile time (the rows' XLA compile column): the memox step's scanned layer holds "
        "the slot's conditional, with the SVD in one branch, its store and, under Exact, the "
        "fingerprint of the layer's weight; the unmemoized layer holds the SVD alone. The "
        "'memox Manual' rows, without the fingerprint, show the fingerprint's part; the "
        "'hand-written cache' rows, a cond on a flag and no check at all, the floor of any "
        "reuse decided in the program",
    ),
    "SVDs after the first step, memox": Goal("<=", 0),
}
SVDS: list[int] = []  # one entry per SVD that really runs in a counting step


class Layer(eqx.Module):
    w: Array
    b: Array
    counted: bool = eqx.field(static=True, default=False)

    def norm(self) -> Array:
        if self.counted:
            jax.debug.callback(lambda: SVDS.append(1))
        return jnp.linalg.svd(self.w, compute_uv=False)[0]

    def __call__(self, x: Array) -> Array:
        return jnp.tanh(self.w @ x / self.norm() + self.b[:, None])


class CachedLayer(Layer):
    norm_cache: Memo[Array] = Memo()

    @memox.cached("norm_cache")
    def norm(self) -> Array:
        return Layer.norm(self)


class ManualLayer(Layer):
    norm_cache: Memo[Array] = Memo()

    @memox.cached("norm_cache", policy=Manual())
    def norm(self) -> Array:
        return Layer.norm(self)


class FlaggedLayer(Layer):
    """The hand-written cache: the norm and whether it is filled, as arrays."""

    cached_norm: Array | None = None
    filled: Array | None = None


def hand_forward(layers: FlaggedLayer, x: Array) -> tuple[Array, FlaggedLayer]:
    """The hand-written cache: the output, and the layers with their norms filled."""
    arrays, static = eqx.partition(layers, eqx.is_array)

    def body(x, layer):
        layer = eqx.combine(layer, static)
        norm = jax.lax.cond(layer.filled, lambda: layer.cached_norm, lambda: layer.norm())
        layer = eqx.tree_at(lambda m: (m.cached_norm, m.filled), layer, (norm, jnp.array(True)))
        x = jnp.tanh(layer.w @ x / norm + layer.b[:, None])
        return x, eqx.filter(layer, eqx.is_array)

    x, arrays = jax.lax.scan(body, x, arrays)
    return x, eqx.combine(arrays, static)


def forward(layers: Layer, x: Array) -> tuple[Array, Layer]:
    """memox: the output, and the layers with their slots updated."""
    arrays, static = eqx.partition(layers, eqx.is_array)

    def body(x, layer):
        layer = eqx.combine(layer, static)
        x, layer = memox.call(layer, lambda layer: layer(x))
        return x, eqx.filter(layer, eqx.is_array)

    x, arrays = jax.lax.scan(body, x, arrays)
    return x, eqx.combine(arrays, static)


def plain_forward(layers: Layer, x: Array) -> tuple[Array, Layer]:
    """Unmemoized: the output, and the layers unchanged."""
    arrays, static = eqx.partition(layers, eqx.is_array)

    def body(x, layer):
        return eqx.combine(layer, static)(x), None

    x, _ = jax.lax.scan(body, x, arrays)
    return x, layers


def make_step(forward_fn, optim, traces: TraceCounter, name: str):
    """A training step of the head: `(head, layers, opt_state, x, y) -> (head, layers,
    opt_state, loss)`, counting its traces under `name`."""

    @eqx.filter_jit
    def step(head, layers, opt_state, x, y):
        traces.tick(name)

        def loss(head):
            out, new_layers = forward_fn(layers, x)
            return jnp.mean((head @ out - y) ** 2), new_layers

        (value, layers), grad = jax.value_and_grad(loss, has_aux=True)(head)
        updates, opt_state = optim.update(grad, opt_state)
        return optax.apply_updates(head, updates), layers, opt_state, value

    return step


class Model:
    """One depth's layers, data and steps: `fresh(name)` is a variant's starting state."""

    def __init__(self, width: int, depth: int, batch: int, traces: TraceCounter):
        keys = jax.random.split(jax.random.key(depth), 3)
        w, b = eqx.filter_vmap(lambda k: (jax.random.normal(k, (width, width)), jnp.zeros(width)))(
            jax.random.split(keys[0], depth)
        )
        self.w, self.b = w, b
        self.x = jax.random.normal(keys[1], (width, batch))
        self.y = jax.random.normal(keys[2], (batch,))
        self.head = jnp.ones(width) / width
        self.optim = optax.sgd(1e-2)
        self.traces = traces
        self.tag = f"{depth}x{width}"

    def layers(self, cls: type[Layer], counted: bool = False) -> Layer:
        if cls is FlaggedLayer:
            empty = (jnp.zeros(()), jnp.array(False))
            return eqx.filter_vmap(lambda w, b: FlaggedLayer(w, b, counted, *empty))(
                self.w, self.b
            )
        return eqx.filter_vmap(lambda w, b: cls(w, b, counted))(self.w, self.b)

    def step(self, name: str, counted: bool = False):
        fn = {REFERENCE: plain_forward, HAND: hand_forward}.get(name, forward)
        return make_step(fn, self.optim, self.traces, f"{name} {self.tag} {counted}")


LAYERS = {
    "memox": CachedLayer,
    "memox Manual": ManualLayer,
    REFERENCE: Layer,
    HAND: FlaggedLayer,
}
MEMOX = ("memox", "memox Manual")
ALLOCATE = eqx.filter_vmap(memox.init)
ALLOCATING = "eqx.filter_vmap(memox.init)"


def initial(model: Model, name: str, counted: bool = False) -> list:
    """A variant's state `[head, layers, opt_state]`: memox's slots allocated."""
    layers = model.layers(LAYERS[name], counted)
    if name in MEMOX:
        layers = ALLOCATE(layers)
    return [model.head, layers, model.optim.init(model.head)]


def warm_up(size: dict) -> None:
    """Every variant's first step on a small model of another width (see the docstring)."""
    model = Model(size["width"] // 2, 2, size["batch"], TraceCounter())
    for name in LAYERS:
        jax.block_until_ready(model.step(name)(*initial(model, name), model.x, model.y))


def at_depth(size: dict, depth: int) -> dict:
    traces = TraceCounter()
    model = Model(size["width"], depth, size["batch"], traces)
    states: dict[str, list] = {}
    first: dict[str, dict] = {}
    losses: dict[str, list] = {}
    calls = {}
    bare = model.layers(CachedLayer)
    _, first[ALLOCATING] = first_call(lambda: ALLOCATE(bare))
    init_again = median([timed(lambda: ALLOCATE(bare))[1] for _ in range(5)])
    for name in LAYERS:
        states[name] = initial(model, name)

        def call(name=name, step=model.step(name)):
            head, layers, opt_state, value = step(*states[name], model.x, model.y)
            states[name] = [head, layers, opt_state]
            return value

        out, first[name] = first_call(call)
        losses[name] = [out] + [timed(call)[0] for _ in range(size["steps"] - 1)]
        calls[name] = call
    per_layer = {}
    for name in MEMOX:
        st = memox.stats(states[name][1])["norm_cache"]
        per_layer[name] = {"hits": st.hits.tolist(), "misses": st.misses.tolist()}
        assert per_layer[name]["misses"] == [1] * depth, per_layer[name]
        assert per_layer[name]["hits"] == [size["steps"] - 1] * depth, per_layer[name]
    ref = np.asarray(losses[REFERENCE])
    differences = {
        name: float(np.max(np.abs(np.asarray(ls) - ref))) for name, ls in losses.items()
    }
    svds = {}
    for name in ("memox", REFERENCE, HAND):
        step, state = model.step(name, counted=True), initial(model, name, counted=True)
        counts = []
        for _ in range(size["steps"]):
            SVDS.clear()
            head, layers, opt_state, _ = jax.block_until_ready(step(*state, model.x, model.y))
            jax.effects_barrier()
            state = [head, layers, opt_state]
            counts.append(len(SVDS))
        svds[name] = counts
    times = {n: median(ts) for n, ts in interleaved(calls, size["rounds"]).items()}
    for name in LAYERS:  # the timed loop never retraced its step
        assert traces[f"{name} {model.tag} False"] == 1, (name, traces.counts)
    return {
        "first_call_s": {n: f["first_call_s"] for n, f in first.items()},
        "xla_compile_s": {n: f["compile_s"] for n, f in first.items()},
        "memox_init_again_s": init_again,
        "step_ms": {n: 1e3 * t for n, t in times.items()},
        "svds_per_step": svds,
        "stats_per_layer": per_layer,
        "loss_max_abs_difference": differences,
    }


def run(size: dict) -> dict:
    progress(
        f"s13 scan over layers: width {size['width']}, depths {size['depths']}, batch "
        f"{size['batch']}, {size['steps']} steps checked, {size['rounds']} timed rounds"
    )
    warm_up(size)
    by_depth, rows = {}, []
    for depth in size["depths"]:
        m = by_depth[str(depth)] = at_depth(size, depth)
        first, ms = m["first_call_s"], m["step_ms"]
        for name in LAYERS:
            rows.append(
                {
                    "layers": depth,
                    "variant": name,
                    "first call [s]": first[name],
                    "XLA compile [s]": m["xla_compile_s"][name],
                    "first call / unmemoized": first[name] / first[REFERENCE],
                    "median step [ms]": ms[name],
                    "step / unmemoized": ms[name] / ms[REFERENCE],
                    "SVDs per step": " ".join(map(str, m["svds_per_step"].get(name, []))),
                    "loss max abs difference": m["loss_max_abs_difference"][name],
                }
            )
        rows.append(
            {
                "layers": depth,
                "variant": ALLOCATING,
                "first call [s]": first[ALLOCATING],
                "XLA compile [s]": m["xla_compile_s"][ALLOCATING],
            }
        )
        progress(
            f"  s13 {depth} layers: first call "
            + ", ".join(f"{n} {t:.2f} s" for n, t in first.items())
            + "; ms per step "
            + ", ".join(f"{n} {t:.2f}" for n, t in ms.items())
        )
    return {
        "id": "s13",
        "title": "Scan over layers: a cached spectral norm per stacked layer",
        "sizes": size,
        "rows": rows,
        "metrics": by_depth,
        "notes": [
            "Per-layer memox.stats after the checked steps: 1 miss and steps - 1 hits in "
            "every layer, for both memox variants (asserted).",
            "SVDs per step: real executions in counting copies of the steps "
            "(jax.debug.callback in the layer's norm).",
            "Losses are compared with the unmemoized step's over the checked steps, from the "
            "same head: 0 is bit for bit.",
            f"The {ALLOCATING} row is its first call on the stacked layers (memox's "
            "slots); memox_init_again_s in the metrics is the median of its next 5 calls.",
            "Every timed step was traced once (asserted).",
        ],
    }


def headline(result: dict) -> Iterator[tuple[str, str, Any]]:
    """This scenario's rows of the report's headline: (scenario, measure, value). `GOALS`
    name the measures they apply to."""
    for depth, m in result["metrics"].items():
        first, ms = m["first_call_s"], m["step_ms"]
        where = f"{depth} layers"
        yield (
            "13 scan over layers",
            f"first call memox / unmemoized, {where}",
            first["memox"] / first[REFERENCE],
        )
        yield (
            "13 scan over layers",
            f"first call hand-written cache / unmemoized, {where}",
            first[HAND] / first[REFERENCE],
        )
        yield (
            "13 scan over layers",
            f"step memox / unmemoized, {where}",
            ms["memox"] / ms[REFERENCE],
        )
        yield (
            "13 scan over layers",
            f"SVDs after the first step, memox, {where}",
            sum(m["svds_per_step"]["memox"][1:]),
        )
        yield (
            "13 scan over layers",
            f"loss max abs difference memox / unmemoized, {where}",
            m["loss_max_abs_difference"]["memox"],
        )


if __name__ == "__main__":
    import _runner

    _runner.main(script=__file__)
