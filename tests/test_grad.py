"""Gradients through cached methods equal those of the unmemoized computation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Kernel, gp_loss, gram

import memox


def _kernel(counter=None):
    x = jax.random.normal(jax.random.key(0), (5, 2))
    return Kernel(x, jnp.float32(0.3), counter or Counter())


def _loss_memo(k, y):
    L, k = memox.call(k, Kernel.chol)
    return gp_loss(L, y), k


def _loss_plain(x, log_scale, y):
    return gp_loss(jnp.linalg.cholesky(gram(x, log_scale)), y)


@pytest.mark.parametrize("state", ["miss", "hit"])
def test_grad_equals_unmemoized(state):
    k = _kernel()
    y = jnp.linspace(-1, 1, 5)
    if state == "hit":
        _, k = memox.call(k, Kernel.chol)
        assert bool(k.chol_cache.valid)
    grads = eqx.filter_grad(lambda k: _loss_memo(k, y)[0])(k)
    gx, gs = jax.grad(_loss_plain, argnums=(0, 1))(k.x, k.log_scale, y)
    np.testing.assert_allclose(grads.x, gx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads.log_scale, gs, rtol=1e-5)


def test_jvp_and_hessian_equal_unmemoized():
    k = _kernel()
    y = jnp.linspace(-1, 1, 5)
    _, k = memox.call(k, Kernel.chol)  # start from a hit

    def f_memo(s):
        return _loss_memo(eqx.tree_at(lambda t: t.log_scale, k, s), y)[0]

    def f_plain(s):
        return _loss_plain(k.x, s, y)

    s = k.log_scale
    p1, t1 = jax.jvp(f_memo, (s,), (jnp.float32(1),))
    p2, t2 = jax.jvp(f_plain, (s,), (jnp.float32(1),))
    np.testing.assert_allclose((p1, t1), (p2, t2), rtol=1e-5)
    np.testing.assert_allclose(jax.hessian(f_memo)(s), jax.hessian(f_plain)(s), rtol=1e-4)


def test_frozen_dependencies_hit_under_grad_without_recomputing():
    c = Counter()
    k = _kernel(c)
    _, k = memox.call(k, Kernel.chol)
    assert c.n == 1
    y = jnp.linspace(-1, 1, 5)

    # Differentiate with respect to `y` only: the Cholesky factor's dependencies carry no
    # tangent, so the hit stands and nothing is recomputed.
    @jax.jit
    def grad_y(k, y):
        return jax.grad(lambda y: _loss_memo(k, y)[0])(y)

    g = grad_y(k, y)
    g_ref = jax.grad(lambda y: _loss_plain(k.x, k.log_scale, y))(y)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5)
    assert c.n == 1


def test_differentiated_dependencies_recompute_and_store():
    c = Counter()
    k = _kernel(c)
    y = jnp.linspace(-1, 1, 5)
    (_, k2), _ = eqx.filter_value_and_grad(lambda k: _loss_memo(k, y), has_aux=True)(k)
    assert c.n == 1
    # The value computed under differentiation was stored: the next plain call hits.
    _, k2 = memox.call(k2, Kernel.chol)
    assert c.n == 1 and memox.stats(k2)["chol_cache"] == memox.SlotStats(hits=1, misses=1)


def test_grad_through_scan_equals_unmemoized():
    k = memox.init(_kernel())
    y = jnp.linspace(-1, 1, 5)

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
    grads = eqx.filter_grad(lambda k: _loss_memo(k, jnp.ones(5))[0])(k)
    assert all(x is None for x in jax.tree.leaves(grads.chol_cache, is_leaf=lambda x: x is None))
