"""memox.diffrax: Jacobian and LU reuse across the steps of diffrax's implicit solvers.

Factorisations are counted by real executions (`jax.debug.callback` in the linear
solver's `init`, which factorises), for the wrapped and the unwrapped solvers alike, and
checked against the counters in the solver state. Errors are relative to Radau
solutions at rtol 1e-12 (scipy), stored with the problems in tests/stiff_problems.py.
"""

import re
import subprocess
import sys
import textwrap

import pytest


diffrax = pytest.importorskip("diffrax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lineax as lx  # noqa: E402
import numpy as np  # noqa: E402
import optimistix as optx  # noqa: E402
from stiff_problems import (  # noqa: E402
    CLASSICS,
    COUNTS,
    CountingLU,
    kvaerno,
    relative_error,
    robertson,
)

import memox.diffrax  # noqa: E402
from memox.diffrax import FixedVeryChord, ReuseJacobian, ReuseState  # noqa: E402


@pytest.fixture(autouse=True)
def _no_tracer_leaks():
    # Overrides conftest's fixture of this name: diffrax's own solves fail under
    # `jax.check_tracer_leaks()` (a plain `diffrax.ImplicitEuler` or `Kvaerno5` solve,
    # diffrax 0.7.2: jax 0.10 reports a leak and then fails formatting it, jax 0.12
    # raises a concretisation error), so this module runs without the checker.
    yield


@pytest.fixture(autouse=True)
def _x64():
    # Stiff problems at rtol 1e-6 need float64; the setting is restored after each test.
    with jax.enable_x64(True):
        yield


def implicit_euler():
    tols = diffrax.with_stepsize_controller_tols(optx.Chord)
    return diffrax.ImplicitEuler(root_finder=tols(linear_solver=CountingLU()))


def solve(problem, solver, rtol=None, atol=None):
    """(relative error at t1, LUs executed, accepted steps, solution)."""
    vf, args, t1, y0, rtol_, atol_, ref = CLASSICS[problem]
    rtol, atol = rtol or rtol_, atol or atol_
    COUNTS.clear()
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vf),
        solver,
        0.0,
        t1,
        1e-6,
        jnp.asarray(y0),
        tuple(jnp.asarray(a) for a in args),
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
        saveat=diffrax.SaveAt(t1=True, solver_state=True),
        max_steps=100_000,
    )
    jax.effects_barrier()  # every counter callback has run
    err = relative_error(sol.ys[-1], ref, rtol, atol)
    return err, COUNTS["lu"], int(sol.stats["num_accepted_steps"]), sol


def check_state(sol, lus):
    state = sol.solver_state
    assert isinstance(state, ReuseState)
    accepted = int(sol.stats["num_accepted_steps"])
    assert int(state.factorisations) + int(state.reuses) == accepted
    # The state counts the accepted steps' factorisations; a rejected step's is lost.
    assert int(state.factorisations) <= lus
    assert int(state.retries) <= int(state.factorisations)


def test_import_memox_does_not_import_diffrax():
    code = "import sys, memox; assert 'diffrax' not in sys.modules, 'diffrax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_diffrax_the_error_says_how_to_install():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["diffrax"] = None  # as if not installed
        try:
            import memox.diffrax
        except ImportError as error:
            print(error)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert 'pip install "memox[diffrax]"' in out.stdout, out.stdout + out.stderr


def test_robertson_implicit_euler():
    err_plain, lus_plain, acc_plain, _ = solve("robertson", implicit_euler())
    err, lus, acc, sol = solve("robertson", ReuseJacobian(implicit_euler()))
    check_state(sol, lus)
    assert lus_plain / acc_plain >= 1  # one factorisation per step attempt
    assert lus / acc <= 0.3  # measured: 0.05
    assert err <= 1.5 * err_plain  # the same accuracy (both ~1e-3: a first-order method)
    assert abs(acc - acc_plain) <= 0.02 * acc_plain


def test_robertson_kvaerno5():
    err_plain, lus_plain, acc_plain, _ = solve("robertson", kvaerno())
    err, lus, acc, sol = solve("robertson", ReuseJacobian(kvaerno()))
    check_state(sol, lus)
    # Unwrapped, Kvaerno5 factorises twice per step attempt (the Newton matrix, and the
    # identity of its explicit first stage), and diffrax 0.7.2's chord iteration gives
    # up after two iterations: half its 692 attempts are rejected here (345 accepted).
    assert lus_plain / acc_plain >= 2
    # The step size grows by 1e11 in ~64 steps (about 1.5x per step), so the 30% drift
    # rule refactorises at most steps: measured 0.73 per accepted step.
    assert lus / acc <= 0.8
    assert err <= 10 * err_plain  # measured 3.7x: 2.9e-6 against 7.8e-7 (rtol 1e-6)


def test_stale_factorisation_failure_is_retried_at_the_same_step():
    # With drift ignored, a factorisation is replaced only after its Newton iteration
    # fails: the step is rerun at once with a fresh one, and the result stays accurate.
    solver = ReuseJacobian(implicit_euler(), max_age=10**6, gamma_drift=1e9)
    err_plain, _, acc_plain, _ = solve("robertson", implicit_euler())
    err, lus, acc, sol = solve("robertson", solver)
    check_state(sol, lus)
    assert int(sol.solver_state.retries) >= 1
    assert int(sol.solver_state.factorisations) == 1 + int(sol.solver_state.retries)
    assert err <= 1.5 * err_plain


@pytest.mark.parametrize(
    "implicit",
    [diffrax.ImplicitEuler, pytest.param(diffrax.Kvaerno5, marks=pytest.mark.heavy)],
)
def test_gradient_matches_unwrapped(implicit):
    def loss(k1, solver):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(robertson),
            solver,
            0.0,
            10.0,
            1e-6,
            jnp.array([1.0, 0.0, 0.0]),
            (k1, jnp.asarray(3e7), jnp.asarray(1e4)),
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-10),
            saveat=diffrax.SaveAt(t1=True),
            max_steps=4096,
        )  # the default adjoint: RecursiveCheckpointAdjoint
        return sol.ys[-1, 2]

    k1 = jnp.asarray(0.04)
    plain = jax.grad(loss)(k1, implicit())
    reused = jax.grad(loss)(k1, ReuseJacobian(implicit()))
    assert np.isfinite(float(plain))
    np.testing.assert_allclose(float(reused), float(plain), rtol=1e-4)


@pytest.mark.parametrize(
    "solver, why",
    [
        (diffrax.Euler(), "It is not one of them"),
        (diffrax.Tsit5(), "It is explicit"),
        (diffrax.KenCarp4(), "several tableaus"),
        (diffrax.HalfSolver(diffrax.ImplicitEuler()), "not a wrapper around it"),
    ],
)
def test_unsupported_solver(solver, why):
    with pytest.raises(TypeError, match=r"`memox.diffrax.ReuseJacobian` supports .*" + why):
        ReuseJacobian(solver)


def test_unsupported_root_finder_and_linear_solver():
    newton = diffrax.Kvaerno5(root_finder=optx.Newton(rtol=1e-6, atol=1e-6))
    with pytest.raises(TypeError, match="must be a chord method .* got `Newton`"):
        ReuseJacobian(newton)
    gmres = lx.GMRES(rtol=1e-6, atol=1e-6)
    iterative = diffrax.Kvaerno5(root_finder=diffrax.VeryChord(1e-6, 1e-6, linear_solver=gmres))
    with pytest.raises(TypeError, match=re.escape("must factorise") + ".* got `GMRES`"):
        ReuseJacobian(iterative)


def run_docstring_example(public):
    [code] = re.findall(r"```python\n(.*?)```", public.__doc__, flags=re.S)
    namespace = {}
    name = f"<{public.__name__} docstring>"
    exec(compile(textwrap.dedent(code), name, "exec"), namespace)
    return namespace


def test_docstring_example_runs():
    namespace = run_docstring_example(ReuseJacobian)
    sol, state = namespace["sol"], namespace["state"]
    assert int(state.factorisations) + int(state.reuses) == int(sol.stats["num_accepted_steps"])
    assert int(state.reuses) > 0


def test_fixed_very_chord_example_rejects_few_steps():
    # diffrax 0.7.2's `VeryChord` also rejects a step whose iteration has not converged
    # after two iterations (Robertson: half of its step attempts); the fixed test does
    # not (s9: none rejected). On a diffrax with the fix, both are the same.
    solver = run_docstring_example(FixedVeryChord)["solver"]
    *_, fixed = solve("robertson", solver)
    *_, unfixed = solve("robertson", diffrax.Kvaerno5())
    rejected = lambda sol: int(sol.stats["num_rejected_steps"])  # noqa: E731
    assert rejected(fixed) <= rejected(unfixed)
    assert rejected(fixed) <= 0.1 * int(fixed.stats["num_accepted_steps"])


@pytest.mark.heavy
@pytest.mark.parametrize(
    "problem, max_lus_per_step", [("robertson", 0.8), ("van_der_pol", 0.6), ("hires", 0.6)]
)
def test_kvaerno5_classics_against_fixed_chord(problem, max_lus_per_step):
    # The unwrapped baseline with the same Newton convergence test as the wrapper's.
    err_fixed, lus_fixed, acc_fixed, _ = solve(problem, kvaerno(5, FixedVeryChord))
    err, lus, acc, sol = solve(problem, ReuseJacobian(kvaerno()))
    check_state(sol, lus)
    assert lus_fixed / acc_fixed >= 2
    assert lus / acc <= max_lus_per_step  # measured: 0.73, 0.54, 0.51
    assert lus <= 0.4 * lus_fixed
    assert err <= 3 * err_fixed  # measured: 1.0x, 2.2x, 0.35x


@pytest.mark.parametrize("order", [3, 4])
def test_kvaerno3_and_4_against_fixed_chord(order):
    # The other ESDIRK methods `ReuseJacobian` supports (one nonzero diagonal coefficient,
    # an explicit first stage), on HIRES: accurate as the unwrapped method with the same
    # Newton convergence test, with a fraction of its factorisations.
    err_fixed, lus_fixed, acc_fixed, _ = solve("hires", kvaerno(order, FixedVeryChord))
    err, lus, acc, sol = solve("hires", ReuseJacobian(kvaerno(order)))
    check_state(sol, lus)
    assert lus_fixed / acc_fixed >= 2  # the Newton matrix and the explicit stage's identity
    assert lus <= 0.4 * lus_fixed
    assert err <= 3 * err_fixed


@pytest.mark.heavy
@pytest.mark.parametrize("problem", ["van_der_pol", "hires"])
def test_implicit_euler_classics(problem):
    tols = dict(rtol=1e-4, atol=1e-7)  # a first-order method: ~1e4 steps at these
    err_plain, lus_plain, acc_plain, _ = solve(problem, implicit_euler(), **tols)
    err, lus, acc, sol = solve(problem, ReuseJacobian(implicit_euler()), **tols)
    check_state(sol, lus)
    assert lus_plain / acc_plain >= 1
    assert lus / acc <= 0.3  # measured: 0.08
    assert err <= 1.5 * err_plain


@pytest.mark.heavy
def test_vmap_matches_separate_solves():
    def solve_one(y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(robertson),
            ReuseJacobian(diffrax.Kvaerno5()),
            0.0,
            100.0,
            1e-6,
            y0,
            (jnp.asarray(0.04), jnp.asarray(3e7), jnp.asarray(1e4)),
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-10),
            saveat=diffrax.SaveAt(t1=True),
        )
        return sol.ys[-1]

    y0s = jnp.array([[1.0, 0.0, 0.0], [0.9, 0.0, 0.1], [0.5, 0.0, 0.5]])
    batched = jax.vmap(solve_one)(y0s)
    for y0, y in zip(y0s, batched):
        np.testing.assert_allclose(np.asarray(y), np.asarray(solve_one(y0)), rtol=1e-5)


def test_public_names():
    assert memox.diffrax.ReuseJacobian is ReuseJacobian
    assert memox.diffrax.ReuseState is ReuseState
    assert memox.diffrax.FixedVeryChord is FixedVeryChord
    assert issubclass(FixedVeryChord, diffrax.VeryChord)
