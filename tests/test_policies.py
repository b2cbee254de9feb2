"""Reuse policies: max age, drift tolerance, manual refresh, and refresh from a loop."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Traces

import memox
from memox import Memo
from memox.policies import Drift, Exact, Manual


def _model(policy, counter, h=1.0):
    class Stepper(eqx.Module):
        h: jax.Array
        jac: jax.Array
        counter: Counter = eqx.field(static=True)
        lu_cache: Memo[tuple] = Memo()

        @memox.cached("lu_cache", policy=policy)
        def lu(self):
            self.counter.tick()
            n = self.jac.shape[0]
            return jax.scipy.linalg.lu_factor(jnp.eye(n) - self.h * self.jac)

    jac = -jnp.diag(jnp.arange(1.0, 4.0))
    return Stepper(jnp.float32(h), jac, counter)


def _solve(m, b):
    lu, m = memox.call(m, lambda m: m.lu())
    return jax.scipy.linalg.lu_solve(lu, b), m


@pytest.mark.parametrize("k", [1, 3, 5])
def test_max_age_recomputes_after_k_hits(k):
    c = Counter()
    T = 12
    m = memox.init(_model(Exact(max_age=k), c))

    def body(m, _):
        x, m = _solve(m, jnp.ones(3))
        return m, x

    m, xs = jax.jit(lambda m: jax.lax.scan(body, m, length=T))(m)
    assert c.n == math.ceil(T / (k + 1))
    assert memox.stats(m)["lu_cache"] == memox.SlotStats(hits=T - c.n, misses=c.n)
    np.testing.assert_allclose(xs[-1], 1 / (1 + jnp.arange(1.0, 4.0)), rtol=1e-6)


def test_drift_reuses_within_tolerance_and_recomputes_past_it():
    c = Counter()
    m = memox.init(_model(Drift(rtol=0.25), c, h=1.0))
    step = jax.jit(_solve)
    b = jnp.ones(3)
    x0, m = step(m, b)
    # h moves by 10%: within tolerance, the stored factorisation (for h=1) is reused.
    x1, m = step(eqx.tree_at(lambda t: t.h, m, jnp.float32(1.1)), b)
    assert c.n == 1
    np.testing.assert_array_equal(x1, x0)
    # h moves by 50% from the snapshot: recomputed, for the new h.
    x2, m = step(eqx.tree_at(lambda t: t.h, m, jnp.float32(1.5)), b)
    assert c.n == 2
    np.testing.assert_allclose(x2, 1 / (1 + 1.5 * jnp.arange(1.0, 4.0)), rtol=1e-6)
    # The snapshot moved with the recomputation: 1.6 is within 25% of 1.5.
    _, m = step(eqx.tree_at(lambda t: t.h, m, jnp.float32(1.6)), b)
    assert c.n == 2


def test_drift_snapshot_costs_the_dependencies_size():
    m = memox.init(_model(Drift(rtol=0.1), Counter()))
    # Dependencies: h (4 bytes) and jac (9 x 4 bytes).
    assert m.lu_cache.snapshot.shape == (1, 40)
    # Without snapshots, no snapshot table: no zero-size leaf, which checkpointers refuse
    # (issue 19).
    m = memox.init(_model(Exact(), Counter()))
    assert not eqx.is_array(m.lu_cache.snapshot) and m.lu_cache.allocated


def test_manual_ignores_dependencies_until_invalidated():
    c = Counter()
    m = memox.init(_model(Manual(), c))
    step = jax.jit(_solve)
    x0, m = step(m, jnp.ones(3))
    m = eqx.tree_at(lambda t: t.h, m, jnp.float32(2.0))
    x1, m = step(m, jnp.ones(3))
    assert c.n == 1
    np.testing.assert_array_equal(x1, x0)  # stale by design
    m = memox.invalidate(m, type(m).lu)
    x2, m = step(m, jnp.ones(3))
    assert c.n == 2
    np.testing.assert_allclose(x2, 1 / (1 + 2 * jnp.arange(1.0, 4.0)), rtol=1e-6)


def test_invalidate_from_inside_a_scan_on_a_flag():
    c = Counter()
    m = memox.init(_model(Manual(), c))
    flags = jnp.array([False, False, True, False, True, True, False])

    def body(m, refresh):
        m = memox.invalidate(m, type(m).lu, when=refresh)
        x, m = _solve(m, jnp.ones(3))
        return m, x

    traces = Traces()

    @jax.jit
    def run(m, flags):
        traces.tick()
        return jax.lax.scan(body, m, flags)

    m, _ = run(m, flags)
    assert c.n == 1 + int(flags.sum())
    m, _ = run(m, jnp.zeros(7, jnp.bool_))
    assert c.n == 1 + int(flags.sum()) and traces.n == 1


def test_invalidate_other_method_leaves_slot_alone():
    c = Counter()
    m = memox.init(_model(Exact(), c))
    _, m = _solve(m, jnp.ones(3))
    m = memox.invalidate(m, when=False)
    _, m = _solve(m, jnp.ones(3))
    assert c.n == 1
    m = memox.invalidate(m)  # every slot
    _, m = _solve(m, jnp.ones(3))
    assert c.n == 2


@pytest.mark.parametrize("policy", [Exact(max_age=2), Drift(rtol=0.5), Manual()])
def test_gradients_stay_exact_under_every_policy(policy):
    m = memox.init(_model(policy, Counter()))
    _, m = _solve(m, jnp.ones(3))  # start from a hit

    def loss(h):
        x, _ = _solve(eqx.tree_at(lambda t: t.h, m, h), jnp.ones(3))
        return jnp.sum(x**2)

    def loss_plain(h):
        a = jnp.eye(3) - h * m.jac
        return jnp.sum(jnp.linalg.solve(a, jnp.ones(3)) ** 2)

    h = jnp.float32(1.0)
    np.testing.assert_allclose(jax.grad(loss)(h), jax.grad(loss_plain)(h), rtol=1e-5)


def test_policy_errors():
    with pytest.raises(ValueError, match=r"`memox.policies.Exact\(max_age=...\)` must be a"):
        Exact(max_age=0)
    with pytest.raises(ValueError, match=r"takes non-negative tolerances; got rtol=-1.0"):
        Drift(rtol=-1.0)
    with pytest.raises(TypeError, match=r"Pass a `memox.policies` policy, e.g."):
        memox.cached("x", policy="exact")
    with pytest.raises(TypeError, match=r"is not a method decorated with `memox.cached`"):
        memox.invalidate(_model(Exact(), Counter()), len)


class _DriftSum(eqx.Module):
    read: jax.Array
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache", policy=memox.policies.Drift(rtol=1e-3))
    def total(self):
        return jnp.stack([jnp.sum(self.read), jnp.float32(self.read.shape[0])])


def test_init_reallocates_a_snapshot_that_no_longer_fits():
    # Regression: `memox.init` compared only the value table, so a `Drift` slot filled for
    # a dependency of 3 floats kept its 12-byte snapshot table after the dependency grew
    # to 4, and a `lax.scan` over the module raised about the value's shape.
    m = _DriftSum(jnp.arange(3.0))
    _, m = memox.call(m, _DriftSum.total)
    grown = memox.init(eqx.tree_at(lambda m: m.read, m, jnp.arange(4.0)), _DriftSum.total)
    assert grown.cache.snapshot.shape[1] == 16

    def body(m, _):
        value, m = memox.call(m, _DriftSum.total)
        return m, value

    _, values = jax.lax.scan(body, grown, jnp.arange(2))
    np.testing.assert_array_equal(values, [[6.0, 4.0], [6.0, 4.0]])
