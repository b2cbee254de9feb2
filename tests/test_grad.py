"""`jax.grad`, `jax.jvp`, `jax.vjp` and `jax.hessian` through `memox.call`: equal to the
unmemoized computation on a hit and on a miss; frozen dependencies recompute nothing;
slots are never differentiated."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Kernel, Traces, gp_loss, gram, hits_and_misses

import memox
from memox import Memo


N = 4
X = np.random.default_rng(0).normal(size=(N, 2)).astype(np.float32)
Y = np.linspace(-1, 1, N, dtype=np.float32)


def _kernel(counter=None):
    return Kernel(jnp.asarray(X), jnp.float32(0.3), counter or Counter())


def _loss_memo(k, y):
    """The loss through the cache, and the module `memox.call` returns."""
    L, k = memox.call(k, Kernel.chol)
    return gp_loss(L, y), k


def _memo(k, s, y):
    """The loss through the cache, as a function of `log_scale` and `y`."""
    return _loss_memo(eqx.tree_at(lambda t: t.log_scale, k, s), y)[0]


def _loss_plain(x, log_scale, y):
    return gp_loss(jnp.linalg.cholesky(gram(x, log_scale)), y)


@jax.jit
def _fill(k):
    return memox.call(k, Kernel.chol)[1]


# -- eager ------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["miss", "hit"])
def test_grad_with_respect_to_the_module_equals_unmemoized(state):
    k = _kernel()
    y = jnp.asarray(Y)
    if state == "hit":
        _, k = memox.call(k, Kernel.chol)
        assert bool(k.chol_cache.valid)
    grads = eqx.filter_grad(lambda k: _loss_memo(k, y)[0])(k)
    gx, gs = jax.grad(_loss_plain, argnums=(0, 1))(k.x, k.log_scale, y)
    np.testing.assert_allclose(grads.x, gx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads.log_scale, gs, rtol=1e-5)


def test_jvp_and_hessian_equal_unmemoized():
    k = _kernel()
    y = jnp.asarray(Y)
    _, k = memox.call(k, Kernel.chol)  # start from a hit

    def f_memo(s):
        return _memo(k, s, y)

    def f_plain(s):
        return _loss_plain(k.x, s, y)

    s = k.log_scale
    p1, t1 = jax.jvp(f_memo, (s,), (jnp.float32(1),))
    p2, t2 = jax.jvp(f_plain, (s,), (jnp.float32(1),))
    np.testing.assert_allclose((p1, t1), (p2, t2), rtol=1e-5)
    np.testing.assert_allclose(jax.hessian(f_memo)(s), jax.hessian(f_plain)(s), rtol=1e-4)


def test_differentiated_dependencies_recompute_and_store():
    c = Counter()
    k = _kernel(c)
    y = jnp.asarray(Y)
    (_, k2), _ = eqx.filter_value_and_grad(lambda k: _loss_memo(k, y), has_aux=True)(k)
    assert c.n == 1
    # The value computed under differentiation was stored: the next plain call hits.
    _, k2 = memox.call(k2, Kernel.chol)
    assert c.n == 1 and memox.stats(k2)["chol_cache"] == memox.SlotStats(hits=1, misses=1)


def test_grad_through_scan_equals_unmemoized():
    k = memox.init(_kernel())
    y = jnp.asarray(Y)

    def total(s):
        k0 = eqx.tree_at(lambda t: t.log_scale, k, s)

        def body(k, w):
            value, k = _loss_memo(k, w * y)
            return k, value

        return jax.lax.scan(body, k0, jnp.arange(1.0, 4.0))[1].sum()

    def total_plain(s):
        return sum(_loss_plain(k.x, s, w * y) for w in (1.0, 2.0, 3.0))

    np.testing.assert_allclose(
        jax.grad(total)(k.log_scale), jax.grad(total_plain)(k.log_scale), rtol=1e-4
    )


def test_slots_are_never_differentiated():
    k = _kernel()
    _, k = memox.call(k, Kernel.chol)
    grads = eqx.filter_grad(lambda k: _loss_memo(k, jnp.ones(N))[0])(k)
    assert all(x is None for x in jax.tree.leaves(grads.chol_cache, is_leaf=lambda x: x is None))


# -- compiled, each derivative ----------------------------------------------------------


def _apply(op, f, argnum, s, y):
    """`op` of `f(s, y)` w.r.t. argument `argnum`, as a tuple of arrays."""
    args = (s, y)
    t = jnp.ones_like(args[argnum])

    def g(z):
        return f(*(z if i == argnum else a for i, a in enumerate(args)))

    if op == "grad":
        return (jax.grad(g)(args[argnum]),)
    if op == "jvp":
        return jax.jvp(g, (args[argnum],), (t,))
    if op == "vjp":
        out, pullback = jax.vjp(g, args[argnum])
        return out, *pullback(jnp.float32(1))
    return (jax.hessian(g)(args[argnum]),)


@pytest.mark.parametrize("wrt", ["log_scale", "y"])
@pytest.mark.parametrize("op", ["grad", "jvp", "vjp", "hessian"])
def test_compiled_derivative_equals_unmemoized_on_miss_and_on_hit(op, wrt):
    c = Counter()
    k = memox.init(_kernel(c))
    argnum = 0 if wrt == "log_scale" else 1
    traces = Traces()

    @jax.jit
    def run(k, s, y):
        traces.tick()
        return _apply(op, lambda s, y: _memo(k, s, y), argnum, s, y)

    ref = jax.jit(lambda x, s, y: _apply(op, lambda s, y: _loss_plain(x, s, y), argnum, s, y))
    expected = ref(k.x, k.log_scale, Y)
    for state in ["miss", "hit"]:
        if state == "hit":
            k = _fill(k)
        before = c.n
        got = run(k, k.log_scale, Y)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5)
        if wrt == "y":
            # Frozen dependencies: a hit recomputes nothing; a miss computes once.
            assert c.n - before == (0 if state == "hit" else 1)
        else:
            # Differentiated dependencies: differentiated as if unmemoized, the value is
            # recomputed once whatever the slot holds (also under `jax.hessian`).
            assert c.n - before == 1
    if wrt == "y":  # other values of the frozen part's inputs: still nothing recomputed
        before = c.n
        run(k, k.log_scale, jnp.asarray(2 * Y))
        assert c.n == before
    assert traces.n == 1


def test_value_stored_under_compiled_grad_is_a_hit_afterwards():
    # Differentiated dependencies on a miss: the value computed under `grad` is stored,
    # and the module returned as auxiliary output hits on the next plain call.
    c = Counter()
    k = memox.init(_kernel(c))
    y = jnp.asarray(Y)
    (_, k), g = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda k: _loss_memo(k, y), has_aux=True)
    )(k)
    g_ref = jax.jit(jax.grad(_loss_plain, argnums=1))(k.x, k.log_scale, y)
    np.testing.assert_allclose(g.log_scale, g_ref, rtol=2e-5)
    assert c.n == 1
    _, k = memox.call(k, Kernel.chol)
    assert c.n == 1 and hits_and_misses(k, "chol_cache") == (1, 1)


def test_a_frozen_64_bit_dependency_read_with_x64_off_differentiates():
    # Found by the fuzzer (grad through `memox.scan` after an x64 op): the zero tangent of
    # a frozen dependency made under x64 was built with `jnp.zeros(shape, float64)`, which
    # JAX truncates with x64 off (a warning, an error here). It now has the primal's type.
    class Mixed(eqx.Module):
        wide: jax.Array
        w: jax.Array
        cache: Memo[jax.Array] = Memo()

        @memox.cached("cache")
        def value(self):
            return jnp.sin(self.w) * self.wide.astype(jnp.float32)

    with jax.enable_x64(True):
        wide = jnp.asarray([0.5, 0.25])
    model = memox.init(Mixed(wide, jnp.asarray([1.0, 2.0])))

    def loss(w, memoized):
        m = eqx.tree_at(lambda t: t.w, model, w)
        if memoized:
            return jnp.sum(memox.call(m, Mixed.value)[0])
        return jnp.sum(jnp.sin(w) * m.wide.astype(jnp.float32))

    got = jax.grad(loss)(model.w, True)
    np.testing.assert_allclose(got, jax.grad(loss)(model.w, False), rtol=1e-6)
