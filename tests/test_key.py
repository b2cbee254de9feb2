"""The static key (memox/_key.py): what `jax.jit` keys on, the trace context and the
abstract types of arrays (the tokens of non-array parts: tests/test_token.py). One test
per class of input that once returned another input's value (issue 18, item 1); each
compares with the unmemoized method, in every placement, and counts real executions."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import PLACEMENTS, Counter, assert_same, call_in

import memox
from memox import Memo, _key, _token


# -- the trace context: JAX's configuration, as jax.jit keys on it ---------------------


class Ramp(eqx.Module):
    a: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def ramp(self):
        self.counter.tick()
        return jnp.arange(3.0) + self.a.astype(float)  # float64 under x64


class Draws(eqx.Module):
    key: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def draw(self):
        self.counter.tick()
        return jax.random.uniform(self.key, (4, 8))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_enabling_x64_between_calls_recomputes_with_the_new_types(placement):
    # Regression: an eager hit returned float32 where the method gave float64, and
    # memox.jit crashed in dynamic_update_slice.
    counter = Counter()
    module = Ramp(jnp.zeros((), jnp.int32), counter)
    _, module = call_in(placement, module, Ramp.ramp)
    with jax.enable_x64(True):
        value, module = call_in(placement, module, Ramp.ramp)
        assert_same(value, jnp.arange(3.0) + module.a.astype(float))
        assert value.dtype == jnp.float64
    value, module = call_in(placement, module, Ramp.ramp)
    assert_same(value, jnp.arange(3.0) + module.a.astype(float))
    assert counter.n == 3


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "flag, other", [("jax_threefry_partitionable", None), ("jax_random_seed_offset", 7)]
)
def test_prng_flags_are_part_of_the_key(placement, flag, other):
    # Regression: draws from a key the module holds came back stale after a PRNG flag
    # changed.
    before = getattr(jax.config, flag)
    other = (not before) if other is None else other
    counter = Counter()
    module = Draws(jax.random.key(3), counter)
    _, module = call_in(placement, module, Draws.draw)
    try:
        jax.config.update(flag, other)
        expected = Draws.draw.fn(module)
        value, module = call_in(placement, module, Draws.draw)
        assert_same(value, expected)
    finally:
        jax.config.update(flag, before)
    value, module = call_in(placement, module, Draws.draw)
    assert_same(value, Draws.draw.fn(module))


def test_the_trace_context_is_what_jax_keys_on():
    # memox reads JAX's own list of options (no list of its own): every option JAX
    # declares part of the trace context changes the key when it changes.
    from jax._src import config

    context = memox._jax_internals.trace_context()
    assert len(context) == len(config.trace_context())
    with jax.enable_x64(not jax.config.read("jax_enable_x64")):
        assert _token.token(memox._jax_internals.trace_context()) != _token.token(context)
    with jax.default_matmul_precision("highest"):
        assert _token.token(memox._jax_internals.trace_context()) != _token.token(context)
    # Canonical: no part numbered by this process (a restored slot still hits).
    assert not _key.static_key(_token.token(context)).local
