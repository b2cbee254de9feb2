"""`lax.cond` and `lax.switch` around `memox.call`, with the module as an operand and an
output: the fill made in the taken branch propagates; an untaken branch fills nothing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, Traces, call_b_times, foo, hits_and_misses
from jax import lax

import memox


def _skip(m, x):
    return jnp.float32(0), m


def _b_plus(m, x):
    return memox.call(m, lambda m: m.b() + x)


BRANCHES = [_skip, call_b_times, _b_plus]


def _plain(index, a, x):
    b = np.asarray(a).sum()
    return [0.0, b * x, b + x][index]


@pytest.mark.parametrize("op", ["cond", "switch"])
def test_taken_branch_fill_propagates(op):
    c = Counter()
    traces = Traces()

    @jax.jit
    def run(index, m, x):
        traces.tick()
        if op == "cond":  # index 0 or 1
            return lax.cond(index == 1, call_b_times, _skip, m, x)
        return lax.switch(index, BRANCHES, m, x)

    f = memox.init(foo(c))
    x = jnp.float32(3)
    indices = [0, 1, 1, 0] if op == "cond" else [0, 2, 1, 0, 2]
    for i, index in enumerate(indices):
        y, f = run(jnp.int32(index), f, x)
        assert y == _plain(index, f.a, 3.0)
        if i == 0:  # the untaken branch filled nothing
            assert hits_and_misses(f) == (0, 0)
    assert traces.n == 1 and c.n == 1
    n_calls = sum(index != 0 for index in indices)
    assert hits_and_misses(f) == (n_calls - 1, 1)
    # The fill reached the caller: an eager call hits.
    _, f = memox.call(f, Foo.b)
    assert c.n == 1


def test_both_branches_call_and_dependency_changes_inside_a_branch():
    # The false branch changes the dependency before its call: it misses, and the module
    # it returns carries the new parameter and the new fill.
    c = Counter()

    def bumped(m, x):
        m = eqx.tree_at(lambda t: t.a, m, m.a + 1.0)
        return call_b_times(m, x)

    run = jax.jit(lambda p, m, x: lax.cond(p, call_b_times, bumped, m, x))
    f0 = memox.init(foo(c))
    x = jnp.float32(2)
    y, f = run(True, f0, x)
    assert y == _plain(1, f0.a, 2.0) and c.n == 1
    y, f = run(False, f, x)
    assert y == _plain(1, np.asarray(f0.a) + 1, 2.0) and c.n == 2
    y, f = run(True, f, x)  # `a` moved: the true branch sees a hit on the new value
    assert y == _plain(1, np.asarray(f0.a) + 1, 2.0) and c.n == 2
    assert hits_and_misses(f) == (1, 2)


def test_cond_inside_vmap_around_call_is_exact():
    # `vmap` turns a batched `cond` into a select: both branches run, each element keeps
    # the module of its own branch.
    c = Counter()
    f = memox.init(foo(c))
    preds = jnp.array([True, False, True])
    run = jax.vmap(lambda p, m, x: lax.cond(p, call_b_times, _skip, m, x), in_axes=(0, None, None))
    ys, fs = jax.jit(run)(preds, f, jnp.float32(2))
    b = np.asarray(f.a).sum()
    np.testing.assert_array_equal(ys, [2 * b, 0, 2 * b])
    hits, misses = hits_and_misses(fs)
    assert hits.tolist() == [0, 0, 0] and misses.tolist() == [1, 0, 1]


def test_fill_inside_cond_opened_inside_call_is_refused():
    # A `cond` opened inside `fn`: the fill belongs to the branch and cannot leave it.
    f = memox.init(foo(Counter()))

    def fn(m, p):
        return lax.cond(p, lambda: m.b(), lambda: jnp.float32(0))

    with pytest.raises(ValueError, match=r"`Foo.b` updates slot `b_cache` with values that"):
        jax.jit(lambda f, p: memox.call(f, fn, p))(f, True)


def test_hit_inside_cond_opened_inside_call_is_refused():
    # Even a hit updates the slot (its counters) from inside the branch: refused.
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)

    def fn(m, p):
        return lax.cond(p, lambda: m.b(), lambda: jnp.float32(0))

    with pytest.raises(ValueError, match=r"or read the value before it"):
        jax.jit(lambda f, p: memox.call(f, fn, p))(f, True)
