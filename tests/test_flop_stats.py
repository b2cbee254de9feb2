"""`memox.stats` reports FLOPs of one computation and FLOPs saved by hits."""

import equinox as eqx
import jax
import jax.numpy as jnp

import memox
from memox import Memo


class Linear(eqx.Module):
    w: jax.Array  # (m, k)
    x: jax.Array  # (k, n)
    prod_cache: Memo[jax.Array] = Memo()
    chol_cache: Memo[jax.Array] = Memo()

    @memox.cached("prod_cache")
    def prod(self):
        return self.w @ self.x

    @memox.cached("chol_cache")
    def chol(self, scale):
        return jax.lax.linalg.cholesky(scale * self.w, symmetrize_input=False)


def test_matmul_flops_and_saved():
    m, k, n = 4, 5, 6
    model = Linear(jnp.ones((m, k)), jnp.ones((k, n)))
    for _ in range(3):
        _, model = memox.call(model, Linear.prod)
    s = memox.stats(model)["prod_cache"]
    assert s.flops == 2 * m * n * k
    assert s.flops_saved == 2 * 2 * m * n * k


def test_flops_of_a_method_with_arguments_and_linalg():
    n = 6
    model = Linear(jnp.eye(n), jnp.ones((n, 2)))
    for _ in range(3):
        _, model = memox.call(model, Linear.chol, jnp.float32(2.0))
    s = memox.stats(model)["chol_cache"]
    # The scaling, Cholesky (LAPACK: n^3 / 3), then lax's lower-triangle mask (an add, a
    # compare and a select per element).
    assert s.flops == n * n + n**3 // 3 + 3 * n * n
    assert s.flops_saved == 2 * s.flops
