"""`memox.jit`: compiled once, hits inside, and no copies across the boundary."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import Counter, Foo, foo

import memox
from memox import Memo


def test_canonical_loop_traces_once_without_init():
    c = Counter()
    traces = []

    def step(f, x):
        traces.append(None)
        return f.b() * x

    step = memox.jit(step)
    f = foo(c)  # never init-ed: memox.jit allocates before it traces
    for i in range(4):
        y, f = step(f, jnp.float32(i))
    assert len(traces) == 1
    assert c.n == 1
    assert y == 3 * jnp.sum(f.a)
    assert memox.stats(f)["b_cache"] == memox.SlotStats(hits=3, misses=1)


def test_dependency_change_recomputes_without_retrace():
    c = Counter()
    traces = []

    def b(f):
        traces.append(None)
        return f.b()

    step = memox.jit(b)
    f = foo(c)
    _, f = step(f)
    f = eqx.tree_at(lambda t: t.a, f, f.a.at[0, 0].add(1.0))
    out, f = step(f)
    assert out == jnp.sum(f.a)
    assert (c.n, len(traces)) == (2, 1)


def test_unchanged_leaves_are_the_callers_arrays():
    c = Counter()
    f = foo(c)
    use_b = memox.jit(lambda t: t.b())
    _, f1 = use_b(f)
    _, f2 = use_b(f1)
    assert f2.a is f.a  # the parameter never crossed the jit boundary
    assert f2.b_cache.value is not f1.b_cache.value  # the slot did (hit counted)


class Two(eqx.Module):
    a: jax.Array
    counter: Counter = eqx.field(static=True)
    first: Memo[jax.Array] = Memo()
    second: Memo[jax.Array] = Memo()

    @memox.cached("first")
    def one(self):
        self.counter.tick()
        return self.a + 1

    @memox.cached("second")
    def two(self):
        return self.a + 2


def test_untouched_slots_pass_through_and_donated_slots_revive():
    c = Counter()
    m = Two(jnp.ones(3), c)
    _, m1 = memox.call(m, Two.two)
    stored = jnp.array(m1.second.value)
    _, m2 = memox.jit(Two.one)(m1)
    assert m2.a is m1.a  # parameters never cross the boundary
    assert jnp.array_equal(m2.second.value, stored)  # an untouched slot keeps its value
    # The slots of m1 were donated to m2; calling on m1 again recomputes, with a warning.
    assert m1.second.value.is_deleted()
    with pytest.warns(UserWarning, match=r"slots .* were donated to an earlier `memox.jit`"):
        _, m3 = memox.jit(Two.one)(m1)
    assert c.n == 2 and jnp.array_equal(m3.first.value, m2.first.value)


def test_without_donation_the_old_module_keeps_its_slots():
    c = Counter()
    m = Two(jnp.ones(3), c)
    step = memox.jit(Two.one, donate=False)
    _, m1 = step(m)
    _, m2 = step(m1)
    _, m3 = step(m1)  # the old module still holds its filled slot: a hit
    assert c.n == 1 and not m1.first.value.is_deleted()
    assert m3.second.value is m1.second.value  # an untouched slot is not even returned


def test_result_and_module_match_call():
    c = Counter()
    f = foo(c)
    b_call, f_call = memox.call(f, Foo.b)
    b_jit, f_jit = memox.jit(Foo.b)(f)
    assert b_call == b_jit
    assert jax.tree.structure(f_call) == jax.tree.structure(f_jit)
    assert memox.stats(f_call) == memox.stats(f_jit)


def test_keyword_and_static_arguments():
    c = Counter()
    traces = []

    def fn(f, x, *, power):
        traces.append(power)
        return f.b() * x**power

    step = memox.jit(fn)
    f = foo(c)
    y, f = step(f, jnp.float32(2), power=2)
    y, f = step(f, jnp.float32(3), power=2)
    assert y == 9 * jnp.sum(f.a)
    y, f = step(f, jnp.float32(3), power=3)  # a static argument: retraces
    assert traces == [2, 3] and c.n == 1


def test_non_array_results_come_back_as_they_were():
    c = Counter()
    step = memox.jit(lambda f, x: {"b": f.b() * x, "label": "b times x", "n": 3, "none": None})
    out, f = step(foo(c), jnp.float32(2))
    assert (out["label"], out["n"], out["none"]) == ("b times x", 3, None)
    assert out["b"] == 2 * jnp.sum(f.a)
    out, f = step(f, jnp.float32(2))
    assert out["label"] == "b times x" and c.n == 1


def test_unchanged_dependencies_are_fingerprinted_outside_once():
    from memox._fingerprint import known

    c = Counter()
    step = memox.jit(lambda f: f.b())
    f = foo(c)
    for _ in range(3):
        _, f = step(f)
    # Seen unchanged twice: fingerprinted once outside the compiled code, by identity.
    assert id(f.a) in known._entries and known._entries[id(f.a)][2] is not None
    # A new array with the same values is not trusted by identity: hashed in-graph, a hit.
    f = eqx.tree_at(lambda t: t.a, f, jnp.array(f.a))
    _, f = step(f)
    assert c.n == 1
    # Different values: a miss, whatever was fingerprinted before.
    f = eqx.tree_at(lambda t: t.a, f, f.a.at[0, 0].add(1.0))
    for _ in range(3):
        y, f = step(f)
    assert c.n == 2 and y == jnp.sum(f.a)
