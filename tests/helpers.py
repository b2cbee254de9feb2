"""Shared test models and counters: real executions (not traces) and traces."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp

import memox
from memox import Memo


class Counter:
    """Counts real executions of the code that calls `tick()` (a `jax.debug.callback`)."""

    def __init__(self):
        self.n = 0

    def _bump(self):
        self.n += 1

    def tick(self):
        jax.debug.callback(self._bump)

    @contextlib.contextmanager
    def paused(self):
        """Executions inside (a reference computation) are not counted."""
        n = self.n
        try:
            yield
        finally:
            jax.effects_barrier()
            self.n = n


class Foo(eqx.Module):
    """The seed's example: `b` is an expensive function of `a`."""

    a: jax.Array
    counter: Counter = eqx.field(static=True)
    b_cache: Memo[jax.Array] = Memo()

    @memox.cached("b_cache")
    def b(self) -> jax.Array:
        self.counter.tick()
        return jnp.sum(self.a)


def foo(counter, n=3):
    return Foo(jnp.arange(n * n, dtype=jnp.float32).reshape(n, n), counter)


class Kernel(eqx.Module):
    """A Gaussian-process kernel matrix with a cached Cholesky factor."""

    x: jax.Array  # (n, d) inputs
    log_scale: jax.Array
    counter: Counter = eqx.field(static=True)
    chol_cache: Memo[jax.Array] = Memo()

    @memox.cached("chol_cache")
    def chol(self):
        self.counter.tick()
        return jnp.linalg.cholesky(gram(self.x, self.log_scale))


def gram(x, log_scale):
    d2 = jnp.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)
    return jnp.exp(-d2 * jnp.exp(log_scale)) + 0.5 * jnp.eye(x.shape[0])


def gp_loss(L, y):
    """A negative log marginal likelihood (up to constants) from a Cholesky factor."""
    return y @ jax.scipy.linalg.cho_solve((L, True), y) + 2 * jnp.sum(jnp.log(jnp.diag(L)))


class Inner(eqx.Module):
    x: jax.Array
    counter: Counter = eqx.field(static=True)
    gram_cache: Memo[jax.Array] = Memo()

    @memox.cached("gram_cache")
    def gram(self):
        self.counter.tick()
        return self.x @ self.x.T


class Outer(eqx.Module):
    """A cached method (`chol`) calling another (`inner.gram`)."""

    inner: Inner
    y: jax.Array
    counter: Counter = eqx.field(static=True)
    chol_cache: Memo[jax.Array] = Memo()

    @memox.cached("chol_cache")
    def chol(self):
        self.counter.tick()
        return jnp.linalg.cholesky(self.inner.gram() + jnp.diag(self.y))


def outer():
    """An `Outer` with counters for both methods: `(model, inner_counter, outer_counter)`."""
    ci, co = Counter(), Counter()
    x = jnp.arange(9.0).reshape(3, 3) / 10
    return Outer(Inner(x, ci), jnp.ones(3), co), ci, co
