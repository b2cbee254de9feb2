"""The chord iteration: its convergence test with the fix of diffrax#754, once, and the
root finder that iterates with a Newton matrix factorised in an earlier step."""

from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
import optimistix as optx
from jax import lax
from jaxtyping import Array, Bool, Int, PyTree, Real


def chord_termination(state, kappa: float) -> tuple[Bool[Array, ""], optx.RESULTS]:
    """`diffrax.VeryChord`'s convergence test (Hairer & Wanner, IV.8) with the fix of
    diffrax#754 and optimistix#230: the iteration fails on divergence only, and one that
    converges slowly goes on, up to the solver's `root_find_max_steps` (diffrax <= 0.7.2
    also fails one that has not converged after two iterations).

    `state` holds the chord iteration's `step`, `diffsize`, `diffsize_prev` and the
    linear solve's `result`, as `diffrax.VeryChord`'s state does. Returns `(terminate,
    result)`, as `optimistix.AbstractRootFinder.terminate`."""
    at_least_two = state.step >= 2
    rate = state.diffsize / state.diffsize_prev
    factor = state.diffsize * rate / (1 - rate)
    small = state.diffsize < 10 ** (2 - jnp.finfo(state.diffsize.dtype).precision)
    diverged = ~jnp.isfinite(rate) | (rate > 2)
    converged = (factor > 0) & (factor < kappa)
    terminate = at_least_two & (small | diverged | converged)
    result = optx.RESULTS.where(
        at_least_two & ~small & diverged,
        optx.RESULTS.nonlinear_divergence,
        optx.RESULTS.successful,
    )
    linsolve_failed = state.result != optx.RESULTS.successful
    result = optx.RESULTS.where(linsolve_failed, state.result, result)
    return terminate | linsolve_failed, result


class FixedVeryChord(diffrax.VeryChord):
    """`diffrax.VeryChord` with the convergence test of diffrax#754: the chord iteration
    fails on divergence only.

    diffrax 0.7.2's `VeryChord` is the default root finder of `Kvaerno3/4/5` and
    `ImplicitEuler`. It also fails an iteration that has not converged after two
    iterations, so it rejects steps which would converge. Benchmark s9 measures the
    cost.

    This is the test of the root finder of [`memox.diffrax.ReuseJacobian`][]. It is the
    fair baseline for what reuse saves. It is also the faster solver on systems of a
    few unknowns, where a factorisation costs less than the Newton iterations reuse
    adds. A diffrax with the fix makes `diffrax.VeryChord` the same.

    **Arguments:**

    As `diffrax.VeryChord`'s: `rtol`, `atol` (set from the step-size controller by
    `diffrax.with_stepsize_controller_tols`, as diffrax's default root finder is),
    `norm`, `kappa` (the early convergence tolerance) and `linear_solver`.

    !!! Example

        ```python
        import diffrax
        import memox.diffrax

        # diffrax.Kvaerno5() with the fixed test (its tolerances from the controller's)
        chord = diffrax.with_stepsize_controller_tols(memox.diffrax.FixedVeryChord)()
        solver = diffrax.Kvaerno5(root_finder=chord)
        ```
    """

    def terminate(self, fn, y, args, options, state, tags):
        return chord_termination(state, self.kappa)


class ChordState(eqx.Module):
    f: PyTree[Array]
    diff: PyTree[Array]
    diffsize: Real[Array, ""]
    diffsize_prev: Real[Array, ""]
    result: optx.RESULTS
    step: Int[Array, ""]


class StoredChord(optx.AbstractRootFinder):
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

    def init(self, fn, y, args, options, f_struct, aux_struct, tags) -> ChordState:
        del fn, args, options, aux_struct, tags
        dtype = jnp.result_type(*jtu.tree_leaves(f_struct))
        return ChordState(
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
        new_state = ChordState(
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
        if not self.cauchy_termination:  # as `diffrax.VeryChord`, fixed
            return chord_termination(state, self.kappa)
        # as `optimistix.Chord`'s default
        with jax.numpy_dtype_promotion("standard"):
            y_scale = jtu.tree_map(lambda x: self.atol + self.rtol * jnp.abs(x), y)
            y_diff = self.norm(jtu.tree_map(lambda d, s: jnp.abs(d) / s, state.diff, y_scale))
            f_size = self.norm(jtu.tree_map(lambda f: jnp.abs(f) / self.atol, state.f))
        linsolve_failed = state.result != optx.RESULTS.successful
        return ((y_diff < 1) & (f_size < 1)) | linsolve_failed, state.result

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        return y, aux, {}
