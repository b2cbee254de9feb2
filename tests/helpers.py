"""Shared test models and counters: real executions (not traces) and traces."""

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
