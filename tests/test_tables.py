"""`Memo(size=K)`: K entries keyed by the arguments, least-recently-used eviction."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Traces

import memox
from memox import Memo


class Plant(eqx.Module):
    """A model evaluated at a few recurring operating points."""

    w: jax.Array
    counter: Counter = eqx.field(static=True)
    table: Memo[jax.Array] = Memo(size=3)

    @memox.cached("table")
    def response(self, point):
        self.counter.tick()
        return jnp.tanh(self.w * point)


POINTS = {name: jnp.full((4,), v) for name, v in zip("abcd", (0.1, 0.2, 0.3, 0.4))}


def _run(m, sequence, call=memox.call):
    outs = []
    for name in sequence:
        y, m = call(m, Plant.response, POINTS[name])
        outs.append(y)
    return outs, m


def test_lru_hits_and_evictions():
    c = Counter()
    m = Plant(jnp.arange(4.0), c)
    outs, m = _run(m, "abcabdc")
    # a b c: three misses; a b: hits; d evicts c (least recently used); c evicts a.
    assert c.n == 5
    assert memox.stats(m)["table"] == memox.SlotStats(hits=2, misses=5)
    for name, y in zip("abcabdc", outs):
        np.testing.assert_allclose(y, jnp.tanh(m.w * POINTS[name]), rtol=1e-6)
    _, m = _run(m, "bdc")  # all still held
    assert c.n == 5
    _, m = _run(m, "a")  # evicted
    assert c.n == 6


def test_table_under_jit_traces_once():
    c = Counter()
    traces = Traces()

    def fn(m, p):
        traces.tick()
        return m.response(p)

    step = memox.jit(fn)
    m = memox.init(Plant(jnp.arange(4.0), c), Plant.response, POINTS["a"])
    for name in "abcabdc":
        _, m = step(m, POINTS[name])
    assert c.n == 5 and traces.n == 1


def test_table_inside_scan():
    c = Counter()
    m = memox.init(Plant(jnp.arange(4.0), c), Plant.response, POINTS["a"])
    seq = jnp.stack([POINTS[n] for n in "abcabdcab"])

    def body(m, p):
        y, m = memox.call(m, Plant.response, p)
        return m, y

    m, ys = jax.jit(lambda m, seq: jax.lax.scan(body, m, seq))(m, seq)
    np.testing.assert_allclose(ys, jnp.tanh(m.w[None, :] * seq), rtol=1e-6)
    # a b c a b d c a b -> misses a b c d c a b (a was evicted by c, then b by a).
    assert c.n == 7


def test_dependency_change_misses_every_entry():
    c = Counter()
    m = Plant(jnp.arange(4.0), c)
    _, m = _run(m, "ab")
    m = eqx.tree_at(lambda t: t.w, m, m.w + 1)
    outs, m = _run(m, "ab")
    assert c.n == 4
    np.testing.assert_allclose(outs[0], jnp.tanh(m.w * POINTS["a"]), rtol=1e-6)


def test_gradients_through_a_table():
    m = Plant(jnp.arange(4.0), Counter())
    _, m = _run(m, "ab")

    def loss(w, p):
        y, _ = memox.call(eqx.tree_at(lambda t: t.w, m, w), Plant.response, p)
        return jnp.sum(y**2)

    g = jax.grad(loss)(m.w, POINTS["a"])
    g_ref = jax.grad(lambda w: jnp.sum(jnp.tanh(w * POINTS["a"]) ** 2))(m.w)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_size(size):
    with pytest.raises(ValueError, match=r"`memox.Memo\(size=...\)` takes the number of"):
        Memo(size=size)


@pytest.mark.parametrize("size", [1, 3])
def test_a_traced_hit_branch_compiles_nothing(size):
    # The counters a hit or a store moves are updated after the branch, in one operation
    # (`_table.counts_after`): the hit branch passes the slot through. Its computation in
    # the optimised HLO computes nothing: it reads its operands and returns them (XLA
    # copies a buffer that is not donated).
    class Foo(eqx.Module):
        a: jax.Array
        b_cache: Memo[jax.Array] = Memo(size=size)

        @memox.cached("b_cache")
        def b(self, x):
            return jnp.sin(self.a * x)

    f = memox.init(Foo(jnp.arange(3.0)), Foo.b, 1.0)
    hlo = jax.jit(lambda f, x: memox.call(f, Foo.b, x)).lower(f, 2.0).compile().as_text()
    (branches,) = re.findall(
        r" conditional\(.*branch_computations=\{(%[\w.\-]+), (%[\w.\-]+)\}", hlo
    )
    hit = branches[1]  # (`lax.cond` lists the false branch first)
    body = hlo.split("\n" + hit + " ")[1].split("\n}\n")[0]
    ops = re.findall(r"= \S+ ([a-z\-]+)\(", body)
    assert ops and set(ops) <= {"parameter", "get-tuple-element", "tuple", "copy"}, body
    miss = hlo.split("\n" + branches[0] + " ")[1].split("\n}\n")[0]
    assert "sine" in miss or "fusion" in miss, miss
