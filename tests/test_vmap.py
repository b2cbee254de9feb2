"""`jax.vmap` around and inside `memox.call`: real branches when nothing is batched."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import Counter, Foo, foo

import memox


def _primitives(jaxpr):
    """Every primitive name in a jaxpr, recursively through sub-jaxprs."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for param in eqn.params.values():
            subs = param if isinstance(param, (tuple, list)) else [param]
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names += _primitives(inner)
    return names


def test_vmap_inside_call_with_unbatched_dependencies_is_a_real_branch():
    c = Counter()
    f = memox.init(foo(c))
    xs = jnp.arange(4.0)

    def fn(f, xs):
        return memox.call(f, lambda m: jax.vmap(lambda x: m.b() * x)(xs))

    names = _primitives(jax.make_jaxpr(fn)(f, xs).jaxpr)
    assert "cond" in names
    step = jax.jit(fn)
    for _ in range(3):
        ys, f = step(f, xs)
    assert c.n == 1
    assert jnp.allclose(ys, jnp.sum(f.a) * xs)


def test_call_inside_vmap_with_unbatched_module_stays_unbatched():
    c = Counter()
    f = memox.init(foo(c))
    _, f = memox.call(f, Foo.b)
    xs = jnp.arange(3.0)
    run = jax.vmap(
        lambda f, x: memox.call(f, lambda m: m.b() * x), in_axes=(None, 0), out_axes=(0, None)
    )
    names = _primitives(jax.make_jaxpr(run)(f, xs).jaxpr)
    assert "cond" in names
    ys, f2 = run(f, xs)
    assert c.n == 1
    assert jnp.allclose(ys, jnp.sum(f.a) * xs)
    assert memox.stats(f2)["b_cache"].hits == 1  # one (unbatched) check for the batch


def test_batched_modules_each_fill_their_own_slot():
    c = Counter()
    stacked = Foo(jnp.arange(18.0).reshape(2, 3, 3), c)
    stacked = eqx.filter_vmap(memox.init)(stacked)
    run = eqx.filter_vmap(lambda f: memox.call(f, Foo.b))
    with pytest.warns(memox.UncachedWarning, match="batched"):
        bs, stacked = run(stacked)
    assert jnp.allclose(bs, jnp.sum(stacked.a, axis=(1, 2)))
    with pytest.warns(memox.UncachedWarning, match="batched"):
        bs2, stacked = run(stacked)
    assert jnp.allclose(bs, bs2)
    # A batched predicate would make the branch a select (both sides run for every
    # element): memox computes, stores per element and counts misses, and says so.
    stats = memox.stats(stacked)["b_cache"]
    assert stats.hits.tolist() == [0, 0] and stats.misses.tolist() == [2, 2]


def test_vmap_over_arguments_of_a_keyed_method():
    class Keyed(eqx.Module):
        w: jax.Array
        cache: memox.Memo[jax.Array] = memox.Memo()

        @memox.cached("cache")
        def apply(self, x):
            return self.w * x

    m = memox.init(Keyed(jnp.ones(3)), Keyed.apply, jnp.ones(3))
    xs = jnp.arange(6.0).reshape(2, 3)
    with pytest.warns(memox.UncachedWarning, match="batched"):  # a key per element
        ys, ms = jax.vmap(lambda x: memox.call(m, Keyed.apply, x))(xs)
    assert jnp.allclose(ys, xs)
    assert ms.cache.value.shape[0] == 2  # one slot per element
