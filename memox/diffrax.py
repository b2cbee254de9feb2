"""Jacobian and LU reuse across the steps of diffrax's implicit solvers, as CVODE does.

diffrax's implicit solvers (`ImplicitEuler`, `Kvaerno3/4/5`) solve each step's stage
equations with a chord method whose `init` evaluates a Jacobian and LU-factorises the
Newton matrix: at least one Jacobian and one factorisation per step, none kept across
steps. `ReuseJacobian(solver)` keeps the factorisation in the solver state and reuses it
in later steps until CVODE's conditions ask for a fresh one.

How it plugs in (diffrax's public extension points only): the wrapper is an
`AbstractWrappedSolver` whose solver state carries the factorisation; its `step` runs the
wrapped solver with its `root_finder` replaced by `_StoredChord`, an optimistix root
finder that iterates with the stored factors instead of linearising in `init`.

`import memox` does not import this module (nor diffrax): `import memox.diffrax`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Int, PyTree, Real


_NO_DIFFRAX = (
    "`memox.diffrax` needs diffrax (and its dependencies optimistix and lineax), which "
    'is not installed. Install it with `pip install "memox[diffrax]"`.'
)

try:
    import diffrax
    import lineax as lx
    import optimistix as optx
except ImportError as error:
    raise ImportError(_NO_DIFFRAX) from error


_UNSUPPORTED_SOLVER = (
    "`memox.diffrax.ReuseJacobian` supports `diffrax.ImplicitEuler` and the diagonally "
    "implicit Runge--Kutta solvers with one tableau and one nonzero diagonal "
    "coefficient (`diffrax.Kvaerno3`, `Kvaerno4`, `Kvaerno5`); got `{name}`. {why}"
)
_UNSUPPORTED_ROOT_FINDER = (
    "`memox.diffrax.ReuseJacobian`: the wrapped solver's `root_finder` must be a chord "
    "method (`diffrax.VeryChord` or `optimistix.Chord`, the defaults), whose Newton "
    "matrix is fixed during a root find; got `{name}`. Keep the solver's default "
    "`root_finder`."
)
_UNSUPPORTED_LINEAR_SOLVER = (
    "`memox.diffrax.ReuseJacobian`: the root finder's `linear_solver` must factorise "
    "the Newton matrix once and solve with the factors later (`lineax.AutoLinearSolver`, "
    "`LU`, `QR` or `SVD`); got `{name}`."
)
_FACTORISING = (lx.AutoLinearSolver, lx.LU, lx.QR, lx.SVD)
_NOT_AN_ODE = (
    "`memox.diffrax.ReuseJacobian` supports ordinary differential equations "
    "(`diffrax.ODETerm`): the control of a step must be the scalar `t1 - t0`, but "
    "`terms.contr(t0, t1)` has shape {shape}."
)


class ReuseState(eqx.Module):
    """The solver state of [`memox.diffrax.ReuseJacobian`][].

    Read it from `diffeqsolve(..., saveat=diffrax.SaveAt(..., solver_state=True))` as
    `sol.solver_state`. The counters cover the steps diffrax accepted: diffrax resets
    the solver state after a rejected step (`sol.stats["num_rejected_steps"]` counts
    those), so a factorisation made in a rejected step is neither kept nor counted.

    - `inner`: the wrapped solver's own state.
    - `factor`: the arrays of the linear solver's factorisation of the Newton matrix
        `I - γh J` (for the default linear solver: LU factors and pivots).
    - `gamma_h`: the `γh` it was factorised for.
    - `age`: how many steps it has served (`max_age` initially: the first step
        factorises).
    - `factorisations`: accepted steps that evaluated `J` and factorised (one Jacobian
        evaluation and one factorisation each).
    - `reuses`: accepted steps that used a factorisation made in an earlier step.
        `factorisations + reuses` is the number of accepted steps.
    - `retries`: steps whose Newton iteration failed with a reused factorisation and
        were run again with a fresh one (counted in `factorisations` too).
    """

    inner: PyTree
    factor: PyTree[Array]
    gamma_h: Real[Array, ""]
    age: Int[Array, ""]
    factorisations: Int[Array, ""]
    reuses: Int[Array, ""]
    retries: Int[Array, ""]


class _ChordState(eqx.Module):
    f: PyTree[Array]
    diff: PyTree[Array]
    diffsize: Real[Array, ""]
    diffsize_prev: Real[Array, ""]
    result: optx.RESULTS
    step: Int[Array, ""]


class _StoredChord(optx.AbstractRootFinder):
    """The chord method with a Newton matrix factorised earlier (`factor`), where
    `optimistix.Chord` and `diffrax.VeryChord` linearise and factorise in `init`.

    The function whose root is found has Jacobian `sign * (I - γh J)`, or the identity
    at the explicit stages of an ESDIRK method (diffrax passes the stage index as the
    first element of `args` so that root finders can tell the stages apart)."""

    rtol: float
    atol: float
    norm: Callable[[PyTree], Array]
    kappa: float
    cauchy_termination: bool
    linear_solver: lx.AbstractLinearSolver
    factor: PyTree  # the linear solver's state: arrays and static structure
    sign: float
    rescale: Real[Array, ""]  # CVODE's `2 / (1 + γh / γh_old)` for a stale `γh`
    explicit_stages: tuple[int, ...]

    def init(self, fn, y, args, options, f_struct, aux_struct, tags) -> _ChordState:
        del fn, args, options, aux_struct, tags
        dtype = jnp.result_type(*jtu.tree_leaves(f_struct))
        return _ChordState(
            f=jtu.tree_map(lambda s: jnp.full(s.shape, jnp.inf, s.dtype), f_struct),
            diff=jtu.tree_map(lambda x: jnp.full(x.shape, jnp.inf, x.dtype), y),
            diffsize=jnp.array(jnp.inf, dtype),
            diffsize_prev=jnp.array(1.0, dtype),
            result=optx.RESULTS.successful,
            step=jnp.array(0),
        )

    def step(self, fn, y, args, options, state, tags):
        del options, tags
        fx, aux = fn(y, args)
        diff, result, _ = self.linear_solver.compute(lax.stop_gradient(self.factor), fx, {})
        diff = jtu.tree_map(lambda d: (self.sign * self.rescale).astype(d.dtype) * d, diff)
        if self.explicit_stages:
            explicit = jnp.isin(args[0], jnp.asarray(self.explicit_stages))
            diff = jtu.tree_map(lambda d, f: jnp.where(explicit, f, d), diff, fx)
        new_y = jtu.tree_map(lambda a, b: a - b, y, diff)
        with jax.numpy_dtype_promotion("standard"):
            scale = jtu.tree_map(lambda x: self.atol + self.rtol * jnp.abs(x), new_y)
            diffsize = self.norm(jtu.tree_map(lambda d, s: d / s, diff, scale))
        new_state = _ChordState(
            f=fx,
            diff=diff,
            diffsize=jnp.asarray(diffsize, state.diffsize.dtype),
            diffsize_prev=state.diffsize,
            result=optx.RESULTS.promote(result),
            step=state.step + 1,
        )
        return new_y, new_state, aux

    def terminate(self, fn, y, args, options, state, tags):
        del fn, args, options, tags
        if self.cauchy_termination:  # as `optimistix.Chord`'s default
            with jax.numpy_dtype_promotion("standard"):
                y_scale = jtu.tree_map(lambda x: self.atol + self.rtol * jnp.abs(x), y)
                y_diff = self.norm(jtu.tree_map(lambda d, s: jnp.abs(d) / s, state.diff, y_scale))
                f_size = self.norm(jtu.tree_map(lambda f: jnp.abs(f) / self.atol, state.f))
            terminate = (y_diff < 1) & (f_size < 1)
            result = optx.RESULTS.successful
        else:  # as `diffrax.VeryChord` (Hairer & Wanner, IV.8)
            at_least_two = state.step >= 2
            rate = state.diffsize / state.diffsize_prev
            factor = state.diffsize * rate / (1 - rate)
            small = state.diffsize < 10 ** (2 - jnp.finfo(state.diffsize.dtype).precision)
            diverged = ~jnp.isfinite(rate) | (rate > 2)
            converged = (factor > 0) & (factor < self.kappa)
            terminate = at_least_two & (small | diverged | converged)
            # Failure on divergence only: an iteration that converges slowly goes on,
            # up to the solver's `root_find_max_steps`. diffrax <= 0.7.2 also failed
            # one that had not converged after two iterations (fixed upstream by
            # diffrax#754 and optimistix#230).
            result = optx.RESULTS.where(
                at_least_two & ~small & diverged,
                optx.RESULTS.nonlinear_divergence,
                optx.RESULTS.successful,
            )
        linsolve_fail = state.result != optx.RESULTS.successful
        result = optx.RESULTS.where(linsolve_fail, state.result, result)
        return terminate | linsolve_fail, result

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        return y, aux, {}


# Validated by `ReuseJacobian.__check_init__` with a message that says what to do; typed
# for static checkers only, so that a run-time type checker does not answer first.
if TYPE_CHECKING:
    _Solver = diffrax.AbstractImplicitSolver
else:
    _Solver = Any


class ReuseJacobian(diffrax.AbstractWrappedSolver):
    """Wraps an implicit diffrax solver so that it reuses the factorised Newton matrix
    `I - γh J` across steps, refreshing it as CVODE does.

    diffrax's implicit solvers evaluate the Jacobian `J` of the vector field and
    LU-factorise `I - γh J` (`h` the step size, `γ` the method's diagonal coefficient)
    at every step. This wrapper evaluates `J` at the start of a step, factorises, keeps
    the factorisation in the solver state, and reuses it in later steps until

    - the step size changes `γh` by more than `gamma_drift` relative to the `γh` it was
        factorised for (CVODE's `dgmax`; while it is reused, each Newton update is
        scaled by `2 / (1 + γh / γh_old)`, as CVODE does);
    - it has served `max_age` steps (CVODE's `msbp`);
    - or the Newton iteration fails with it: the step is then run again at once with a
        fresh factorisation (as CVODE does), so that a stale matrix never shrinks the
        step.

    Error control, step-size selection and the Newton convergence test stay the wrapped
    solver's (the test with the fix of diffrax#754: a converging iteration may run up
    to `root_find_max_steps`). Gradients are the wrapped solver's too: optimistix
    differentiates the root find by the implicit function theorem at the root,
    whichever matrix found it.

    Worth it when a factorisation costs more than a few evaluations of the vector
    field (systems of more than a few dozen unknowns): a reused matrix needs more
    Newton iterations, each one evaluation. Each figure below is LU factorisations
    (rejected steps included) per accepted step, and names what it is measured
    against; all use a `PIDController`, float64.

    - Against the same `Kvaerno5` without the wrapper, with the same Newton convergence
        test ("fixed chord": diffrax's chord iteration with the fix of diffrax#754), at
        rtol 1e-6 (benchmark s9, `benchmarks/results/2026-11-23-cpu.md`): on a
        2048-unknown Brusselator 0.50 instead of 2, in 0.46x the wall time; on
        Robertson, Van der Pol and HIRES (2-8 unknowns) 0.51-0.73 instead of 2-2.9, in
        1.0-1.7x the wall time (an LU that small costs less than the extra Newton
        iterations). diffrax's controller changes the step size at every step, so about
        every other step still refactorises.
    - Lower orders take smaller steps and reuse more (the solves of
        `tests/test_diffrax.py`): on HIRES at rtol 1e-6, `Kvaerno4` 0.25 and `Kvaerno3`
        0.10, against 2.2 and 2.1 with the fixed chord test; `ImplicitEuler` (with an
        `optimistix.Chord` root finder) on Van der Pol and HIRES at rtol 1e-4, 0.08
        against 1.04-1.07 without the wrapper.
    - Against diffrax 0.7.2's default `Kvaerno5` (its unfixed chord test rejects steps
        that would converge: 3.7-4.4 per accepted step in s9), the wrapper takes 0.10x
        its wall time on the Brusselator, mostly from the fixed test: the fixed chord
        solver alone takes 0.21x.

    **Arguments:**

    - `solver`: `diffrax.ImplicitEuler()`, `diffrax.Kvaerno3/4/5()`, or another
        single-tableau SDIRK/ESDIRK solver, with a chord root finder (the default).
        Its root finder's tolerances, norm and linear solver are used.
    - `max_age`: the most steps one factorisation serves (CVODE's `msbp`: 20).
    - `gamma_drift`: the largest relative change of `γh` for which the factorisation
        is reused (CVODE's `dgmax`: 0.3).

    The solver state is a [`memox.diffrax.ReuseState`][], with counters of the
    factorisations (= Jacobian evaluations), reuses and retries.

    !!! Example

        ```python
        import diffrax, jax.numpy as jnp
        import memox.diffrax

        def robertson(t, y, args):
            y1, y2, y3 = y
            return jnp.stack([-0.04 * y1 + 1e4 * y2 * y3,
                              0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2, 3e7 * y2**2])

        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(robertson),
            memox.diffrax.ReuseJacobian(diffrax.Kvaerno5()),
            t0=0.0, t1=100.0, dt0=1e-4, y0=jnp.array([1.0, 0.0, 0.0]),
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-9),
            saveat=diffrax.SaveAt(t1=True, solver_state=True),
        )
        state = sol.solver_state  # memox.diffrax.ReuseState
        state.factorisations, state.reuses, sol.stats["num_accepted_steps"]
        ```
    """

    solver: _Solver  # pyright: ignore[reportIncompatibleVariableOverride]
    max_age: int = eqx.field(static=True, default=20)
    gamma_drift: float = eqx.field(static=True, default=0.3)

    def __check_init__(self):
        _newton_form(self.solver)  # raises for an unsupported solver
        rf = self.solver.root_finder
        if not isinstance(rf, (optx.Chord, diffrax.VeryChord)):
            raise TypeError(_UNSUPPORTED_ROOT_FINDER.format(name=type(rf).__name__))
        if not isinstance(rf.linear_solver, _FACTORISING):
            name = type(rf.linear_solver).__name__
            raise TypeError(_UNSUPPORTED_LINEAR_SOLVER.format(name=name))

    # -- forwarded to the wrapped solver (as `diffrax.HalfSolver` does) -------------
    @property
    def term_structure(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.solver.term_structure

    @property
    def interpolation_cls(self):  # pyright: ignore
        return self.solver.interpolation_cls

    @property
    def term_compatible_contr_kwargs(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.solver.term_compatible_contr_kwargs

    @property
    def root_finder(self):  # `diffeqsolve` sets its tolerances from the controller's
        return self.solver.root_finder

    @property
    def root_find_max_steps(self):
        return self.solver.root_find_max_steps

    @property
    def scan_kind(self):  # set by diffrax's adjoints on Runge--Kutta solvers
        return getattr(self.solver, "scan_kind")  # noqa: B009 (Runge--Kutta solvers only)

    def order(self, terms):
        return self.solver.order(terms)

    def strong_order(self, terms):
        return self.solver.strong_order(terms)

    def error_order(self, terms):
        return self.solver.error_order(terms)

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)

    # -- the reuse ------------------------------------------------------------------
    def init(self, terms, t0, t1, y0, args) -> ReuseState:
        shapes, _ = _partition(eqx.filter_eval_shape(self._factorise, terms, t0, t1, y0, args))
        zero = jnp.array(0, jnp.int32)
        return ReuseState(
            inner=self.solver.init(terms, t0, t1, y0, args),
            factor=jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            gamma_h=jnp.zeros((), jnp.result_type(*jtu.tree_leaves(y0))),
            age=jnp.array(self.max_age, jnp.int32),
            factorisations=zero,
            reuses=zero,
            retries=zero,
        )

    def step(self, terms, t0, t1, y0, args, solver_state: ReuseState, made_jump):
        state = solver_state
        control = terms.contr(t0, t1)
        if jnp.shape(control) != ():
            raise ValueError(_NOT_AN_ODE.format(shape=jnp.shape(control)))
        gamma, _, _ = _newton_form(self.solver)
        gamma_h = jnp.asarray(gamma * control, state.gamma_h.dtype)
        _, static = _partition(eqx.filter_eval_shape(self._factorise, terms, t0, t1, y0, args))

        def attempt(refresh: Bool[Array, ""]):
            """One run of the wrapped solver's step, with a fresh factorisation or not."""

            def fresh():
                return _partition(self._factorise(terms, t0, t1, y0, args))[0]

            factor = lax.cond(refresh, fresh, lambda: state.factor)
            with jax.numpy_dtype_promotion("standard"):
                ratio = gamma_h / jnp.where(refresh, gamma_h, state.gamma_h)
            rescale = lax.stop_gradient(2 / (1 + ratio))
            solver = self._with_factor(eqx.combine(factor, static), rescale)
            return factor, solver.step(terms, t0, t1, y0, args, state.inner, made_jump)

        with jax.numpy_dtype_promotion("standard"):
            drift = jnp.abs(gamma_h - state.gamma_h) > self.gamma_drift * jnp.abs(state.gamma_h)
        # Under `vmap`, one decision for the whole batch keeps each `cond` a branch.
        refresh = eqxi.unvmap_any((state.age >= self.max_age) | drift)
        factor, out = attempt(refresh)
        failed = out[-1] != diffrax.RESULTS.successful
        retry = eqxi.unvmap_any(failed & ~refresh)  # a stale matrix failed: once more
        factor, out = lax.cond(retry, lambda: attempt(jnp.array(True)), lambda: (factor, out))
        y1, y_error, dense_info, inner_state, result = out
        new = refresh | retry
        one = jnp.array(1, jnp.int32)
        new_state = ReuseState(
            inner=inner_state,
            factor=factor,
            gamma_h=jnp.where(new, gamma_h, state.gamma_h),
            age=jnp.where(new, one, state.age + 1),
            factorisations=state.factorisations + new.astype(jnp.int32),
            reuses=state.reuses + (~new).astype(jnp.int32),
            retries=state.retries + retry.astype(jnp.int32),
        )
        return y1, y_error, dense_info, new_state, result

    def _factorise(self, terms, t0, t1, y0, args):
        """The linear solver's state for `I - γh J(t0, y0)`: `J` by forward mode."""
        gamma, _, _ = _newton_form(self.solver)
        terms, t0, t1, y0, args = _stop_gradient((terms, t0, t1, y0, args))
        control = terms.contr(t0, t1)

        def newton_fn(k, _):  # k - γ f(t0, y0 + k) h: its Jacobian at 0 is I - γh J
            f = terms.vf_prod(t0, jtu.tree_map(jnp.add, y0, k), args, control)
            return jtu.tree_map(lambda k_, f_: k_ - gamma * f_, k, f)

        zeros = jtu.tree_map(jnp.zeros_like, y0)
        operator = lx.JacobianLinearOperator(newton_fn, zeros, None)
        return _chord(self.solver).linear_solver.init(operator, {})

    def _with_factor(self, factor, rescale):
        """The wrapped solver, its root finder replaced by one that uses `factor`."""
        _, sign, explicit = _newton_form(self.solver)
        rf = _chord(self.solver)
        stored = _StoredChord(
            rtol=rf.rtol,
            atol=rf.atol,
            norm=rf.norm,
            kappa=rf.kappa,
            cauchy_termination=getattr(rf, "cauchy_termination", False),
            linear_solver=rf.linear_solver,
            factor=factor,
            sign=sign,
            rescale=rescale,
            explicit_stages=explicit,
        )
        return eqx.tree_at(lambda s: s.root_finder, self.solver, stored)


def _chord(solver) -> optx.Chord | diffrax.VeryChord:
    return solver.root_finder  # checked in `ReuseJacobian.__check_init__`


def _stop_gradient(tree):
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    return eqx.combine(lax.stop_gradient(dynamic), static)


def _partition(tree):
    """Arrays (or their shapes) and the rest: only arrays may pass through `cond`."""
    return eqx.partition(tree, lambda x: isinstance(x, (jax.Array, jax.ShapeDtypeStruct)))


def _newton_form(solver) -> tuple[float, float, tuple[int, ...]]:
    """`(γ, sign, explicit stages)`: the stage equations of `solver` have Newton matrix
    `sign * (I - γh J)`, except at its explicit stages (the identity)."""
    name = type(solver).__name__
    if isinstance(solver, diffrax.AbstractWrappedSolver):  # `isinstance` sees through it
        why = "Wrap the implicit solver itself, not a wrapper around it."
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why=why))
    if isinstance(solver, diffrax.ImplicitEuler):
        return 1.0, -1.0, ()  # the root of `f(t1, y0 + z) h - z`: Jacobian `-(I - hJ)`
    if not isinstance(solver, diffrax.AbstractRungeKutta):
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why="It is not one of them."))
    tableau = solver.tableau
    if not isinstance(tableau, diffrax.ButcherTableau):
        why = "It has several tableaus (an IMEX method)."
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why=why))
    if tableau.a_diagonal is None:
        why = "It is explicit: it factorises nothing."
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why=why))
    diagonal = np.asarray(tableau.a_diagonal)
    values = set(diagonal[diagonal != 0].tolist())
    if len(values) != 1:
        why = f"Its diagonal coefficients {diagonal.tolist()} differ between stages."
        raise TypeError(_UNSUPPORTED_SOLVER.format(name=name, why=why))
    explicit = tuple(int(i) for i in np.flatnonzero(diagonal == 0))
    return float(values.pop()), 1.0, explicit  # `k - f(yp + γ k) h`: `I - γhJ`
