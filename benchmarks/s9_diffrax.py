"""Scenario 9: Jacobian and LU reuse across the steps of diffrax's implicit solvers.

`memox.diffrax.ReuseJacobian(diffrax.Kvaerno5())` against the same solver without reuse
and against `scipy.integrate.solve_ivp(method="BDF")`, float64, adaptive steps
(`diffrax.PIDController(rtol, atol)`, the same tolerances everywhere):

- small classics: Robertson (t in [0, 1e5]), Van der Pol with mu = 1000 (Hairer's
  scaling, eps = 1 / mu^2 = 1e-6, t in [0, 2]) and HIRES (t in [0, 321.8122]);
- a large stiff system where the factorisation dominates: the 2-D Brusselator
  reaction-diffusion problem (SciML's benchmark form: alpha = 10, periodic boundaries,
  forcing switched on at t = 1.1) on an n x n grid, 2 n^2 unknowns, with the dense
  Jacobian and dense LU that diffrax uses by default (lineax), O(N^3) per LU.

Variants:

- diffrax default: `diffrax.Kvaerno5()` as installed (0.7.2). Its chord iteration
  reports a failure when it has not converged after two iterations (fixed upstream by
  diffrax#754 / optimistix#230), so many steps are rejected;
- diffrax, fixed chord: `Kvaerno5` with `VeryChord`'s termination fixed as upstream
  (`memox.diffrax.FixedVeryChord`): the same Newton convergence test as the memox root
  finder, without reuse. The fair baseline for what reuse itself saves;
- memox reuse: `ReuseJacobian(Kvaerno5())` (max_age 20, gamma_drift 0.3);
- memox reuse, refresh on failure only: `max_age` and `gamma_drift` out of reach, so
  that a factorisation is replaced only when the Newton iteration fails with it: the
  fewest factorisations a refresh policy can reach with diffrax's step sizes;
- scipy BDF: `solve_ivp(method="BDF")` with the Jacobian from a jitted `jax.jacfwd`
  (dense, like diffrax's);
- scipy BDF, jac_sparsity (the large system only): `solve_ivp(method="BDF")` given the
  Jacobian's sparsity pattern instead (`jac_sparsity`, what a scipy user passes for a
  discretised PDE): scipy then estimates the Jacobian by grouped finite differences
  (a few RHS evaluations) and factorises it with a sparse LU (SuperLU). diffrax (lineax)
  has no sparse LU, so neither diffrax variant nor the memox wrapper can do the same.

Counts are real executions, from programs where the vector field and the linear
solver's `init` (which evaluates the Jacobian and factorises) call `jax.debug.callback`.
The classics are timed with programs without callbacks; the large system, whose steps
take seconds, times the counting programs themselves (~20 callbacks per step). "J evals" are
`jax.jacfwd`s of the vector field (one per LU for diffrax: lineax materialises the
Jacobian in `init`); "RHS evals" include the one primal evaluation inside each. For
scipy, its own `njev`, `nlu`, `nfev` (nfev without the Jacobian's). Errors are the
max over components of `|y - ref| / (|ref| + atol / rtol)` at the final time, against
Radau (scipy) at rtol 1e-12 for the classics (stored with them) and rtol 1e-10 with a
sparse Jacobian for the Brusselator (computed in the run). The problems and the counting
LU are `tests/stiff_problems.py`'s; the fixed-chord baseline is
`memox.diffrax.FixedVeryChord`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import TraceCounter, interleaved, median, progress, timed as timed_call


try:
    import diffrax
    import scipy.integrate
    import scipy.sparse
    from stiff_problems import CLASSICS, COUNTS, brusselator, kvaerno, relative_error

    import memox.diffrax
except ImportError as error:  # diffrax is an optional extra: `pip install "memox[diffrax]"`
    diffrax = None
    _MISSING = str(error)


SIZES = {
    "full": dict(
        classics=("robertson", "van_der_pol", "hires"), rounds=5, n=32, t1=0.5, rounds_large=2
    ),
    # CI's smoke run: the large system at a small size, no classics.
    "quick": dict(classics=(), rounds=1, n=10, t1=0.1, rounds_large=1),
}
DEFAULT, FIXED, REUSE, ON_FAILURE, SCIPY, SCIPY_SPARSE = (
    "diffrax default",
    "diffrax, fixed chord",
    "memox reuse",
    "memox reuse, refresh on failure only",
    "scipy BDF",
    "scipy BDF, jac_sparsity",
)


VARIANTS = (DEFAULT, FIXED, REUSE, ON_FAILURE, SCIPY)  # every problem; SCIPY_SPARSE: the large one


def _tick(name: str) -> None:
    jax.debug.callback(lambda: COUNTS.update([name]))


def solver(name: str, counting: bool):
    """The variant's solver; `counting`: with a linear solver that counts its LUs."""
    chord = memox.diffrax.FixedVeryChord if name == FIXED else diffrax.VeryChord
    kvaerno5 = kvaerno(5, chord, counting)
    if name == REUSE:
        return memox.diffrax.ReuseJacobian(kvaerno5)
    if name == ON_FAILURE:  # the fewest factorisations any refresh policy can reach
        return memox.diffrax.ReuseJacobian(kvaerno5, max_age=10**9, gamma_drift=1e9)
    return kvaerno5


# -- running -------------------------------------------------------------------------------


def diffrax_variant(vf, t1, y0, rtol, atol, traces: TraceCounter, problem: str, name: str):
    """`run(counting)` -> (y(t1), accepted, rejected steps); two compiled programs, with
    and without the counting callbacks, each compiled ahead on first use."""

    def counted_vf(t, y, args):
        _tick("rhs")
        return vf(t, y, args)

    def make(counting: bool):
        term = diffrax.ODETerm(counted_vf if counting else vf)
        solver_ = solver(name, counting)

        @jax.jit
        def solve(y0):
            traces.tick(f"{problem} {name}{' (counting)' if counting else ''}")
            sol = diffrax.diffeqsolve(
                term,
                solver_,
                0.0,
                t1,
                1e-6,
                y0,
                None,
                stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
                saveat=diffrax.SaveAt(t1=True),
                max_steps=100_000,
            )
            return sol.ys[-1], sol.stats["num_accepted_steps"], sol.stats["num_rejected_steps"]

        return solve.lower(y0).compile()

    y0 = jnp.asarray(y0)
    programs = {}

    def run(counting: bool, compile_only: bool = False):
        if counting not in programs:
            programs[counting] = make(counting)
        return None if compile_only else programs[counting](y0)

    return run


def scipy_variant(vf, t1, y0, rtol, atol, sparsity=None):
    """scipy's BDF given the dense Jacobian of a jitted `jax.jacfwd`, or, with
    `sparsity` (a scipy sparse matrix), given only the Jacobian's sparsity pattern."""
    f = jax.jit(lambda t, y: vf(t, y, None))
    jac = jax.jit(lambda t, y: jax.jacfwd(lambda y: vf(t, y, None))(y))
    f(0.0, jnp.asarray(y0)), jac(0.0, jnp.asarray(y0))  # compile outside the timings
    if sparsity is None:
        jacobian = dict(jac=lambda t, y: np.asarray(jac(t, y)))
    else:  # finite differences grouped by the pattern, sparse LU (SuperLU)
        jacobian = dict(jac_sparsity=sparsity)

    def run(counting: bool, compile_only: bool = False):
        if compile_only:
            return None
        return scipy.integrate.solve_ivp(
            lambda t, y: np.asarray(f(t, y)),
            (0.0, t1),
            y0,
            method="BDF",
            rtol=rtol,
            atol=atol,
            **jacobian,
        )

    return run


def sparsity_pattern(vf, y0):
    """The Jacobian's structural nonzeros: those of `jax.jacfwd` at a random state (no
    entry of the Brusselator's Jacobian vanishes there by accident)."""
    y = np.random.default_rng(0).uniform(0.5, 2.0, np.shape(y0))
    jac = np.asarray(jax.jit(jax.jacfwd(lambda y: vf(1.2, y, None)))(jnp.asarray(y)))
    return scipy.sparse.csc_matrix(jac != 0)


def compare(
    problem, vf, t1, y0, rtol, atol, ref, rounds, traces, count_in_timed, once=(), sparsity=None
) -> list:
    """Table rows: counts and interleaved timed runs of each variant (compiled ahead).

    Counts come from a run of a program with counting callbacks. A callback costs ~10 us
    to ~1 ms on this machine, so the classics time a program without them
    (`count_in_timed=False`: one extra counting run); the large system, where a step
    takes seconds and ~20 callbacks (< 1%), times the counting program itself. Variants
    in `once` are timed by a single run, before the others' interleaved rounds. With
    `sparsity`, scipy's BDF also runs given that pattern (`jac_sparsity`)."""
    runs = {
        name: diffrax_variant(vf, t1, y0, rtol, atol, traces, problem, name)
        for name in (DEFAULT, FIXED, REUSE, ON_FAILURE)
    }
    y0_np = np.asarray(y0, np.float64)
    runs[SCIPY] = scipy_variant(vf, t1, y0_np, rtol, atol)
    if sparsity is not None:
        runs[SCIPY_SPARSE] = scipy_variant(vf, t1, y0_np, rtol, atol, sparsity)
    start = time.perf_counter()
    for fn in runs.values():
        fn(True, compile_only=True)
        fn(count_in_timed, compile_only=True)
    progress(f"  s9 {problem}: compiled in {time.perf_counter() - start:.1f} s")
    counts, outs = {}, {}

    def counting_run(name):
        COUNTS.clear()
        outs[name] = jax.block_until_ready(runs[name](True))
        jax.effects_barrier()
        counts.setdefault(name, []).append(dict(COUNTS))

    times = {}
    if count_in_timed:
        for name in once:
            times[name] = [timed_call(lambda name=name: counting_run(name))[1]]
        timed = {name: (lambda name=name: counting_run(name)) for name in runs if name not in once}
    else:
        for name in runs:
            counting_run(name)
        timed = {name: (lambda fn=fn: fn(False)) for name, fn in runs.items()}
    times.update(interleaved(timed, rounds))
    rows = []
    for name in runs:
        if name in (SCIPY, SCIPY_SPARSE):
            sol = outs[name]
            assert sol.success, sol.message
            y, acc, rej = sol.y[:, -1], len(sol.t) - 1, None
            lus, jevs, rhs = sol.nlu, sol.njev, sol.nfev
        else:
            assert all(c == counts[name][0] for c in counts[name]), counts[name]
            y, acc, rej = outs[name]
            acc, rej = int(acc), int(rej)
            lus = jevs = counts[name][0].get("lu", 0)
            rhs = counts[name][0].get("rhs", 0)
        wall = median(times[name])
        progress(f"  s9 {problem}: {name}: {acc} steps, {lus} LUs, {1e3 * wall:.0f} ms")
        rows.append(
            {
                "problem": problem,
                "variant": name,
                "accepted steps": acc,
                "rejected steps": rej,
                "LU factorisations": lus,
                "J evals": jevs,
                "RHS evals": rhs,
                "LUs / accepted step": lus / acc,
                "error": relative_error(y, ref, rtol, atol),
                "wall [ms]": 1e3 * wall,
            }
        )
    base = next(r["wall [ms]"] for r in rows if r["variant"] == DEFAULT)
    for r in rows:
        r["wall / diffrax default"] = r["wall [ms]"] / base
    return rows


def brusselator_reference(vf, t1, y0, rtol, atol):
    """scipy Radau at rtol 1e-10 with the Jacobian as a sparse matrix."""
    f = jax.jit(lambda t, y: vf(t, y, None))
    jac = jax.jit(lambda t, y: jax.jacfwd(lambda y: vf(t, y, None))(y))
    sol = scipy.integrate.solve_ivp(
        lambda t, y: np.asarray(f(t, y)),
        (0.0, t1),
        y0,
        method="Radau",
        rtol=1e-10,
        atol=1e-10 * atol / rtol,
        jac=lambda t, y: scipy.sparse.csc_matrix(np.asarray(jac(t, y))),
    )
    assert sol.success, sol.message
    return sol.y[:, -1]


def run(size: dict) -> dict | None:
    if diffrax is None:
        progress(f's9 diffrax: skipped ({_MISSING}; pip install "memox[diffrax]")')
        return None
    with jax.enable_x64(True):
        return _run(size)


def _run(size: dict) -> dict:
    traces = TraceCounter()
    rows = []
    for problem in size["classics"]:
        p = CLASSICS[problem]

        def vf(t, y, _, p=p):  # the parameters as constants of the program
            return p.vector_field(t, y, p.args)

        t1, y0, rtol, atol, ref = p.t1, p.y0, p.rtol, p.atol, p.reference
        progress(f"s9 diffrax: {problem}, {size['rounds']} rounds")
        rows += compare(problem, vf, t1, y0, rtol, atol, ref, size["rounds"], traces, False)

    n, t1 = size["n"], size["t1"]
    vf, y0 = brusselator(n)
    rtol, atol = 1e-6, 1e-8
    name = f"brusselator {n}x{n} (N={2 * n * n})"
    progress(f"s9 diffrax: {name}, t in [0, {t1}]: reference (Radau, sparse Jacobian)")
    start = time.perf_counter()
    ref = brusselator_reference(vf, t1, y0, rtol, atol)
    progress(f"  s9 reference in {time.perf_counter() - start:.1f} s")
    rounds = size["rounds_large"]
    sparsity = sparsity_pattern(vf, y0)
    large = compare(
        name, vf, t1, y0, rtol, atol, ref, rounds, traces, True, once=(DEFAULT,), sparsity=sparsity
    )
    rows += large
    assert all(count == 1 for count in traces.counts.values()), traces.counts

    by = {(r["problem"], r["variant"]): r for r in rows}
    problems = list(dict.fromkeys(r["problem"] for r in rows))
    variants = {p: [v for v in (*VARIANTS, SCIPY_SPARSE) if (p, v) in by] for p in problems}
    metrics = {
        p: {
            "LUs per accepted step": {v: by[p, v]["LUs / accepted step"] for v in variants[p]},
            "wall / diffrax default": {
                v: by[p, v]["wall / diffrax default"] for v in variants[p] if v != DEFAULT
            },
            "wall reuse / fixed chord": by[p, REUSE]["wall [ms]"] / by[p, FIXED]["wall [ms]"],
            **{
                f"wall reuse / {v}": by[p, REUSE]["wall [ms]"] / by[p, v]["wall [ms]"]
                for v in (SCIPY, SCIPY_SPARSE)
                if v in variants[p]
            },
            "error reuse / default": by[p, REUSE]["error"] / by[p, DEFAULT]["error"],
            "error reuse / fixed chord": by[p, REUSE]["error"] / by[p, FIXED]["error"],
        }
        for p in problems
    }
    big = by[name, REUSE]
    notes = [
        "Kvaerno5 (diffrax 0.7.2) factorises twice per step attempt: the Newton matrix, and "
        "the identity for its explicit first stage; the reuse wrapper's root finder does "
        "neither unless it refreshes.",
        "diffrax default's chord iteration fails when not converged after two iterations "
        "(diffrax#754): most of its rejected steps; 'fixed chord' is the same solver with "
        "the upstream fix, the baseline that isolates what reuse saves.",
        "The reuse counts are of all executions (rejected steps too); the solver state's "
        "own counters (`ReuseState`) cover accepted steps only. diffrax restores the "
        "solver state after a rejected step, so a factorisation made in one is lost.",
        "'refresh on failure only' bounds what any refresh policy can reach: diffrax's "
        "controller changes the step size at every step (Robertson's grows 1e11-fold in "
        "~64 steps), and a factorisation made for another step size often fails the next "
        "Newton iteration; its extra Newton iterations cost more time than the "
        "factorisations they save.",
        f"Wall time: median of {size['rounds']} (classics) and {rounds} (large system) "
        "interleaved runs of programs compiled ahead; on the large system the diffrax "
        "default (~6x the others) is timed by one run, before the others. The classics' "
        "timed programs have no counting callbacks (the counts come from a separate run); "
        "the large system times its counting programs (~20 callbacks per step of seconds).",
        f"Large system, memox reuse: {big['LU factorisations']} LUs for "
        f"{big['accepted steps']} accepted steps, "
        f"{metrics[name]['wall / diffrax default']['memox reuse']:.2f}x the default's wall "
        f"time, {metrics[name]['wall reuse / fixed chord']:.2f}x the fixed chord's, "
        f"{metrics[name]['wall reuse / scipy BDF']:.2f}x scipy BDF's with the dense "
        f"Jacobian, {metrics[name]['wall reuse / scipy BDF, jac_sparsity']:.2f}x scipy "
        "BDF's given `jac_sparsity` (finite-difference Jacobian, sparse LU: what diffrax "
        "cannot do).",
    ]
    return {
        "id": "s9",
        "title": "diffrax implicit solvers: Jacobian and LU reuse across steps (Kvaerno5)",
        "sizes": {**size, "unknowns": 2 * n * n, "max_age": 20, "gamma_drift": 0.3},
        "rows": rows,
        "metrics": metrics,
        "notes": notes,
    }


# -- scipy's two Jacobian forms alone, on the large system -------------------------------


def scipy_forms(n: int = 32, t1: float = 0.5, rounds: int = 3) -> list[dict]:
    """scipy BDF with the dense Jacobian and with `jac_sparsity`, and memox reuse, on the
    full-size Brusselator only (interleaved, `rounds` each): a bounded run for the
    `jac_sparsity` comparison, `python benchmarks/s9_diffrax.py --scipy-forms` (4 min on
    the loaded 2-core machine: the Radau reference, then ~25 s per round)."""
    with jax.enable_x64(True):
        vf, y0 = brusselator(n)
        rtol, atol = 1e-6, 1e-8
        progress(f"s9 scipy forms: brusselator {n}x{n}, reference (Radau, sparse Jacobian)")
        ref = brusselator_reference(vf, t1, y0, rtol, atol)
        y0_np = np.asarray(y0, np.float64)
        runs = {
            SCIPY: scipy_variant(vf, t1, y0_np, rtol, atol),
            SCIPY_SPARSE: scipy_variant(vf, t1, y0_np, rtol, atol, sparsity_pattern(vf, y0)),
            REUSE: diffrax_variant(vf, t1, y0, rtol, atol, TraceCounter(), "large", REUSE),
        }
        runs[REUSE](False, compile_only=True)
        outs = {name: jax.block_until_ready(fn(False)) for name, fn in runs.items()}
        times = interleaved({name: (lambda fn=fn: fn(False)) for name, fn in runs.items()}, rounds)
        rows = []
        for name, out in outs.items():
            if name == REUSE:
                y, steps, lus = out[0], int(out[1]), None
            else:
                assert out.success, out.message
                y, steps, lus = out.y[:, -1], len(out.t) - 1, out.nlu
            row = {
                "variant": name,
                "accepted steps": steps,
                "LU factorisations": lus,
                "J evals": None if name == REUSE else out.njev,
                "RHS evals": None if name == REUSE else out.nfev,
                "error": relative_error(y, ref, rtol, atol),
                "wall [ms]": 1e3 * median(times[name]),
            }
            progress(f"  {row}")
            rows.append(row)
        wall = {r["variant"]: r["wall [ms]"] for r in rows}
        progress(
            f"  memox reuse / scipy BDF (dense J): {wall[REUSE] / wall[SCIPY]:.2f}; "
            f"memox reuse / scipy BDF (jac_sparsity): {wall[REUSE] / wall[SCIPY_SPARSE]:.2f}"
        )
        return rows


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--scipy-forms"]:  # SciPy's BDF in each form, alone
        if diffrax is None:
            sys.exit(f"s9 needs diffrax: {_MISSING}")
        scipy_forms()
    else:
        import _runner

        _runner.main(script=__file__)
