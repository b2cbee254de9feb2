"""Scenario 1: a training loop with a frozen expensive part (an eigenbasis).

The model of `examples/finetune_frozen_features.py`, imported from it (`SpectralNet`,
`CachedSpectralNet`, `graph_problem`): node features are the `k` lowest eigenvectors of a
frozen graph Laplacian (`eigh`, O(n^3)); an MLP head is trained on them with
`optax.adamw` in an `eqx.filter_jit` step (a filter spec freezes the Laplacian).

Variants, one jitted step per Python iteration (the jit boundary keeps XLA from hoisting
the eigh out of the loop):

- naive: the unmemoized model; every step recomputes the eigh;
- memox Exact: the standard user form, `memox.call` inside the user's `eqx.filter_jit`
  step (Exact policy). Each step fingerprints the frozen n x n Laplacian IN-GRAPH;
- memox Manual: the same with `policies.Manual()`: an O(1) check, no fingerprint;
- memox.jit step: the training step itself under `memox.jit` (Exact): the unchanged
  Laplacian is fingerprinted once per array object, outside the compiled step;
- hand-written: the optimum: the caller computes the eigenbasis once, before the loop
  (that time counts, in step 0), and a step that trains the head only takes it in;
- hand-written, model step: the same precomputed eigenbasis passed to the naive step's
  form (the step takes and returns the whole model, so XLA copies the frozen Laplacian
  into a fresh output buffer every step, as in the naive and memox.call steps).

XLA's own answer: the whole loop in ONE `lax.scan` (naive, memox Exact, hand-written):
XLA:CPU hoists the loop-invariant eigh out of the scan (FIELD-NOTES 5), XLA:GPU does not.
Scan variants report wall time only (their jaxpr FLOPs do not show what XLA hoisted).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
    Goal,
    TraceCounter,
    compile_row,
    first_call,
    flops_of,
    interleaved,
    matmul_peak,
    median,
    programs,
    progress,
    rate,
    timed,
)
from jax import lax
from jaxtyping import Array, Float

import memox
from examples import finetune_frozen_features as example
from examples.finetune_frozen_features import (
    CachedSpectralNet as ExactNet,  # Exact: memox's default policy
    SpectralNet,
)
from memox import Memo
from memox.policies import Manual


SIZES = {
    "full": dict(n=1024, k=32, width=64, depth=2, steps=200, scan_rounds=5),
    "quick": dict(n=256, k=16, width=32, depth=2, steps=20, scan_rounds=2),
    "gpu": dict(n=4096, k=64, width=64, depth=2, steps=200, scan_rounds=5),
}

# The headline's goals (`_common.Goal`), and why a measure misses its goal where it does.
_USERS_STEP = (
    "memox inside the user's own jitted step, which takes and returns the whole model: "
    "XLA copies the model's arrays every step (the row 'hand-written, model step' "
    "misses the goal by that copy alone)"
)
GOALS = {
    "FLOPs saved / bound": Goal(">=", 0.95),
    "loop wall / hand-written, memox Exact": Goal(
        "<=",
        1.05,
        f"{_USERS_STEP}, and the Exact check fingerprints the frozen n x n Laplacian "
        "in-graph every step; the memox.jit step, which fingerprints it once outside, is "
        "the placement for this goal",
    ),
    "loop wall / hand-written, memox Manual": Goal(
        "<=",
        1.05,
        f"{_USERS_STEP}; Manual skips the fingerprint but keeps the slot's cond and "
        "bookkeeping; the memox.jit step is the placement for this goal",
    ),
    "loop wall / hand-written, memox.jit step": Goal(
        "<=",
        1.05,
        "host-side work per call, not the program (the hand-written step's plus the slot's "
        "counters, the basis a parameter): memox.jit takes the call apart (flatten, layout, "
        "the slot's reference counts, deciding the hit), and the step combines the trained "
        "part with the returned module on the host; both weigh against a short step",
    ),
    "loop wall / hand-written, hand-written, model step": Goal(
        "<=",
        1.05,
        "not memox: the hand-written step in the form of a memox.call step (taking and "
        "returning the whole model, which XLA copies); the copy alone misses the goal, so "
        "no cache inside a step of that form can meet it",
    ),
}
LR, WEIGHT_DECAY = 3e-3, 1e-4
HAND = "hand-written"


class ManualNet(SpectralNet):
    basis_cache: Memo[Float[Array, "n k"]] = Memo()

    @memox.cached("basis_cache", policy=Manual())
    def eigenbasis(self) -> Float[Array, "n k"]:
        return SpectralNet.eigenbasis(self)


def predict_from(head: eqx.nn.MLP, basis: Float[Array, "n k"]) -> Float[Array, " n"]:
    """The hand-written variants' forward pass: `SpectralNet.predict` on a given basis."""
    return jax.vmap(head)(basis)[:, 0]


def graph_problem(n: int) -> tuple[Array, Array, Array]:
    """The example's graph, Laplacian, targets and mask, at ~20 neighbours a node."""
    return example.graph_problem(jax.random.key(0), n, math.sqrt(20 / (math.pi * n)))


def spec_of(model: SpectralNet) -> Any:
    """The filter spec: only the head's arrays are trained."""
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: m.head, spec, jax.tree.map(eqx.is_inexact_array, model.head))


@dataclasses.dataclass
class Variant:
    """A training loop: `state = step(state)`, from `initial()`. `jitted(*args)` is the
    compiled step (for FLOP counting and lowering) and `args(state)` its arguments."""

    initial: Callable[[], tuple]
    step: Callable[[tuple], tuple]
    jitted: Callable
    args: Callable[[tuple], tuple]


@dataclasses.dataclass
class Setup:
    size: dict
    plain: SpectralNet
    head: eqx.nn.MLP
    optim: optax.GradientTransformation
    traces: TraceCounter
    variants: dict[str, Variant]
    basis_fn: Callable  # the jitted eigenbasis of a model
    user_step: Callable  # (name, forward, spec) -> the standard jitted step
    head_step: Callable  # the hand-written step: (head, opt_state, basis)


def build(size: dict) -> Setup:
    n, k = size["n"], size["k"]
    laplacian, targets, mask = graph_problem(n)
    head = eqx.nn.MLP(k, 1, size["width"], size["depth"], jax.nn.gelu, key=jax.random.key(2))
    optim = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    traces = TraceCounter()

    def mse(pred: Array) -> Array:
        return jnp.sum(mask * (pred - targets) ** 2) / jnp.sum(mask)

    def user_step(name: str, forward: Callable, spec: Any) -> Callable:
        """The standard Equinox + optax step; `forward(model, *extra) -> (pred, model)`."""

        def loss_fn(diff, static, extra):
            pred, model = forward(eqx.combine(diff, static), *extra)
            return mse(pred), model

        @eqx.filter_jit
        def step(model, opt_state, *extra):
            traces.tick(name)
            diff, static = eqx.partition(model, spec)
            grad_fn = eqx.filter_value_and_grad(loss_fn, has_aux=True)
            (loss, model), grads = grad_fn(diff, static, extra)
            updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, spec))
            return eqx.apply_updates(model, updates), opt_state, loss

        return step

    def opt_init(model: Any) -> Any:
        return optim.init(eqx.filter(model, spec_of(model)))

    plain = SpectralNet(laplacian, head, k)
    variants = {}
    forwards = {
        "naive": (lambda: plain, lambda m: (m.predict(), m)),
        "memox Exact": (
            lambda: memox.init(ExactNet(laplacian, head, k)),
            lambda m: memox.call(m, ExactNet.predict),
        ),
        "memox Manual": (
            lambda: memox.init(ManualNet(laplacian, head, k)),
            lambda m: memox.call(m, ManualNet.predict),
        ),
    }
    for name, (make, forward) in forwards.items():
        jitted = user_step(name, forward, spec_of(make()))
        variants[name] = Variant(
            initial=lambda make=make: (make(), opt_init(make()), None),
            step=lambda s, f=jitted: f(s[0], s[1]),
            jitted=jitted,
            args=lambda s: s[:2],
        )

    # memox.jit: the training step is the memoised call; its result is the new trainable
    # part, and `memox.jit` returns the module with its slots updated.
    exact_spec = spec_of(ExactNet(laplacian, head, k))

    def jit_loss(diff, static):
        return mse(eqx.combine(diff, static).predict())

    def jit_train(model, opt_state):
        traces.tick("memox.jit step")
        diff, static = eqx.partition(model, exact_spec)
        loss, grads = eqx.filter_value_and_grad(jit_loss)(diff, static)
        updates, opt_state = optim.update(grads, opt_state, diff)
        return eqx.apply_updates(diff, updates), opt_state, loss

    memox_step = memox.jit(jit_train)

    def memox_jit_step(state):
        (diff, opt_state, loss), model = memox_step(state[0], state[1])
        return eqx.combine(diff, model), opt_state, loss

    def fresh_exact():
        model = memox.init(ExactNet(laplacian, head, k))
        return model, opt_init(model), None

    variants["memox.jit step"] = Variant(
        initial=fresh_exact,
        step=memox_jit_step,
        # For FLOP counting: the same step under `memox.call` (its check is in-graph;
        # `run` replaces it by Manual's, as memox.jit passes the fingerprint in).
        jitted=lambda m, o: memox.call(m, jit_train, o),
        args=lambda s: s[:2],
    )

    # Hand-written: the eigenbasis is computed once by the caller and passed in. State:
    # (trained part, optimizer state, loss, basis); the first step computes the basis.
    basis_fn = eqx.filter_jit(SpectralNet.eigenbasis)

    def head_loss(head, basis):
        return mse(predict_from(head, basis))

    @eqx.filter_jit
    def head_step(head, opt_state, basis):
        traces.tick(HAND)
        loss, grads = eqx.filter_value_and_grad(head_loss)(head, basis)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(head, eqx.is_array))
        return eqx.apply_updates(head, updates), opt_state, loss

    model_step = user_step(
        f"{HAND}, model step", lambda m, basis: (predict_from(m.head, basis), m), spec_of(plain)
    )

    def with_basis(step: Callable) -> Callable:
        def run(state):
            basis = basis_fn(plain) if len(state) == 3 else state[3]
            return (*step(state[0], state[1], basis), basis)

        return run

    head_opt = optim.init(eqx.filter(head, eqx.is_array))
    variants[HAND] = Variant(
        initial=lambda: (head, head_opt, None),
        step=with_basis(head_step),
        jitted=head_step,
        args=lambda s: (s[0], s[1], basis_fn(plain)),
    )
    variants[f"{HAND}, model step"] = Variant(
        initial=lambda: (plain, opt_init(plain), None),
        step=with_basis(model_step),
        jitted=model_step,
        args=lambda s: (s[0], s[1], basis_fn(plain)),
    )
    return Setup(size, plain, head, optim, traces, variants, basis_fn, user_step, head_step)


def scan_steps(step: Callable, model: Any, opt_state: Any, steps: int) -> tuple:
    """`steps` calls `model, opt_state, loss = step(model, opt_state)` in a `lax.scan`."""
    dynamic, static = eqx.partition(model, eqx.is_array)

    def body(carry, _):
        model, opt_state, loss = step(eqx.combine(carry[0], static), carry[1])
        return (eqx.filter(model, eqx.is_array), opt_state), loss

    (dynamic, opt_state), losses = lax.scan(body, (dynamic, opt_state), None, length=steps)
    return eqx.combine(dynamic, static), opt_state, losses


def scan_loops(setup: Setup) -> dict[str, Callable[[], Any]]:
    """The whole loop in one `lax.scan` (one jit call): XLA may hoist invariant work."""
    steps = setup.size["steps"]
    fns = {}
    for name in ("naive", "memox Exact"):
        variant = setup.variants[name]
        model, opt_state, _ = variant.initial()

        @eqx.filter_jit
        def loop(model, opt_state, one=variant.jitted):
            return scan_steps(one, model, opt_state, steps)

        fns[f"scan: {name}"] = lambda loop=loop, m=model, o=opt_state: loop(m, o)

    head, head_opt, _ = setup.variants[HAND].initial()

    @eqx.filter_jit
    def hand_loop(model, head, opt_state):
        basis = setup.basis_fn(model)
        return scan_steps(lambda h, o: setup.head_step(h, o, basis), head, opt_state, steps)

    fns[f"scan: {HAND}"] = lambda: hand_loop(setup.plain, head, head_opt)
    return fns


def run(size: dict) -> dict:
    setup = build(size)
    steps, n = size["steps"], size["n"]
    names = list(setup.variants)
    variants = setup.variants
    progress(f"s1 frozen eigenbasis: n={n}, k={size['k']}, {steps} adamw steps")

    # A plain eigh of the same matrix: the FLOP-count cross-check, and the work a first
    # call does beyond a steady call (every variant computes the eigh in its first call).
    eigh = jax.jit(lambda a: jnp.linalg.eigh(a)[1])
    jax.block_until_ready(eigh(setup.plain.laplacian))
    eigh_s = median(interleaved({"eigh": lambda: eigh(setup.plain.laplacian)}, 5)["eigh"])

    # Warm-up: compile every variant on a throwaway state. Four calls: memox.jit learns
    # which inputs are dependencies at its first call and fingerprints an unchanged one
    # outside the step from its third (compiling that fingerprint for its shape).
    compile_rows, early_calls = [], {}
    for name in names:
        state, probe = first_call(lambda: variants[name].step(variants[name].initial()))
        early = []
        for _ in range(3):
            state, dt = timed(lambda: variants[name].step(state))
            early.append(dt)
        early_calls[name] = [probe["first_call_s"], *early]
        work = early[-1] + (0.0 if name == "naive" else eigh_s)
        compile_rows.append(compile_row(f"s1 {name}", probe, work, 0))
        calls = ", ".join(f"{1e3 * t:.1f}" for t in early_calls[name])
        progress(f"  s1 warm-up {name}: calls 1-4 took {calls} ms")

    # The timed loops, interleaved step by step.
    states = {name: variants[name].initial() for name in names}
    times = {name: [] for name in names}
    misses = {name: [] for name in names if name.startswith("memox")}
    for i in range(steps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            states[name], dt = timed(lambda: variants[name].step(states[name]))
            times[name].append(dt)
        for name in misses:
            misses[name].append(memox.stats(states[name][0])["basis_cache"].misses)
        if (i + 1) % max(steps // 4, 1) == 0:
            progress(f"  s1 step {i + 1}/{steps}")
    traces = {name: setup.traces[name] for name in names}
    assert all(t <= programs(n) for n, t in traces.items()), f"a timed loop retraced: {traces}"
    for row in compile_rows:
        row["traces"] = traces[row["variant"][3:]]
    losses = {name: float(states[name][2]) for name in names}
    assert max(losses.values()) - min(losses.values()) <= 1e-4 * max(losses.values()), losses

    # FLOPs: memox's accounting (misses x FLOPs of one eigenbasis) plus the rest of each
    # step counted the same way, from its jaxpr.
    stats = memox.stats(states["memox Exact"][0])["basis_cache"]
    f_eig = stats.flops
    assert f_eig == flops_of(SpectralNet.eigenbasis, setup.plain)
    step_flops = {name: flops_of(v.jitted, *v.args(v.initial())) for name, v in variants.items()}
    rest = step_flops["naive"] - f_eig
    per_step = {}  # FLOPs executed at each step
    for name in names:
        if name == "naive":
            per_step[name] = np.full(steps, float(step_flops[name]))
        elif name.startswith(HAND):
            per_step[name] = np.full(steps, float(step_flops[name]))
            per_step[name][0] += f_eig
        else:
            other = name if name != "memox.jit step" else "memox Manual"
            new = np.diff(np.concatenate([[0], misses[name]]))
            per_step[name] = (step_flops[other] - f_eig) + new * float(f_eig)
    total = {name: float(per_step[name].sum()) for name in names}
    bound = total["naive"] - total[HAND]

    scan_fns = scan_loops(setup)
    for name, fn in scan_fns.items():
        _, probe = first_call(fn)
        progress(f"  s1 compiled {name}: first call {probe['first_call_s']:.2f} s")
    scan_times = {k: median(v) for k, v in interleaved(scan_fns, size["scan_rounds"]).items()}

    wall = {name: float(np.sum(times[name])) for name in names}
    med = {name: median(times[name]) for name in names}
    rows = []
    for name in names:
        runs = steps if name == "naive" else misses[name][-1] if name in misses else 1
        rows.append(
            {
                "variant": name,
                "eigh runs": int(runs),
                "FLOPs": total[name],
                "FLOPs saved / bound": (total["naive"] - total[name]) / bound,
                "loop wall [s]": wall[name],
                "median step [ms]": 1e3 * med[name],
                "loop wall / hand": wall[name] / wall[HAND],
                "median step / hand": med[name] / med[HAND],
                "GFLOP/s": rate(total[name], wall[name]) / 1e9,
                "of matmul peak": rate(total[name], wall[name]) / matmul_peak(),
            }
        )
    for name, t in scan_times.items():
        rows.append(
            {
                "variant": f"{name} (1 jit call)",
                "loop wall [s]": t,
                "median step [ms]": 1e3 * t / steps,
                "loop wall / hand": t / scan_times[f"scan: {HAND}"],
            }
        )
    naive_rate, eigh_rate = rate(total["naive"], wall["naive"]), rate(f_eig, eigh_s)
    hoisted = scan_times["scan: naive"] < 0.5 * steps * eigh_s
    copy_ms = 1e3 * (med[f"{HAND}, model step"] - med[HAND])
    return {
        "id": "s1",
        "title": "Training loop with a frozen eigenbasis (eqx.filter_jit + optax.adamw)",
        "sizes": size,
        "rows": rows,
        "metrics": {
            "flops_eigenbasis": f_eig,
            "flops_rest_of_step": rest,
            "flops_check_exact": step_flops["memox Exact"] - f_eig - rest,
            "flops_check_manual": step_flops["memox Manual"] - f_eig - rest,
            "saved_over_bound": {m: (total["naive"] - total[m]) / bound for m in names},
            "loop_wall_over_hand": {m: wall[m] / wall[HAND] for m in names},
            "median_step_over_hand": {m: med[m] / med[HAND] for m in names},
            "naive_loop_gflops": naive_rate / 1e9,
            "plain_eigh_gflops": eigh_rate / 1e9,
            "plain_eigh_s": eigh_s,
            "xla_hoisted_eigh_out_of_scan": bool(hoisted),
            "scan_loop_s": scan_times,
            "traces": traces,
            "memox_stats": {"hits": int(stats.hits), "misses": int(stats.misses)},
        },
        "notes": [
            f"FLOP cross-check: the naive loop runs at {naive_rate / 1e9:.1f} GFLOP/s by the "
            f"jaxpr count, a plain jitted eigh of the same Laplacian at "
            f"{eigh_rate / 1e9:.1f} GFLOP/s.",
            f"memox Exact fingerprints the frozen {n}x{n} Laplacian in-graph every step "
            f"({n * n} words, {1e3 * (med['memox Exact'] - med['memox Manual']):.2f} ms "
            "median over Manual); Manual does not look at it; memox.jit fingerprints it "
            "once per array object, outside the compiled step.",
            "The naive, memox.call and 'hand-written, model step' steps return the whole "
            "model, so XLA copies the frozen Laplacian every step "
            f"({copy_ms:.2f} ms: 'model step' minus 'hand-written' medians).",
            f"XLA hoisted the eigh out of the one-scan naive loop: {'yes' if hoisted else 'no'}"
            f" ({scan_times['scan: naive']:.2f} s for {steps} steps; one eigh takes "
            f"{eigh_s:.3f} s).",
        ],
        "compile": compile_rows,
        "early_calls_s": early_calls,
        "series": {
            "step_seconds": {m: [float(t) for t in times[m]] for m in names},
            "step_flops": {m: per_step[m].tolist() for m in names},
        },
    }


def headline(result: dict) -> Iterator[tuple[str, str, Any]]:
    """This scenario's rows of the report's headline: (scenario, measure, value). `GOALS`
    name the measures they apply to."""
    m = result["metrics"]
    for v in ("memox Exact", "memox Manual", "memox.jit step"):
        yield ("1 frozen eigh", f"FLOPs saved / bound, {v}", m["saved_over_bound"][v])
    for v in ("memox Exact", "memox Manual", "memox.jit step", "hand-written, model step"):
        yield ("1 frozen eigh", f"loop wall / hand-written, {v}", m["loop_wall_over_hand"][v])
    yield (
        "1 frozen eigh",
        "loop wall memox Manual / hand-written, model step",
        m["loop_wall_over_hand"]["memox Manual"]
        / m["loop_wall_over_hand"]["hand-written, model step"],
    )
    yield (
        "1 frozen eigh",
        "FLOP-count cross-check: naive loop / plain eigh [GFLOP/s]",
        f"{m['naive_loop_gflops']:.1f} / {m['plain_eigh_gflops']:.1f}",
    )
    yield (
        "1 frozen eigh",
        "loop wall naive / memox Exact",
        m["loop_wall_over_hand"]["naive"] / m["loop_wall_over_hand"]["memox Exact"],
    )
    scan = m["scan_loop_s"]
    yield (
        "1 frozen eigh",
        "one-scan loop: naive (XLA hoists) / hand-written",
        scan["scan: naive"] / scan["scan: hand-written"],
    )
    yield (
        "1 frozen eigh",
        "one-scan loop: memox Exact / hand-written",
        scan["scan: memox Exact"] / scan["scan: hand-written"],
    )


if __name__ == "__main__":
    import _runner

    _runner.main(script=__file__)
