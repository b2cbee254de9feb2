"""`ReuseJacobian`: an implicit diffrax solver that keeps its factorised Newton matrix in
its solver state and reuses it across steps, refreshing it as CVODE does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import diffrax
import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
from jax import lax
from jaxtyping import Array, Bool, Int, PyTree, Real

from ._chord import StoredChord
from ._solvers import check_supported, chord, newton_form


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

    !!! Example

        ```python
        import diffrax
        import memox.diffrax

        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: -100.0 * y),
            memox.diffrax.ReuseJacobian(diffrax.Kvaerno5()),
            t0=0.0, t1=1.0, dt0=0.01, y0=jnp.ones(2),
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-8),
            saveat=diffrax.SaveAt(t1=True, solver_state=True),
        )
        state = sol.solver_state
        assert state.factorisations + state.reuses == sol.stats["num_accepted_steps"]
        ```
    """

    inner: PyTree
    factor: PyTree[Array]
    gamma_h: Real[Array, ""]
    age: Int[Array, ""]
    factorisations: Int[Array, ""]
    reuses: Int[Array, ""]
    retries: Int[Array, ""]


# Validated by `ReuseJacobian.__check_init__` with a message that says what to do; typed
# for static checkers and the API reference only, so that a run-time type checker does
# not answer first.
if TYPE_CHECKING:
    from diffrax import AbstractImplicitSolver
else:
    AbstractImplicitSolver = Any


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
    solver's (the test with the fix of diffrax#754, as in
    [`memox.diffrax.FixedVeryChord`][]: a converging iteration may run up to
    `root_find_max_steps`). Gradients are the wrapped solver's too: optimistix
    differentiates the root find by the implicit function theorem at the root,
    whichever matrix found it.

    Worth it when a factorisation costs more than a few evaluations of the vector
    field: systems of more than a few dozen unknowns. A reused matrix needs more Newton
    iterations, each one evaluation. Lower orders take smaller steps and reuse more.
    Benchmark s9 measures it against the same solver without the wrapper; its figures
    are on the [performance](performance.md) page.

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
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-8),
            saveat=diffrax.SaveAt(t1=True, solver_state=True),
        )
        state = sol.solver_state  # a memox.diffrax.ReuseState
        print(state.factorisations, state.reuses)  # counts of accepted steps
        ```
    """

    solver: AbstractImplicitSolver  # pyright: ignore[reportIncompatibleVariableOverride]
    max_age: int = eqx.field(static=True, default=20)
    gamma_drift: float = eqx.field(static=True, default=0.3)

    def __check_init__(self):
        check_supported(self.solver)

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
        gamma, _, _ = newton_form(self.solver)
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
        gamma, _, _ = newton_form(self.solver)
        terms, t0, t1, y0, args = _stop_gradient((terms, t0, t1, y0, args))
        control = terms.contr(t0, t1)

        def newton_fn(k, _):  # k - γ f(t0, y0 + k) h: its Jacobian at 0 is I - γh J
            f = terms.vf_prod(t0, jtu.tree_map(jnp.add, y0, k), args, control)
            return jtu.tree_map(lambda k_, f_: k_ - gamma * f_, k, f)

        zeros = jtu.tree_map(jnp.zeros_like, y0)
        operator = lx.JacobianLinearOperator(newton_fn, zeros, None)
        return chord(self.solver).linear_solver.init(operator, {})

    def _with_factor(self, factor, rescale):
        """The wrapped solver, its root finder replaced by one that uses `factor`."""
        _, sign, explicit = newton_form(self.solver)
        rf = chord(self.solver)
        stored = StoredChord(
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


def _stop_gradient(tree):
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    return eqx.combine(lax.stop_gradient(dynamic), static)


def _partition(tree):
    """Arrays (or their shapes) and the rest: only arrays may pass through `cond`."""
    return eqx.partition(tree, lambda x: isinstance(x, (jax.Array, jax.ShapeDtypeStruct)))
