"""`memox.stats` reports FLOPs of one computation and FLOPs saved by hits."""

import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


# -- batched modules ---------------------------------------------------------------------
#
# Regression (issue 18): `memox.stats` planned the method on the whole batched module: a
# method that is not batch-polymorphic raised, and an elementwise one reported the batch's
# FLOPs. Counts are per element, and `flops` is the FLOPs of one element's computation.


class Gram(eqx.Module):
    w: jax.Array  # (n, k)
    gram_cache: Memo[jax.Array] = Memo()
    scaled_cache: Memo[jax.Array] = Memo()

    @memox.cached("gram_cache")
    def gram(self):
        return self.w.T @ self.w  # (`.T` reverses every axis: a batched `w` fails)

    @memox.cached("scaled_cache")
    def scaled(self):
        return jnp.tanh(2.0 * self.w)  # elementwise: a batched `w` would count the batch


def _called(model, times):
    for _ in range(times):
        _, model = memox.call(model, lambda m: (m.gram(), m.scaled()))
    return model


def _stack(models):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *models)


@pytest.mark.parametrize("batch", [(3,), (2, 3)])
def test_stats_of_a_batched_module_are_per_element(batch):
    n = math.prod(batch)
    ws = jnp.arange(n * 4 * 3, dtype=jnp.float32).reshape(n, 4, 3)
    singles = [_called(Gram(w), times=1 + i) for i, w in enumerate(ws)]  # i + 1 calls each
    batched = jax.tree.map(lambda x: x.reshape(*batch, *x.shape[1:]), _stack(singles))
    got = memox.stats(batched)
    for name, one in memox.stats(singles[0]).items():
        assert got[name].flops == one.flops  # one element's computation
        assert got[name].flops_unknown == one.flops_unknown
        hits = jnp.stack([memox.stats(s)[name].hits for s in singles]).reshape(batch)
        misses = jnp.stack([memox.stats(s)[name].misses for s in singles]).reshape(batch)
        np.testing.assert_array_equal(got[name].hits, hits)
        np.testing.assert_array_equal(got[name].misses, misses)
        np.testing.assert_array_equal(got[name].flops_saved, hits * one.flops)
    assert got["gram_cache"].flops == 2 * 3 * 3 * 4
    assert got["scaled_cache"].flops == 2 * 4 * 3


@pytest.mark.parametrize("vmap", ["eqx.filter_vmap", "jax.vmap"])
def test_stats_of_vmapped_calls(vmap):
    ws = jnp.arange(5 * 4 * 3, dtype=jnp.float32).reshape(5, 4, 3)
    models = eqx.filter_vmap(lambda w: memox.init(Gram(w)))(ws)
    call = lambda m: memox.call(m, lambda m: (m.gram(), m.scaled()))[1]  # noqa: E731
    call = eqx.filter_vmap(call) if vmap == "eqx.filter_vmap" else jax.vmap(call)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memox.UncachedWarning)  # (batched dependencies)
        for _ in range(2):
            models = call(models)
    got = memox.stats(models)
    one = memox.stats(_called(Gram(ws[0]), times=2))
    for name in ("gram_cache", "scaled_cache"):
        assert got[name].flops == one[name].flops
        assert got[name].hits.shape == got[name].misses.shape == (5,)
        # Each call decided once per element: a hit or a miss.
        np.testing.assert_array_equal(got[name].hits + got[name].misses, 2)
