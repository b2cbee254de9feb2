"""Jacobian and LU reuse in a stiff implicit integrator, with CVODE's policy in memox.

The Robertson problem (stiff chemical kinetics) is integrated to t = 100 by variable-step
BDF2 on a fixed log-spaced grid, inside one `lax.scan`. Each step solves
`z - gamma * f(z) = a` (`gamma = h * beta`) by Newton's method, whose matrix is the LU
factorisation of `I - gamma * J`. Like CVODE, the integrator does not recompute it often:

- `J` (the `jac` method, `Manual(max_age=50)`) is re-evaluated at the current state only
  when Newton fails to converge with a stale `J` (`memox.invalidate` in the scan body,
  then the step is retried) or after 50 reuses (CVODE's `msbj`);
- the LU (the `lu` method, keyed by `J` and reading `gamma`, `Drift(rtol=0.3,
  max_age=20)`) is refactorised when `J` changes, when `gamma` drifts by more than 30%
  from the value it was factorised with (CVODE's `dgmax`), or after 20 reuses (`msbp`).

`J` is passed to `lu` as an argument rather than read as `self.jac()` inside it: the
dependencies of a cached method include the arrays its nested cached methods read, so
`lu` would then also apply `Drift` to `y` and refactorise (with the same stale `J`)
whenever the state moves by 30%.

It is compared with the same integrator doing full Newton (a fresh `J` and LU at every
Newton iteration) and with `scipy.integrate.solve_ivp(method="BDF")`. Jacobian
evaluations and factorisations are counted by `jax.debug.callback` (once per real
execution; only when this file runs as a script: `benchmarks/s3_stiff_jacobian.py`
imports the integrator) and, for memox, also read from `memox.stats`; errors are
relative to a `Radau` solution with `rtol=1e-10, atol=1e-14`.
"""

import collections
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.integrate
from jax import lax
from jax.scipy.linalg import lu_factor, lu_solve
from jaxtyping import Array, Float

import memox
from memox import Memo
from memox.policies import Drift, Manual


MSBJ, MSBP, DGMAX = 50, 20, 0.3  # CVODE's reuse limits (reuses of J, of LU; gamma drift)
MAX_ITERS = 3  # Newton iterations per attempt (CVODE: 3 corrections)
NEWTON_RTOL, NEWTON_ATOL = 1e-5, 1e-11  # converged: weighted RMS of the update <= 1
STEPS_PER_DECADE = 75
T = np.concatenate([[0.0], np.logspace(-6, 2, 8 * STEPS_PER_DECADE + 1)])
# Errors are measured at t = 1e-3, 1e-2, ..., 1e2 (before, y3 < 1e-5: below any atol).
OUTPUT = np.arange(3 * STEPS_PER_DECADE, len(T) - 1, STEPS_PER_DECADE)
Y0 = np.array([1.0, 0.0, 0.0])
COUNTS = collections.Counter()  # executions of `jacobian` and `factorise`
COUNTING = __name__ == "__main__"  # imported (by the benchmarks), nothing is counted


def robertson(y: Float[Array, "3"]) -> Float[Array, "3"]:
    y1, y2, y3 = y
    return jnp.stack(
        [-0.04 * y1 + 1e4 * y2 * y3, 0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2, 3e7 * y2**2]
    )


def jacobian(y: Float[Array, "3"]) -> Float[Array, "3 3"]:
    if COUNTING:  # a host callback: once per execution, not per trace
        jax.debug.callback(lambda: COUNTS.update(["jac"]))
    return jax.jacfwd(robertson)(y)


def factorise(jac: Float[Array, "3 3"], gamma: Float[Array, ""]) -> tuple[Array, Array]:
    if COUNTING:
        jax.debug.callback(lambda: COUNTS.update(["lu"]))
    return lu_factor(jnp.eye(3) - gamma * jac)


class NewtonMatrix(eqx.Module):
    """What the Newton matrix `I - gamma * J` of the current step is built from."""

    y: Float[Array, "3"]  # the current state: where `J` is evaluated when refreshed
    gamma: Float[Array, ""]  # h * beta of the current step
    jac_cache: Memo[Float[Array, "3 3"]] = Memo()
    lu_cache: Memo[tuple[Array, Array]] = Memo()

    # Manual: `y` moves every step, but `J` is kept until invalidated or reused 50 times.
    @memox.cached("jac_cache", policy=Manual(max_age=MSBJ))
    def jac(self) -> Float[Array, "3 3"]:
        return jacobian(self.y)

    # `jac` is an argument, so part of the exact key; Drift applies to `gamma` only.
    @memox.cached("lu_cache", policy=Drift(rtol=DGMAX, max_age=MSBP))
    def lu(self, jac: Float[Array, "3 3"]) -> tuple[Array, Array]:
        return factorise(jac, self.gamma)


def newton_lu(m: NewtonMatrix) -> tuple[Array, Array]:
    return m.lu(m.jac())


def newton_iteration(z, a, gamma, lu):
    """One Newton update of `z`, and whether it converged."""
    dz = lu_solve(lu, a + gamma * robertson(z) - z)
    weights = NEWTON_RTOL * jnp.abs(z) + NEWTON_ATOL
    return z + dz, jnp.sqrt(jnp.mean((dz / weights) ** 2)) <= 1.0


def newton(z, a, gamma, lu_at):
    """Solve `z - gamma * f(z) = a` from `z`; `lu_at(z)` is the LU to use at iterate `z`.

    Returns the solution, the number of iterations, and whether it converged."""

    def body(state):
        z, k, _ = state
        z, ok = newton_iteration(z, a, gamma, lu_at(z))
        return z, k + 1, ok

    cond = lambda state: ~state[2] & (state[1] < MAX_ITERS)  # noqa: E731
    return lax.while_loop(cond, body, (z, 0, jnp.asarray(False)))


def reuse_step(model, y, a, gamma, z0):
    """(a) CVODE-like: the cached LU, refreshed by memox's policies or on failure."""
    model = eqx.tree_at(lambda m: (m.y, m.gamma), model, (y, gamma))
    lu, model = memox.call(model, newton_lu)
    z, iters, ok = newton(z0, a, gamma, lambda _: lu)

    def retry(model):  # a stale `J` failed: evaluate it at `y`, refactorise, start again
        model = memox.invalidate(model, NewtonMatrix.jac)
        lu, model = memox.call(model, newton_lu)
        z, more, ok = newton(z0, a, gamma, lambda _: lu)
        return model, z, iters + more, ok, jnp.asarray(True)

    keep = lambda model: (model, z, iters, ok, jnp.asarray(False))  # noqa: E731
    return lax.cond(ok, keep, retry, model)


def full_newton_step(model, y, a, gamma, z0):
    """(b) No reuse: a fresh `J` and LU at every Newton iterate."""
    z, iters, ok = newton(z0, a, gamma, lambda z: factorise(jacobian(z), gamma))
    return model, z, iters, ok, jnp.asarray(False)


@eqx.filter_jit
def integrate(step, model, grid):
    """Variable-step BDF2 over the times `grid` (the first step is implicit Euler)."""

    def body(carry, t_next):
        model, y, y_prev, t, h_prev = carry
        h = t_next - t
        w = h / h_prev  # step ratio; 0 on the first step, where BDF2 is implicit Euler
        a = ((1 + w) ** 2 * y - w**2 * y_prev) / (1 + 2 * w)
        gamma = h * (1 + w) / (1 + 2 * w)
        model, z, *counts = step(model, y, a, gamma, y + w * (y - y_prev))
        return (model, z, y, t_next, h), (z, *counts)

    carry = (model, jnp.asarray(Y0), jnp.asarray(Y0), grid[0], jnp.inf)
    (model, *_), (ys, iters, ok, retried) = lax.scan(body, carry, grid[1:])
    return model, ys, iters, ok, retried


def rhs_np(t, y):
    r1, r2, r3 = 0.04 * y[0], 1e4 * y[1] * y[2], 3e7 * y[1] ** 2
    return np.array([-r1 + r2, r1 - r2 - r3, r3])


def jac_np(t, y):
    return np.array(
        [
            [-0.04, 1e4 * y[2], 1e4 * y[1]],
            [0.04, -1e4 * y[2] - 6e7 * y[1], -1e4 * y[1]],
            [0.0, 6e7 * y[1], 0.0],
        ]
    )


def max_rel_error(ys, reference) -> float:
    return float(np.max(np.abs(ys - reference) / np.abs(reference)))


def run_jax(name, step, model, reference) -> tuple[list, str]:
    """A table row for an integrator in JAX, from its second (compiled) run."""
    integrate(step, model, T)
    COUNTS.clear()
    start = time.perf_counter()
    model, ys, iters, ok, retried = jax.block_until_ready(integrate(step, model, T))
    jax.effects_barrier()  # every pending counter callback has run
    wall = time.perf_counter() - start
    if model is not None:  # memox's own counters agree with the callbacks'
        stats = memox.stats(model)
        misses = {"jac": int(stats["jac_cache"].misses), "lu": int(stats["lu_cache"].misses)}
        assert misses == {k: COUNTS[k] for k in misses}, (misses, COUNTS)
    row = [name, len(T) - 1, int(np.sum(iters)), COUNTS["jac"], COUNTS["lu"]]
    row += [max_rel_error(np.asarray(ys)[OUTPUT], reference), wall]
    return row, f"{int(np.sum(retried))} retried, {int(np.sum(~ok))} failed"


def main() -> None:
    start = time.perf_counter()
    t_out, t_end = T[1:][OUTPUT], T[-1]
    radau = dict(method="Radau", rtol=1e-10, atol=1e-14, jac=jac_np, t_eval=t_out)
    reference = scipy.integrate.solve_ivp(rhs_np, (0.0, t_end), Y0, **radau).y.T

    model = memox.init(NewtonMatrix(jnp.asarray(Y0), jnp.asarray(0.0)), newton_lu)
    row_a, newton_a = run_jax("(a) memox, CVODE-like reuse", reuse_step, model, reference)
    row_b, newton_b = run_jax("(b) full Newton, no reuse", full_newton_step, None, reference)

    tols = dict(rtol=1e-4, atol=1e-8)  # about the error of the BDF2 grid
    begin = time.perf_counter()
    sol = scipy.integrate.solve_ivp(
        rhs_np, (0.0, t_end), Y0, method="BDF", jac=jac_np, dense_output=True, **tols
    )
    wall = time.perf_counter() - begin
    err = max_rel_error(sol.sol(t_out).T, reference)
    name = f"(c) scipy BDF, rtol={tols['rtol']:.0e}"
    row_c = [name, len(sol.t) - 1, "-", sol.njev, sol.nlu, err, wall]

    header = ["method", "steps", "Newton its", "J evals", "LUs", "max rel err", "wall [s]"]
    cells = [
        [f"{c:.2e}" if isinstance(c, float) else str(c) for c in r] for r in (row_a, row_b, row_c)
    ]
    widths = [max(len(h), *(len(r[j]) for r in cells)) for j, h in enumerate(header)]
    print(f"Robertson problem on [0, {t_end:g}]: BDF2 on a log grid of {len(T) - 1} steps,")
    print(f"errors at t = {', '.join(f'{t:g}' for t in t_out)} against Radau (rtol=1e-10).\n")
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"\nNewton (steps): (a) {newton_a}; (b) {newton_b}.")
    print(f"(c) nfev = {sol.nfev}: scipy's BDF calls f once per Newton iteration (+2 to start).")
    print("Wall times: second run, compiled; (a) and (b) include their host counter callbacks.")
    print(f"Total runtime of main(): {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)
    main()
