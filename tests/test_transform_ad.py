"""`jax.grad`, `jax.jvp`, `jax.vjp` and `jax.hessian` through `memox.call`: equal to the
unmemoized computation on a hit and on a miss; frozen dependencies recompute nothing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Kernel, gp_loss, gram

import memox


N = 4


def _memo(k, s, y):
    """The loss through the cache, as a function of `log_scale` and `y`."""
    L, _ = memox.call(eqx.tree_at(lambda t: t.log_scale, k, s), Kernel.chol)
    return gp_loss(L, y)


def _plain(k, s, y):
    return gp_loss(jnp.linalg.cholesky(gram(k.x, s)), y)


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


X = np.random.default_rng(0).normal(size=(N, 2)).astype(np.float32)
Y = np.linspace(-1, 1, N, dtype=np.float32)


def _kernel(state="miss"):
    c = Counter()
    k = memox.init(Kernel(jnp.asarray(X), jnp.float32(0.3), c))
    if state == "hit":
        k = _fill(k)
    return k, c


@jax.jit
def _fill(k):
    return memox.call(k, Kernel.chol)[1]


OPS = ["grad", "jvp", "vjp", "hessian"]


@pytest.mark.parametrize("wrt", ["log_scale", "y"])
@pytest.mark.parametrize("op", OPS)
def test_equals_unmemoized_on_miss_and_on_hit(op, wrt):
    k, c = _kernel("miss")
    argnum = 0 if wrt == "log_scale" else 1
    traces = 0

    @jax.jit
    def run(k, s, y):
        nonlocal traces
        traces += 1
        return _apply(op, lambda s, y: _memo(k, s, y), argnum, s, y)

    ref = jax.jit(lambda k, s, y: _apply(op, lambda s, y: _plain(k, s, y), argnum, s, y))
    expected = ref(k, k.log_scale, Y)
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
    assert traces == 1


def test_value_stored_under_grad_is_a_hit_afterwards():
    # Differentiated dependencies on a miss: the value computed under `grad` is stored,
    # and the module returned as auxiliary output hits on the next plain call.
    k, c = _kernel("miss")
    y = jnp.asarray(Y)

    def loss(k):
        L, k = memox.call(k, Kernel.chol)
        return gp_loss(L, y), k

    (_, k), g = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(k)
    g_ref = jax.jit(jax.grad(_plain, argnums=1))(k, k.log_scale, y)
    np.testing.assert_allclose(g.log_scale, g_ref, rtol=2e-5)
    assert c.n == 1
    _, k = memox.call(k, Kernel.chol)
    stats = memox.stats(k)["chol_cache"]
    assert c.n == 1 and (stats.hits, stats.misses) == (1, 1)
