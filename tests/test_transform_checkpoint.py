"""`jax.checkpoint` (rematerialisation) around a loss that calls `memox.call`, and around
a `lax.scan` body with the module as the carry: gradients equal the unmemoized ones."""

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Kernel, gp_loss, gram
from jax import lax

import memox


N = 4
X = np.random.default_rng(0).normal(size=(N, 2)).astype(np.float32)
Y = np.linspace(-1, 1, N, dtype=np.float32)


def _memo(k, s, y):
    L, _ = memox.call(eqx.tree_at(lambda t: t.log_scale, k, s), Kernel.chol)
    return gp_loss(L, y)


def _plain(counter, x, s, y):
    counter.tick()
    return gp_loss(jnp.linalg.cholesky(gram(x, s)), y)


@jax.jit
def _fill(k):
    return memox.call(k, Kernel.chol)[1]


POLICIES = {"save nothing": None, "save dots": jax.checkpoint_policies.dots_saveable}


@pytest.mark.parametrize(
    "state, policy", [("miss", "save nothing"), ("hit", "save nothing"), ("hit", "save dots")]
)
def test_checkpointed_loss(state, policy):
    c = Counter()
    k = memox.init(Kernel(jnp.asarray(X), jnp.float32(0.3), c))
    if state == "hit":
        k = _fill(k)
    before = c.n
    loss = jax.checkpoint(lambda k, s, y: _memo(k, s, y), policy=POLICIES[policy])
    gs, gy = jax.jit(jax.grad(loss, argnums=(1, 2)))(k, k.log_scale, jnp.asarray(Y))
    c_plain = Counter()
    plain = jax.checkpoint(partial(_plain, c_plain, k.x), policy=POLICIES[policy])
    gs_ref, gy_ref = jax.jit(jax.grad(plain, argnums=(0, 1)))(k.log_scale, jnp.asarray(Y))
    np.testing.assert_allclose(gs, gs_ref, rtol=2e-5)
    np.testing.assert_allclose(gy, gy_ref, rtol=2e-5, atol=1e-6)
    # `log_scale` is differentiated: hit or miss, the method runs as often as the
    # unmemoized code (twice: the forward pass and its rematerialisation).
    assert c.n - before == c_plain.n == 2

    # Only `y` differentiated: the dependencies are frozen. A hit recomputes nothing; a
    # miss computes once.
    before = c.n
    gy = jax.jit(jax.grad(loss, argnums=2))(k, k.log_scale, jnp.asarray(Y))
    np.testing.assert_allclose(gy, gy_ref, rtol=2e-5, atol=1e-6)
    assert c.n - before == (0 if state == "hit" else 1)


def test_checkpointed_scan_body_with_the_module_as_carry():
    T = 4
    c = Counter()
    k0 = memox.init(Kernel(jnp.asarray(X), jnp.float32(0.3), c))

    def step(k, w):
        L, k = memox.call(k, Kernel.chol)
        return k, gp_loss(L, w * jnp.asarray(Y))

    body = jax.checkpoint(step)

    def total(s, ws):
        k = eqx.tree_at(lambda t: t.log_scale, k0, s)
        return lax.scan(body, k, ws)[1].sum()

    def total_plain(s, ws):
        L = jnp.linalg.cholesky(gram(k0.x, s))
        return sum(gp_loss(L, w * jnp.asarray(Y)) for w in ws)

    ws = jnp.arange(1.0, T + 1)
    g = jax.jit(jax.grad(total, argnums=(0, 1)))(k0.log_scale, ws)
    g_ref = jax.jit(jax.grad(total_plain, argnums=(0, 1)))(k0.log_scale, ws)
    np.testing.assert_allclose(g[0], g_ref[0], rtol=1e-4)
    np.testing.assert_allclose(g[1], g_ref[1], rtol=1e-4)
    # Only `ws` differentiated: the carried module's dependencies are frozen, so the
    # factor is computed at the first step and hit at every other one.
    # (JAX's leak checker reports a false positive for a `jax.debug.callback` inside a
    # `cond` inside a `scan` under `grad`, memox or not: counted runs turn it off.)
    before = c.n
    with jax.check_tracer_leaks(False):
        gw = jax.jit(jax.grad(total, argnums=1))(k0.log_scale, ws)
    np.testing.assert_allclose(gw, g_ref[1], rtol=1e-4)
    assert c.n - before == 1
