"""`memox.hoist`: cached values read once for a computation memox cannot see into (a
transformation opened inside `fn` that rebuilds the module: `eqx.filter_jit`, a loop, a
diffrax solve), at hand-hoisted cost and with exact gradients."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg
import numpy as np
import pytest
from helpers import Counter, reference

import memox
from memox import Memo


class Field(eqx.Module):
    """A vector field whose weight is an expensive transform of its parameters."""

    w: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def weight(self):
        self.counter.tick()
        return jax.scipy.linalg.expm(self.w - self.w.T)  # orthogonal: a stable flow

    def __call__(self, t, y, args):
        return -(self.weight() @ y) * 0.5


def _euler(field, y0, steps=20):
    """A solver that owns its loop (as diffrax does): `eqx.filter_jit` + a loop."""

    @eqx.filter_jit
    def run(field, y0):
        return jax.lax.fori_loop(0, steps, lambda i, y: y + 0.05 * field(0.0, y, None), y0)

    return run(field, y0)


def _model(counter):
    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32) * 0.3
    return memox.init(Field(w, counter))


Y0 = jnp.ones(4)


def test_without_hoist_the_solver_loop_computes_every_step_and_memox_warns():
    counter = Counter()
    model = _model(counter)
    with pytest.warns(memox.UncachedWarning, match=r"Pass `memox.hoist\(module\)` into"):
        memox.call(model, _euler, Y0)
    assert counter.n == 20


@pytest.mark.parametrize("placement", ["call", "jit"])
def test_hoisted_values_are_read_once_per_solve_and_reused_across_solves(placement):
    counter = Counter()
    model = _model(counter)
    solve = lambda m, y0: _euler(memox.hoist(m), y0)  # noqa: E731
    run = memox.jit(solve) if placement == "jit" else (lambda m, y0: memox.call(m, solve, y0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", memox.UncachedWarning)
        ys = []
        for _ in range(3):
            y, model = run(model, Y0)
            ys.append(y)
    with counter.paused():
        want = _euler(Field(model.w, counter), Y0)
    for y in ys:
        np.testing.assert_allclose(y, want, rtol=1e-6)
    assert counter.n == 1  # three solves, one computation
    assert memox.stats(model)["cache"].hits == 2
    moved = eqx.tree_at(lambda m: m.w, model, model.w * 1.1)
    _, moved = run(moved, Y0)
    jax.effects_barrier()  # (the count is a `jax.debug.callback`: wait for it)
    assert counter.n == 2  # a parameter moved: computed again


def test_gradients_through_a_hoisted_solve_are_exact():
    counter = Counter()
    model = _model(counter)

    def loss(w, model, hoisted):
        m = eqx.tree_at(lambda m: m.w, model, w)
        if not hoisted:
            return jnp.sum(_euler(m, Y0) ** 2)
        y, _ = memox.call(m, lambda m: _euler(memox.hoist(m), Y0))
        return jnp.sum(y**2)

    with counter.paused():
        want = jax.grad(loss)(model.w, model, False)
    got = jax.grad(loss)(model.w, model, True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_hoist_refuses_to_run_outside_a_call_and_hoisted_methods_take_no_arguments():
    model = _model(Counter())
    with pytest.raises(ValueError, match=r"`memox.hoist` reads cached values through the"):
        memox.hoist(model)
    with pytest.raises(TypeError, match=r"`memox.hoist\(module, \*methods\)`: .* is not a"):
        memox.call(model, lambda m: memox.hoist(m, Field.__call__))


def test_diffrax_neural_ode_with_hoist():
    diffrax = pytest.importorskip("diffrax")
    counter = Counter()
    model = _model(counter)

    def solve(m, y0):
        term = diffrax.ODETerm(memox.hoist(m))
        sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0)
        return sol.ys[-1]

    # diffrax 0.7.2 itself trips JAX's leak checker (a plain `diffeqsolve` does), so it is
    # off for this test.
    with warnings.catch_warnings(), jax.check_tracer_leaks(False):
        warnings.simplefilter("error", memox.UncachedWarning)
        for _ in range(2):
            y, model = memox.call(model, solve, Y0)
    assert counter.n == 1
    with counter.paused(), jax.check_tracer_leaks(False):
        want = diffrax.diffeqsolve(diffrax.ODETerm(model), diffrax.Tsit5(), 0.0, 1.0, 0.1, Y0).ys[
            -1
        ]
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_diffrax_training_step_computes_the_weight_once_per_step():
    # Reverse mode through diffrax's checkpointed adjoint (a neural-ODE training step,
    # examples/neural_ode.py): the backward pass reads the hoisted value too, so the
    # weight is computed once per step, and the losses and gradients are the unmemoized
    # field's (which computes it at every evaluation, forward and backward).
    diffrax = pytest.importorskip("diffrax")
    optax = pytest.importorskip("optax")
    counter = Counter()
    ts = jnp.linspace(0.0, 1.0, 3)

    def solve(field):
        term = diffrax.ODETerm(field)
        saveat = diffrax.SaveAt(ts=ts)
        return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.25, Y0, saveat=saveat).ys

    def memox_loss(model):
        ys, model = memox.call(model, lambda m: solve(memox.hoist(m)))
        return jnp.mean(ys**2), model

    def plain_loss(model):  # outside `memox.call`: `weight` computes at every evaluation
        return jnp.mean(solve(model) ** 2), model

    optim = optax.sgd(0.5)  # (adam's bias correction needs standard dtype promotion)

    def train(loss, steps=3):
        @eqx.filter_jit
        def step(model, opt_state):
            (value, model), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
            params = eqx.filter(model, eqx.is_inexact_array)
            updates, opt_state = optim.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state, value, grads

        model = _model(counter)
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        out = []
        for _ in range(steps):
            model, opt_state, value, grads = step(model, opt_state)
            out.append((value, grads.w))
        jax.effects_barrier()
        return model, out

    # diffrax 0.7.2 trips JAX's leak checker (see above).
    with jax.check_tracer_leaks(False):
        with counter.paused():
            _, want = train(plain_loss)
        model, got = train(memox_loss)
    assert counter.n == 3  # once per training step, backward pass included
    assert memox.stats(model)["cache"] == memox.SlotStats(hits=0, misses=3)  # w moved
    for (value, grad), (want_value, want_grad) in zip(got, want, strict=True):
        np.testing.assert_allclose(value, want_value, rtol=1e-6)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "adjoint", ["RecursiveCheckpointAdjoint", "BacksolveAdjoint", "DirectAdjoint"]
)
def test_diffrax_adjoints_differentiate_a_hoisted_value_exactly(adjoint):
    # Each of diffrax's adjoints sees the hoisted value as an array of the vector field
    # (BacksolveAdjoint differentiates the term's arrays by its own backward solve):
    # the gradient reaches `w` through memox's rule, equal to the unmemoized field's.
    diffrax = pytest.importorskip("diffrax")
    counter = Counter()

    def solve(field):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(field),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.25,
            Y0,
            saveat=diffrax.SaveAt(t1=True),
            adjoint=getattr(diffrax, adjoint)(),
        ).ys[-1]

    def memox_loss(model):
        y, model = memox.call(model, lambda m: solve(memox.hoist(m)))
        return jnp.sum(y**2), model

    # diffrax 0.7.2 trips JAX's leak checker (see above).
    with jax.check_tracer_leaks(False):
        with counter.paused():
            want = eqx.filter_grad(lambda m: jnp.sum(solve(m) ** 2))(_model(counter))
        got, model = eqx.filter_jit(eqx.filter_grad(memox_loss, has_aux=True))(_model(counter))
        jax.effects_barrier()
    assert counter.n == 1
    assert memox.stats(model)["cache"] == memox.SlotStats(hits=0, misses=1)
    np.testing.assert_allclose(got.w, want.w, rtol=1e-5, atol=1e-7)


def test_memox_call_inside_a_vector_field_on_a_fresh_module_warns():
    # diffrax traces the vector field with the module closed over; a `memox.call(self,
    # ...)` there stores into a module nobody returns: each evaluation computes. With its
    # slots not yet allocated memox can tell at trace time, and says so.
    diffrax = pytest.importorskip("diffrax")

    class CallingField(Field):
        def __call__(self, t, y, args):
            weight, _ = memox.call(self, Field.weight)
            return -(weight @ y) * 0.5

    counter = Counter()
    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32) * 0.3
    field = CallingField(w, counter)  # slots not allocated
    with (
        jax.check_tracer_leaks(False),  # diffrax 0.7.2 trips it (see above)
        pytest.warns(memox.UncachedWarning, match=r"closes over a module whose slots are not"),
    ):
        diffrax.diffeqsolve(diffrax.ODETerm(field), diffrax.Tsit5(), 0.0, 1.0, 0.1, Y0)
        jax.effects_barrier()
    assert counter.n > 10  # at every evaluation


# -- gradients taken inside `fn`, with respect to the hoisted view ---------------------
#
# Regression (issue 18): a differentiation opened inside `fn` on the view (the whole view,
# or only its parameters) reached the hoisted value as a constant read before it: the
# gradient through the cached value was zero, with no warning. memox now treats the value
# as the function of the view's arrays it is: where such a differentiation moves what the
# method reads, the method is differentiated on the view (it computes at each read, as the
# unmemoized code does), and the gradients are the unmemoized ones.


def _loss(field, where):
    if where == "eager":
        return _read_loss(field)
    if where == "filter_jit":
        return eqx.filter_jit(_read_loss)(field)
    return jnp.sum(_euler(field, Y0) ** 2)  # "loop": `eqx.filter_jit` + a solver loop


def _read_loss(field):
    return jnp.sum((field.weight() @ Y0) * jnp.arange(4.0))  # (the weight is orthogonal)


W_DIR = jnp.asarray(np.random.default_rng(1).normal(size=(4, 4)), jnp.float32)


def _with_w(field, w):
    return eqx.tree_at(lambda f: f.w, field, w)


# Each takes a loss and a field (the hoisted view, or a plain field) and returns the
# derivative of the loss along `w`: a gradient (4, 4), or a directional derivative.
DIFFERENTIATE = {
    "jax.grad": lambda loss, f: jax.grad(loss)(f).w,
    "eqx.filter_grad": lambda loss, f: eqx.filter_grad(loss)(f).w,
    "jax.grad (parameters only)": lambda loss, f: jax.grad(lambda w: loss(_with_w(f, w)))(f.w),
    "jax.vjp": lambda loss, f: jax.vjp(loss, f)[1](jnp.ones(()))[0].w,
    "jax.jvp": lambda loss, f: jax.jvp(
        loss, (f,), (_with_w(jax.tree.map(jnp.zeros_like, f), W_DIR),)
    )[1],
}


@reference()
def _unmemoized(how, where, model, counter):
    """The derivative with `weight` computed at every read (no slot is reached)."""
    plain = Field(model.w, counter)
    if how in ("jax.grad", "jax.vjp", "jax.jvp"):  # (an empty slot is no JAX type)
        if how == "jax.jvp":
            return jax.jvp(lambda w: _loss(_with_w(plain, w), where), (plain.w,), (W_DIR,))[1]
        how = "jax.grad (parameters only)"
    return DIFFERENTIATE[how](lambda f: _loss(f, where), plain)


WHERE = ["eager", "filter_jit", "loop"]
PLACEMENTS = ["call", "jit"]


def _pairwise() -> list:
    """Every (how, where, placement): by default a set holding each pair of them (each
    (how, where) once, its placement alternating), the rest under `-m heavy`."""
    return [
        pytest.param(how, where, placement, marks=() if (i + j) % 2 == k else pytest.mark.heavy)
        for i, how in enumerate(DIFFERENTIATE)
        for j, where in enumerate(WHERE)
        for k, placement in enumerate(PLACEMENTS)
    ]


@pytest.mark.parametrize(("how", "where", "placement"), _pairwise())
def test_gradients_inside_fn_with_respect_to_the_hoisted_view_are_exact(how, where, placement):
    counter = Counter()
    model = _model(counter)
    want = _unmemoized(how, where, model, counter)
    jax.effects_barrier()
    unmemoized, counter.n = counter.n, 0  # the unmemoized derivative's computations

    def fn(m):
        return DIFFERENTIATE[how](lambda f: _loss(f, where), memox.hoist(m))

    run = memox.jit(fn) if placement == "jit" else (lambda m: memox.call(m, fn))
    for step in range(2):
        before = counter.n
        got, model = run(model)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        jax.effects_barrier()
        # The hoist's one read (a miss, then a hit), and the method differentiated on the
        # view as many times as the unmemoized derivative computes it.
        assert counter.n - before == (1 if step == 0 else 0) + unmemoized
    assert memox.stats(model)["cache"] == memox.SlotStats(hits=1, misses=1)


@pytest.mark.parametrize("where", WHERE)
def test_a_hoist_inside_the_differentiated_function_reads_once(where):
    # Hoisted inside the gradient taken inside `fn`, the value is differentiated where it
    # is read (the memoised read's rule): every later read is free, gradients exact.
    counter = Counter()
    model = _model(counter)
    want = _unmemoized("eqx.filter_grad", where, model, counter)
    jax.effects_barrier()
    counter.n = 0

    def fn(m):
        return eqx.filter_grad(lambda m: _loss(memox.hoist(m), where))(m).w

    got, model = memox.call(model, fn)
    jax.effects_barrier()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert counter.n == 1


@pytest.mark.parametrize("where", WHERE)
def test_second_order_through_a_gradient_with_respect_to_the_view(where):
    # An outer gradient (outside the call; the value carries its derivative) of a
    # gradient taken inside `fn` with respect to the view (which differentiates the
    # method on the view): a Hessian-vector product, equal to the unmemoized one.
    counter = Counter()
    model = _model(counter)

    def inner(field):
        return jax.grad(lambda w: _loss(_with_w(field, w), where))(field.w)

    def memox_hvp(w):
        g, _ = memox.call(_with_w(model, w), lambda m: inner(memox.hoist(m)))
        return jnp.sum(g * W_DIR)

    with counter.paused():
        want = jax.grad(lambda w: jnp.sum(inner(Field(w, counter)) * W_DIR))(model.w)
    got = jax.grad(memox_hvp)(model.w)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("adjoint", ["RecursiveCheckpointAdjoint", "BacksolveAdjoint"])
@pytest.mark.parametrize("hoisted", ["inside", "outside"])
def test_diffrax_gradients_inside_fn_are_exact(adjoint, hoisted):
    # A gradient taken inside `fn` through diffrax's adjoints: hoisted inside the
    # differentiated function, the weight is computed once (the backward pass hands the
    # value's cotangent back to where it was read); with respect to the hoisted view, the
    # method is differentiated on the view where the backward pass reads it (at each
    # evaluation, never more often than the unmemoized field computes it). Exact either
    # way.
    diffrax = pytest.importorskip("diffrax")
    counter = Counter()

    def loss(field):
        return jnp.sum(
            diffrax.diffeqsolve(
                diffrax.ODETerm(field),
                diffrax.Tsit5(),
                0.0,
                1.0,
                0.25,
                Y0,
                saveat=diffrax.SaveAt(t1=True),
                adjoint=getattr(diffrax, adjoint)(),
            ).ys[-1]
            ** 2
        )

    def fn(m):
        if hoisted == "inside":
            return eqx.filter_grad(lambda m: loss(memox.hoist(m)))(m).w
        return eqx.filter_grad(loss)(memox.hoist(m)).w

    # diffrax 0.7.2 trips JAX's leak checker (see above).
    with jax.check_tracer_leaks(False):
        with reference():
            want = eqx.filter_grad(loss)(Field(_model(counter).w, counter)).w
        jax.effects_barrier()
        unmemoized, counter.n = counter.n, 0
        got, model = memox.call(_model(counter), fn)
        jax.effects_barrier()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    if hoisted == "inside":
        assert counter.n == 1
    else:
        assert 1 < counter.n <= 1 + unmemoized
