"""`memox.call`: hits and misses, what is tracked, nesting, submodules."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import Counter, Foo, Outer, foo, outer

import memox
from memox import Memo


def test_miss_then_hit_eager():
    c = Counter()
    f = foo(c)
    b1, f = memox.call(f, Foo.b)
    b2, f = memox.call(f, lambda m: m.b())
    assert c.n == 1
    assert b1 == b2 == jnp.sum(f.a)
    assert memox.stats(f) == {"b_cache": memox.SlotStats(hits=1, misses=1)}


def test_same_call_twice_computes_once():
    c = Counter()
    (b1, b2), _ = memox.call(foo(c), lambda m: (m.b(), m.b()))
    assert c.n == 1 and b1 == b2


def test_input_module_is_not_modified():
    c = Counter()
    f0 = memox.init(foo(c))
    _, f1 = memox.call(f0, Foo.b)
    assert not bool(f0.b_cache.valid) and bool(f1.b_cache.valid)
    _, _ = memox.call(f0, Foo.b)
    assert c.n == 2


def test_outside_call_just_computes():
    c = Counter()
    f = foo(c)
    assert f.b() == jnp.sum(f.a)
    assert f.b() == jnp.sum(f.a)
    assert c.n == 2
    assert not f.b_cache.allocated


def test_inside_jax_jit():
    c = Counter()
    step = jax.jit(lambda m: memox.call(m, Foo.b))
    f = memox.init(foo(c))
    for _ in range(3):
        b, f = step(f)
    assert c.n == 1 and b == jnp.sum(f.a)


def test_inside_jax_jit_unallocated_allocates_in_graph():
    c = Counter()
    f = foo(c)
    # An unallocated slot is allocated inside the trace: the output carries it.
    b, f = eqx.filter_jit(lambda m: memox.call(m, Foo.b))(f)
    assert f.b_cache.allocated and bool(f.b_cache.valid) and c.n == 1


class Args(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    power: int = eqx.field(static=True, default=1)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def apply(self, x, scale=1.0):
        self.counter.tick()
        return scale * (self.w**self.power) @ x


def test_arguments_are_part_of_the_key():
    c = Counter()
    m = Args(jnp.eye(3), c)
    x, y = jnp.ones(3), jnp.arange(3.0)
    out, m = memox.call(m, Args.apply, x)
    out, m = memox.call(m, Args.apply, x)
    assert c.n == 1
    out, m = memox.call(m, Args.apply, y)  # other array argument
    np.testing.assert_allclose(out, y)
    out, m = memox.call(m, Args.apply, y, scale=2.0)  # other static argument
    np.testing.assert_allclose(out, 2 * y)
    out, m = memox.call(m, Args.apply, y.at[1].set(7.0), scale=2.0)  # one element
    np.testing.assert_allclose(out, 2 * y.at[1].set(7.0))
    assert c.n == 4


def test_static_field_is_part_of_the_key():
    c = Counter()
    m = Args(2 * jnp.eye(3), c)
    x = jnp.ones(3)
    _, m = memox.call(m, Args.apply, x)
    m2 = dataclasses.replace(m, power=2)
    out, _ = memox.call(m2, Args.apply, x)
    np.testing.assert_allclose(out, 4 * x)
    assert c.n == 2


class Reads(eqx.Module):
    used: jax.Array
    unused: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def value(self):
        self.counter.tick()
        _ = self.unused * 2  # read in Python, but the result does not depend on it
        return self.used.sum()


def test_only_what_the_method_reads_is_a_dependency():
    c = Counter()
    m = Reads(jnp.ones(4), jnp.ones(4), c)
    _, m = memox.call(m, Reads.value)
    m = eqx.tree_at(lambda t: t.unused, m, jnp.zeros(4))
    _, m = memox.call(m, Reads.value)
    assert c.n == 1
    m = eqx.tree_at(lambda t: t.used, m, jnp.ones(4).at[3].set(2.0))
    v, m = memox.call(m, Reads.value)
    assert c.n == 2 and v == 5.0


def _outer():
    return outer()


def _reference(m):
    x = m.inner.x
    return jnp.linalg.cholesky(x @ x.T + jnp.diag(m.y))


def test_nested_cached_methods_fill_each_slot_once():
    m, ci, co = _outer()
    for _ in range(3):
        L, m = memox.call(m, Outer.chol)
    np.testing.assert_allclose(L, _reference(m), rtol=1e-6)
    assert (ci.n, co.n) == (1, 1)
    assert memox.stats(m) == {
        "inner.gram_cache": memox.SlotStats(hits=0, misses=1),
        "chol_cache": memox.SlotStats(hits=2, misses=1),
    }


def test_nested_outer_dependency_change_hits_inner():
    m, ci, co = _outer()
    _, m = memox.call(m, Outer.chol)
    m = eqx.tree_at(lambda t: t.y, m, 2 * jnp.ones(3))
    L, m = memox.call(m, Outer.chol)
    np.testing.assert_allclose(L, _reference(m), rtol=1e-6)
    assert (ci.n, co.n) == (1, 2)
    assert memox.stats(m)["inner.gram_cache"] == memox.SlotStats(hits=1, misses=1)


def test_nested_under_jit():
    m, ci, co = _outer()
    step = memox.jit(Outer.chol)
    for _ in range(3):
        L, m = step(m)
    np.testing.assert_allclose(L, _reference(m), rtol=1e-6)
    assert (ci.n, co.n) == (1, 1)


def test_submodule_method_called_from_root():
    m, ci, _ = _outer()
    _, m = memox.call(m, lambda t: t.inner.gram())
    _, m = memox.call(m, lambda t: t.inner.gram())
    assert ci.n == 1 and memox.stats(m)["inner.gram_cache"].hits == 1


def test_module_rebuilt_inside_fn_still_finds_its_slot():
    c = Counter()
    f = memox.init(foo(c))

    def fn(m):
        # partition/combine (as eqx.filter_grad does) rebuilds every module object
        dyn, static = eqx.partition(m, eqx.is_inexact_array)
        return eqx.combine(dyn, static).b()

    _, f = memox.call(f, fn)
    _, f = memox.call(f, fn)
    assert c.n == 1 and memox.stats(f)["b_cache"].hits == 1


def test_pytree_of_modules():
    c1, c2 = Counter(), Counter()
    pair = (foo(c1), foo(c2, n=2))
    (b1, b2), pair = memox.call(pair, lambda p: (p[0].b(), p[1].b()))
    (b1, b2), pair = memox.call(pair, lambda p: (p[0].b(), p[1].b()))
    assert (c1.n, c2.n) == (1, 1)
    assert set(memox.stats(pair)) == {"[0].b_cache", "[1].b_cache"}


class Tuple(eqx.Module):
    a: jax.Array
    cache: Memo[tuple] = Memo()

    @memox.cached("cache")
    def parts(self):
        return {
            "eig": jnp.linalg.eigh(self.a),
            "n": jnp.asarray(self.a.shape[0], jnp.int32),
            "flag": self.a[0, 0] > 0,
            "z": (1 + 2j) * self.a.astype(jnp.complex64),
            "half": self.a.astype(jnp.float16),
        }


def test_pytree_values_of_mixed_dtypes_round_trip():
    a = jnp.arange(4.0).reshape(2, 2)
    a = a + a.T
    m = Tuple(a)
    v1, m = memox.call(m, Tuple.parts)
    v2, m = memox.call(m, Tuple.parts)
    assert memox.stats(m)["cache"].hits == 1
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), v1, v2)
    jax.tree.map(
        lambda x, y: (x.dtype == y.dtype) or (_ for _ in ()).throw(AssertionError), v1, v2
    )
    assert not any(eqx.is_inexact_array(x) for x in jax.tree.leaves(m.cache))


def test_clear_keeps_allocation_and_forces_recompute():
    c = Counter()
    f = foo(c)
    _, f = memox.call(f, Foo.b)
    treedef = jax.tree.structure(f)
    f = memox.clear(f)
    assert jax.tree.structure(f) == treedef
    _, f = memox.call(f, Foo.b)
    assert c.n == 2
    assert memox.stats(f)["b_cache"] == memox.SlotStats(hits=0, misses=2)


def test_init_allocates_without_computing():
    c = Counter()
    f = memox.init(foo(c))
    assert c.n == 0 and f.b_cache.allocated and not bool(f.b_cache.valid)
    assert memox.stats(f) == {"b_cache": memox.SlotStats(hits=0, misses=0)}


def test_init_with_fn_allocates_argument_keyed_slots():
    c = Counter()
    m = Args(jnp.eye(3), c)
    assert not memox.init(m).cache.allocated  # takes an argument: not allocated alone
    m = memox.init(m, Args.apply, jnp.ones(3))
    assert m.cache.allocated and c.n == 0


# -- `memox.stats` as a pytree -----------------------------------------------------------
#
# Regression (issue 22): `SlotStats` was not a pytree: `jax.jit` refused to return
# `memox.stats`, and `eqx.filter_jit` returned it as a static leaf holding its tracers.


def test_stats_returned_from_jit_are_the_counts():
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)

    @jax.jit
    def hit_then_stats(m):
        _, m = memox.call(m, Foo.b)  # a hit, counted in the traced slot
        return memox.stats(m)

    got = hit_then_stats(f)
    assert got == {"b_cache": memox.SlotStats(hits=1, misses=1)} and c.n == 1
    assert got["b_cache"].flops == 8  # (static: of one computation of `b`)
    for jit in (jax.jit, eqx.filter_jit):
        got = jit(memox.stats)(f)
        assert got == memox.stats(f) == {"b_cache": memox.SlotStats(hits=0, misses=1)}
        for count in jax.tree.leaves(got):
            assert isinstance(count, jax.Array) and not isinstance(count, jax.core.Tracer)
    # A batched module: a count per element.
    fs = eqx.filter_vmap(lambda a: memox.init(Foo(a, c)))(jnp.ones((5, 3, 3)))
    got = jax.jit(memox.stats)(fs)["b_cache"]
    assert got.hits.shape == got.misses.shape == (5,) and got.flops == 8


def test_slot_stats_leaves_are_the_counts():
    s = memox.SlotStats(hits=2, misses=1, flops=8, flops_unknown={"sort": 1})
    assert jax.tree.leaves(s) == [2, 1]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(s)]
    assert paths == [".hits", ".misses"]
    # `flops` and `flops_unknown` are static: in the tree structure, which is hashable (a
    # `jax.jit` cache key) and tells them apart.
    scaled = jax.tree.map(lambda n: 10 * n, s)
    assert (scaled.hits, scaled.misses) == (20, 10)
    assert (scaled.flops, scaled.flops_unknown) == (8, {"sort": 1})
    other = dataclasses.replace(s, flops_unknown={"fft": 1})
    assert hash(jax.tree.structure(s)) is not None
    assert jax.tree.structure(s) != jax.tree.structure(other)
    # Equality and repr as before: the counts compared, not the FLOPs.
    assert s == other == memox.SlotStats(hits=2, misses=1)
    assert s != memox.SlotStats(hits=2, misses=2)
    assert repr(s) == "SlotStats(hits=2, misses=1, flops=8)"
    # Rebuilt from leaves of any type, as JAX does (under the run-time type checker too).
    assert jax.tree.map(lambda _: None, s).hits is None
    shapes = jax.eval_shape(lambda s: s, jax.tree.map(jnp.int32, s))
    assert shapes.hits == jax.ShapeDtypeStruct((), jnp.int32) and shapes.flops == 8


class Big(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def normalised(self):
        self.counter.tick()
        return self.w / jnp.linalg.norm(self.w, axis=1, keepdims=True)


def test_an_eager_hit_copies_no_table_and_reads_the_value_once(monkeypatch):
    # Regression: an eager hit ran a jitted function of the whole slot (XLA copied every
    # table into its outputs) and decoded the value from the table again: 120 ms per hit
    # on a 64 MB value. Now the tables pass on as the very arrays, and the value is
    # decoded once per table and entry.
    reads = Counter()
    read_entry = memox._table.read_entry

    def counted(*args):
        reads.tick()
        return read_entry(*args)

    monkeypatch.setattr(memox._table, "read_entry", counted)
    c = Counter()
    m = Big(jax.random.normal(jax.random.key(0), (64, 32)), c)
    first, m = memox.call(m, Big.normalised)
    tables = [getattr(m.cache, f) for f in ("value", "key")]
    values = []
    for _ in range(3):
        y, m = memox.call(m, Big.normalised)
        values.append(y)
    assert all(getattr(m.cache, f) is x for f, x in zip(("value", "key"), tables))
    assert first is values[0] is values[1] is values[2]
    expected = np.asarray(first).copy()
    np.testing.assert_allclose(expected, m.w / jnp.linalg.norm(m.w, axis=1, keepdims=True))
    assert c.n == 1 and reads.n == 1
    assert memox.stats(m)["cache"] == memox.SlotStats(hits=3, misses=1)
    # A value the caller deleted (as a donation does) is decoded again, not returned.
    first.delete()
    y, m = memox.call(m, Big.normalised)
    np.testing.assert_array_equal(y, expected)
    assert c.n == 1 and reads.n == 2
    # A new dependency is a miss: the new table is read, not the old one's value.
    m = eqx.tree_at(lambda m: m.w, m, 2 * m.w + 1)
    y, m = memox.call(m, Big.normalised)
    np.testing.assert_allclose(y, m.w / jnp.linalg.norm(m.w, axis=1, keepdims=True), rtol=1e-6)
    assert c.n == 2
