"""Lookup (memox/_context.py): within a call a slot is found where it is, and two
places that share one slot's arrays get separate storage (issue 18, item 3)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter

import memox
from memox import Memo


class Layer(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    c: Memo[jax.Array] = Memo()

    @memox.cached("c", policy=memox.policies.Manual())
    def manual(self):
        self.counter.tick()
        return 2.0 * self.w

    d: Memo[jax.Array] = Memo()

    @memox.cached("d")
    def exact(self):
        self.counter.tick()
        return 3.0 * self.w


class Ensemble(eqx.Module):
    layers: list


def _ensemble(counter, n=3):
    # The way an ensemble is built from a template: every variant keeps the template's
    # (allocated, empty) slot arrays.
    template = memox.init(Layer(jnp.zeros(2), counter))
    return Ensemble(
        [eqx.tree_at(lambda m: m.w, template, (i + 1.0) * jnp.ones(2)) for i in range(n)]
    )


def _all(method):
    return lambda e: jnp.stack([method(layer) for layer in e.layers])


@pytest.mark.parametrize("method, scale", [(Layer.manual, 2.0), (Layer.exact, 3.0)])
@pytest.mark.parametrize("placement", ["eager", "memox.jit", "jax.jit"])
def test_variants_of_a_template_do_not_share_a_slot(method, scale, placement):
    # Regression: slots were found by the identity of their `key` array, which every
    # variant shares: every variant read the last one's slot.
    counter = Counter()
    model = _ensemble(counter)
    if placement == "eager":
        run = lambda m: memox.call(m, _all(method))  # noqa: E731
    elif placement == "memox.jit":
        run = memox.jit(_all(method))
    else:
        run = jax.jit(lambda m: memox.call(m, _all(method)))
    for _ in range(2):
        values, model = run(model)
        jax.effects_barrier()
        np.testing.assert_array_equal(np.asarray(values[:, 0]), scale * np.array([1.0, 2.0, 3.0]))
    assert counter.n == 3  # one per variant, then hits


def test_variants_in_a_memox_scan_carry():
    # Regression: `memox.scan` read the template's value for every variant from step 2.
    counter = Counter()
    model = _ensemble(counter)

    def body(m, x):
        values, m = memox.call(m, _all(Layer.exact))
        return m, values[:, 0] * x

    _, ys = memox.scan(body, model, jnp.arange(1.0, 4.0))
    _, expected = jax.lax.scan(body, _ensemble(Counter()), jnp.arange(1.0, 4.0))
    np.testing.assert_array_equal(np.asarray(ys), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(ys[1]), 2.0 * 3.0 * np.array([1.0, 2.0, 3.0]))


def test_one_module_object_at_two_paths():
    counter = Counter()
    layer = memox.init(Layer(jnp.ones(2), counter))
    pair = Ensemble([layer, layer])
    values, pair = memox.call(pair, _all(Layer.exact))
    np.testing.assert_array_equal(np.asarray(values), 3.0 * np.ones((2, 2)))
    values, pair = memox.call(pair, _all(Layer.exact))
    assert counter.n == 2 and memox.stats(pair)["layers[0].d"].hits == 1
