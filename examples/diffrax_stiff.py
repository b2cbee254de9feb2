"""Reusing the factorised Newton matrix across the steps of diffrax's Kvaerno5.

The 2-D Brusselator (reaction-diffusion, 12 x 12 periodic grid, 288 unknowns, stiff
from the diffusion) is integrated to t = 0.5 by `diffrax.Kvaerno5` at rtol 1e-6:

- as diffrax does by default (a Jacobian and LU factorisations at every step);
- the same, with `VeryChord`'s convergence test fixed as upstream
  (`memox.diffrax.FixedVeryChord`, diffrax#754; in diffrax 0.7.2 a chord iteration not
  converged after two iterations counts as diverged and the step is rejected) -- the
  fair baseline for what reuse saves;
- wrapped in `memox.diffrax.ReuseJacobian`, which keeps the LU factors in the solver
  state and refactorises only when the step size has drifted by 30%, after 20 steps, or
  when the Newton iteration fails with the old factors.

Factorisations are counted as they execute (`jax.debug.callback` in the linear
solver), errors are relative to scipy's Radau at rtol 1e-10.

    pip install "memox[diffrax]" scipy && python examples/diffrax_stiff.py
"""

import pathlib
import sys
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import scipy.integrate
import scipy.sparse

import memox.diffrax


sys.path.append(str(pathlib.Path(__file__).parents[1] / "tests"))  # the test problems
from stiff_problems import COUNTS, brusselator, kvaerno, relative_error  # noqa: E402


N, T1, RTOL, ATOL = 12, 0.5, 1e-6, 1e-8
VECTOR_FIELD, Y0 = brusselator(N)


def solve(solver, y0):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(VECTOR_FIELD),
        solver,
        t0=0.0,
        t1=T1,
        dt0=1e-4,
        y0=y0,
        stepsize_controller=diffrax.PIDController(rtol=RTOL, atol=ATOL),
        saveat=diffrax.SaveAt(t1=True, solver_state=True),
        max_steps=10_000,
    )


def main() -> None:
    start = time.perf_counter()
    jac = jax.jit(jax.jacfwd(lambda y: VECTOR_FIELD(0.0, y, None)))
    reference = scipy.integrate.solve_ivp(
        lambda t, y: np.asarray(VECTOR_FIELD(t, y, None)),
        (0.0, T1),
        Y0,
        method="Radau",
        rtol=1e-10,
        atol=1e-12,
        jac=lambda t, y: scipy.sparse.csc_matrix(np.asarray(jac(y))),
    ).y[:, -1]

    variants = {
        "diffrax Kvaerno5 (0.7.2)": kvaerno(),
        "Kvaerno5, chord test fixed": kvaerno(5, memox.diffrax.FixedVeryChord),
        "ReuseJacobian(Kvaerno5)": memox.diffrax.ReuseJacobian(kvaerno()),
    }
    print(f"2-D Brusselator, {2 * N * N} unknowns, t in [0, {T1}], rtol={RTOL:g}, atol={ATOL:g}\n")
    columns = ["accepted", "rejected", "LUs", "LUs/step", "error", "wall"]
    header = f"{'solver':28}" + "".join(f"{c:>9}" for c in columns)
    print(header + "\n" + "-" * len(header))
    for name, solver in variants.items():
        y0 = jnp.asarray(Y0)
        compiled = jax.jit(lambda y0: solve(solver, y0)).lower(y0).compile()
        COUNTS.clear()
        begin = time.perf_counter()
        sol = jax.block_until_ready(compiled(y0))
        wall = time.perf_counter() - begin
        jax.effects_barrier()
        accepted = int(sol.stats["num_accepted_steps"])
        rejected = int(sol.stats["num_rejected_steps"])
        err = relative_error(sol.ys[-1], reference, RTOL, ATOL)
        lus = COUNTS["lu"]
        print(
            f"{name:28}{accepted:9d}{rejected:9d}{lus:9d}{lus / accepted:9.2f}"
            f"{err:9.1e}{wall:8.2f}s"
        )
    state = sol.solver_state  # the last one: ReuseJacobian's memox.diffrax.ReuseState
    print(
        f"\nReuseJacobian's own counters (accepted steps): {int(state.factorisations)} "
        f"factorisations, {int(state.reuses)} reuses, {int(state.retries)} steps retried."
    )
    print("Kvaerno5 factorises twice per step attempt (the Newton matrix, and the identity")
    print("for its explicit first stage); ReuseJacobian factorises only to refresh.")
    print(f"Total runtime: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)
    main()
