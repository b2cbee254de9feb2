"""Training a neural ODE with optax: its expensive weight transform runs once per solve.

The vector field is `dy/dt = V tanh(Q y + b)` on a batch of states, where
`Q = expm(W - Wᵀ)` is an orthogonal matrix parameterised by an unconstrained square `W`
(the exponential of a skew-symmetric matrix: O(n³), here ~20 times the FLOPs of one
evaluation of the field). `W`, `b` and `V` are trained with `optax.adam` to reproduce
the trajectories of a teacher field. The loss is the mean squared error of
`diffrax.diffeqsolve(..., diffrax.Tsit5(), ..., saveat=SaveAt(ts=...))`, differentiated
by `eqx.filter_value_and_grad` through diffrax's default adjoint (recursive
checkpointing). `Q` depends on trained parameters, so it changes at every training
step. Three training steps, each an `eqx.filter_jit`, on the same data:

- naive: `Q` computed inside the vector field, as one writes it first: at every
  evaluation (Tsit5: 6 per step), and again where the backward pass recomputes them;
- hand-hoisted: the loss computes `Q` once and passes it to the solve as `args`: what a
  careful diffrax user writes by hand;
- memox: `rotation` is a `@memox.cached` method; the loss solves with
  `diffrax.ODETerm(memox.hoist(model))` inside `memox.call` and returns the updated
  model as `has_aux`.

Every number printed is measured: executions of `expm` by a `jax.debug.callback` inside
`rotation` (it runs once per real execution), in programs of their own (the models built
with `counted=True`), since a callback at every evaluation would slow the naive loop;
wall time per training step as the median over steps of the three variants taken in
turn, in programs without callbacks, compiled before, each step ending in
`jax.block_until_ready`. `python -m benchmarks --only s11` imports this model.
"""

import collections
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

import memox
from memox import Memo


N_STATE, BATCH, ODE_STEPS, SAVES = 64, 32, 20, 11  # 20 Tsit5 steps on [0, 1]
TRAIN_STEPS, COUNT_STEPS, LR = 40, 3, 1e-2
COUNTS = collections.Counter()  # "expm": real executions of the transform


class VectorField(eqx.Module):
    """Plain Equinox: `dy/dt = V tanh(Q y + b)` with `Q = expm(W - Wᵀ)`, for a batch `y`."""

    w: Float[Array, "n n"]
    b: Float[Array, " n"]
    v: Float[Array, "n n"]
    counted: bool = eqx.field(static=True, default=False)  # count executions of `expm`

    def rotation(self) -> Float[Array, "n n"]:
        if self.counted:
            jax.debug.callback(lambda: COUNTS.update(["expm"]))  # per execution
        return jax.scipy.linalg.expm(self.w - self.w.T)

    def field(self, q: Float[Array, "n n"], y: Float[Array, "batch n"]) -> Float[Array, "batch n"]:
        return jnp.tanh(y @ q.T + self.b) @ self.v.T

    def __call__(self, t: Any, y: Float[Array, "batch n"], args: Any) -> Float[Array, "batch n"]:
        return self.field(self.rotation(), y)


class CachedVectorField(VectorField):
    """The same field with memox: one slot, one decorator."""

    rotation_cache: Memo[Float[Array, "n n"]] = Memo()

    @memox.cached("rotation_cache")
    def rotation(self) -> Float[Array, "n n"]:
        return VectorField.rotation(self)


class Problem(NamedTuple):
    """Initial states, save times, and the teacher's trajectories at those times."""

    y0: Float[Array, "batch n"]
    ts: Float[Array, " saves"]
    target: Float[Array, "saves batch n"]
    ode_steps: int  # Tsit5 steps on [0, 1], of constant size


def init_field(cls: type[VectorField], n: int, key: jax.Array, counted: bool = False) -> Any:
    """A random field of class `cls` (its slots allocated, for a `CachedVectorField`)."""
    w_key, b_key, v_key = jax.random.split(key, 3)
    field = cls(
        jax.random.normal(w_key, (n, n)) / np.sqrt(n),
        0.1 * jax.random.normal(b_key, (n,)),
        jax.random.normal(v_key, (n, n)) / np.sqrt(n),
        counted,
    )
    return memox.init(field) if isinstance(field, CachedVectorField) else field


def solve(term: Callable, problem: Problem, args: Any = None) -> Float[Array, "saves batch n"]:
    """The trajectories of `term` from `problem.y0` at `problem.ts`: Tsit5, constant steps
    (so every variant evaluates the field at the same points)."""
    return diffrax.diffeqsolve(
        diffrax.ODETerm(term),
        diffrax.Tsit5(),
        0.0,
        1.0,
        1.0 / problem.ode_steps,
        problem.y0,
        args,
        saveat=diffrax.SaveAt(ts=problem.ts),
        stepsize_controller=diffrax.ConstantStepSize(),
        max_steps=problem.ode_steps,
    ).ys


def make_problem(n: int, batch: int, ode_steps: int, saves: int, key: jax.Array) -> Problem:
    teacher_key, y0_key = jax.random.split(key)
    ts = jnp.linspace(0.0, 1.0, saves)
    y0 = jax.random.normal(y0_key, (batch, n))
    problem = Problem(y0, ts, jnp.zeros((saves, batch, n)), ode_steps)
    target = eqx.filter_jit(solve)(init_field(VectorField, n, teacher_key), problem)
    return problem._replace(target=target)


def mse(term: Callable, problem: Problem, args: Any = None) -> Float[Array, ""]:
    return jnp.mean((solve(term, problem, args) - problem.target) ** 2)


# The three losses, `loss(model, problem) -> (loss, model)`.


def naive_loss(model: VectorField, problem: Problem) -> tuple[Array, VectorField]:
    return mse(model, problem), model  # `rotation()` at every evaluation of the field


def with_rotation(t: Any, y: Float[Array, "batch n"], args: tuple) -> Float[Array, "batch n"]:
    model, q = args
    return model.field(q, y)


def hand_hoisted_loss(model: VectorField, problem: Problem) -> tuple[Array, VectorField]:
    q = model.rotation()  # once per solve, passed in
    return mse(with_rotation, problem, (model, q)), model


def memox_loss(model: CachedVectorField, problem: Problem) -> tuple[Array, CachedVectorField]:
    # `memox.hoist` reads `rotation()` once, through this `memox.call`; inside the solve
    # the field returns that value with no check.
    return memox.call(model, lambda m: mse(memox.hoist(m), problem))


VARIANTS = {  # name: (loss, class of the model)
    "naive": (naive_loss, VectorField),
    "hand-hoisted": (hand_hoisted_loss, VectorField),
    "memox": (memox_loss, CachedVectorField),
}


def make_step(loss: Callable, optim: optax.GradientTransformation) -> Callable:
    """The standard Equinox + optax training step; the loss returns the model as aux."""

    @eqx.filter_jit
    def step(model, opt_state, problem):
        (value, model), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, problem)
        params = eqx.filter(model, eqx.is_inexact_array)  # not the slots' integer arrays
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def main() -> None:
    start = time.perf_counter()
    problem_key, student_key = jax.random.split(jax.random.key(0))
    problem = make_problem(N_STATE, BATCH, ODE_STEPS, SAVES, problem_key)
    optim = optax.adam(LR)
    print(
        f"neural ODE, n = {N_STATE}, batch {BATCH}, Tsit5 {ODE_STEPS} steps, "
        f"Q = expm(W - Wᵀ), adam"
    )

    def fresh(name: str, counted: bool) -> tuple[Any, Any]:
        model = init_field(VARIANTS[name][1], N_STATE, student_key, counted)
        return model, optim.init(eqx.filter(model, eqx.is_inexact_array))

    # 1. Count: COUNT_STEPS training steps of each variant's counting program.
    expm_per_step, first_losses = {}, {}
    for name, (loss, _) in VARIANTS.items():
        step = make_step(loss, optim)
        jax.block_until_ready(step(*fresh(name, True), problem))  # compiles; discarded
        jax.effects_barrier()
        COUNTS.clear()
        state, losses = fresh(name, True), []
        for _ in range(COUNT_STEPS):
            *state, value = step(*state, problem)
            losses.append(float(value))
        jax.effects_barrier()
        expm_per_step[name] = COUNTS["expm"] / COUNT_STEPS
        first_losses[name] = losses
        if name == "memox":
            stats = memox.stats(state[0])["rotation_cache"]
            print(f"memox.stats after {COUNT_STEPS} training steps: {stats}")

    # 2. Time: the programs without callbacks, one step of each variant in turn.
    steps = {name: make_step(loss, optim) for name, (loss, _) in VARIANTS.items()}
    states = {name: fresh(name, False) for name in steps}
    for name, step in steps.items():
        jax.block_until_ready(step(*states[name], problem))  # compiles; discarded
    seconds = {name: [] for name in steps}
    losses = {name: [] for name in steps}
    names = list(steps)
    for i in range(TRAIN_STEPS):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t = time.perf_counter()
            *states[name], value = jax.block_until_ready(steps[name](*states[name], problem))
            seconds[name].append(time.perf_counter() - t)
            losses[name].append(float(value))

    median = {name: float(np.median(s)) for name, s in seconds.items()}
    print(f"\n{'variant':<12} | {'expm per training step':>22} | {'median step':>11}")
    print("-" * 13 + "+" + "-" * 24 + "+" + "-" * 12)
    for name in names:
        print(f"{name:<12} | {expm_per_step[name]:>22.0f} | {1e3 * median[name]:>8.2f} ms")
    hand = median["hand-hoisted"]
    print(
        f"\nstep time relative to hand-hoisted: memox {median['memox'] / hand:.2f}x, "
        f"naive {median['naive'] / hand:.2f}x"
    )
    curves = np.array([losses[name] for name in names])
    diff = float(np.max(np.abs(curves - curves[0]) / curves[0]))
    print(
        f"loss {curves[0, 0]:.4f} -> {curves[0, -1]:.4f} in {TRAIN_STEPS} steps; the three "
        f"loss curves differ by at most {diff:.1e} (relative)"
    )
    assert expm_per_step["memox"] == expm_per_step["hand-hoisted"] == 1, expm_per_step
    assert stats.misses == COUNT_STEPS and stats.hits == 0, stats  # Q moved at every step
    assert diff <= 1e-4, diff
    np.testing.assert_allclose(
        list(first_losses.values()), [losses["naive"][:COUNT_STEPS]] * 3, rtol=1e-5
    )
    print(f"total runtime {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
