"""Slots are invisible to optimizers: the standard Equinox + optax loop needs no change."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Counter, Spectral, reference

import memox


@pytest.fixture(autouse=True)
def _standard_promotion():
    # optax's own bias correction mixes int32 step counts with floats, which the strict
    # promotion of conftest.py refuses; memox's code stays under strict promotion elsewhere.
    with jax.numpy_dtype_promotion("standard"):
        yield


def _problem(counter):
    a = jax.random.normal(jax.random.key(0), (6, 6))
    lap = a @ a.T
    x = jax.random.normal(jax.random.key(1), (8, 6))
    y = jnp.sin(jnp.arange(8.0))
    return Spectral(lap, jnp.ones(6) / 6, counter), x, y


def _frozen_spec(model):
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: m.head, spec, True)


def _train(model, x, y, steps, use_memox):
    spec = _frozen_spec(model)
    opt = optax.adamw(1e-2, weight_decay=0.1)
    # Made before any slot is allocated, from the model as constructed.
    opt_state = opt.init(eqx.filter(model, spec))

    def loss(diff, static):
        m = eqx.combine(diff, static)
        if use_memox:
            pred, m = memox.call(m, lambda m: jax.vmap(m)(x))
        else:
            pred = jax.vmap(m)(x)
        return jnp.mean((pred - y) ** 2), m

    @eqx.filter_jit
    def step(model, opt_state):
        diff, static = eqx.partition(model, spec)
        (value, model), g = eqx.filter_value_and_grad(loss, has_aux=True)(diff, static)
        updates, opt_state = opt.update(g, opt_state, eqx.filter(model, spec))
        return eqx.apply_updates(model, updates), opt_state, value

    losses = []
    for _ in range(steps):
        model, opt_state, value = step(model, opt_state)
        losses.append(float(value))
    return model, losses


def test_filter_sees_only_user_parameters():
    model, _, _ = _problem(Counter())
    _, model = memox.call(model, Spectral.basis)
    params = eqx.filter(model, eqx.is_inexact_array)
    assert [x.shape for x in jax.tree.leaves(params)] == [(6, 6), (6,)]
    assert not any(eqx.is_inexact_array(x) for x in jax.tree.leaves(model.eig_cache))


def test_frozen_part_computed_once_and_losses_identical():
    c_memo, c_plain = Counter(), Counter()
    model, x, y = _problem(c_memo)
    trained, losses = _train(model, x, y, steps=6, use_memox=True)
    plain, x, y = _problem(c_plain)
    with reference():  # the unmemoized program: `basis` computes at every step
        _, losses_plain = _train(plain, x, y, steps=6, use_memox=False)
    assert c_memo.n == 1 and c_plain.n == 6
    np.testing.assert_array_equal(losses, losses_plain)
    assert memox.stats(trained)["eig_cache"] == memox.SlotStats(hits=5, misses=1)


def test_weight_decay_leaves_slots_untouched():
    model, x, y = _problem(Counter())
    _, model = memox.call(model, Spectral.basis)
    stored = model.eig_cache.value
    trained, _ = _train(model, x, y, steps=2, use_memox=True)
    np.testing.assert_array_equal(trained.eig_cache.value, stored)


def test_moving_dependency_is_seen_after_an_optimizer_step():
    c = Counter()
    model, x, y = _problem(c)
    opt = optax.sgd(0.1)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))  # laplacian trains too

    def loss(model):
        pred, model = memox.call(model, lambda m: jax.vmap(m)(x))
        return jnp.mean((pred - y) ** 2), model

    for _ in range(3):
        (_, model), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, opt_state = opt.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        (vals, _), _ = memox.call(model, Spectral.basis)
        np.testing.assert_allclose(vals, jnp.linalg.eigvalsh(model.laplacian), rtol=1e-4)
    # Three training steps and three checks, each on moved parameters: no stale hit.
    assert c.n == 6
