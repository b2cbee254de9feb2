"""`jax.vmap` and `eqx.filter_vmap` around and inside `memox.call`: dependencies batched
(one slot per element, a select) and not batched (one slot, a real `cond`)."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, Traces, call_b_times, foo, hits_and_misses, primitives

import memox
from memox import Memo


def _method_runs_in_a_cond(fn, *args):
    """Whether `Foo.b`'s computation (its `debug_callback`) sits inside a real `cond`
    branch of `fn`'s jaxpr, rather than running unconditionally (as under a select)."""
    found = primitives(jax.make_jaxpr(fn)(*args).jaxpr)
    callbacks = [in_cond for name, in_cond in found if name == "debug_callback"]
    assert callbacks, "the method's computation is missing from the jaxpr"
    return all(callbacks)


def _vmap(kind, fn, in_axes, out_axes):
    return (jax.vmap if kind == "jax.vmap" else eqx.filter_vmap)(
        fn, in_axes=in_axes, out_axes=out_axes
    )


# -- `vmap` around `memox.call` --------------------------------------------------------


@pytest.mark.parametrize("kind", ["jax.vmap", "eqx.filter_vmap"])
def test_around_call_unbatched_dependencies_is_a_real_branch(kind):
    c = Counter()
    traces = Traces()

    def fn(f, x):
        traces.tick()
        return call_b_times(f, x)

    run = _vmap(kind, fn, in_axes=(None, 0), out_axes=(0, None))
    f = memox.init(foo(c))
    xs = jnp.arange(3.0)
    step = eqx.filter_jit(run)
    for _ in range(3):
        ys, f = step(f, xs)
        np.testing.assert_array_equal(ys, np.asarray(f.a).sum() * np.arange(3.0))
    assert (traces.n, c.n) == (1, 1)
    assert hits_and_misses(f) == (2, 1)  # one (unbatched) check per batch
    assert _method_runs_in_a_cond(run, f, xs)


def test_around_call_eager_on_a_filled_unbatched_module_is_one_check():
    c = Counter()
    f = memox.init(foo(c))
    _, f = memox.call(f, Foo.b)
    xs = jnp.arange(3.0)
    run = jax.vmap(call_b_times, in_axes=(None, 0), out_axes=(0, None))
    assert _method_runs_in_a_cond(run, f, xs)
    ys, f2 = run(f, xs)
    assert c.n == 1
    assert jnp.allclose(ys, jnp.sum(f.a) * xs)
    assert memox.stats(f2)["b_cache"].hits == 1  # one (unbatched) check for the batch


@pytest.mark.parametrize("kind", ["jax.vmap", "eqx.filter_vmap"])
def test_around_call_batched_dependencies_one_slot_per_element(kind):
    # A batched predicate would make the branch a select (both sides run): memox
    # computes and stores on every call (once per batch: `jax.debug.callback` is not
    # unrolled), counts misses per element, and says so; the values are exact.
    c = Counter()
    traces = Traces()

    def fn(f, x):
        traces.tick()
        return call_b_times(f, x)

    stacked = eqx.filter_vmap(memox.init)(Foo(jnp.arange(18.0).reshape(2, 3, 3), c))
    run = _vmap(kind, fn, in_axes=(0, 0), out_axes=(0, 0))
    xs = jnp.arange(1.0, 3.0)
    step = eqx.filter_jit(run)
    for i in range(1, 4):
        with contextlib.ExitStack() as stack:
            if i == 1:  # (said when traced)
                stack.enter_context(pytest.warns(memox.UncachedWarning, match="batched"))
            ys, stacked = step(stacked, xs)
        expected = np.asarray(stacked.a).sum(axis=(1, 2)) * np.arange(1.0, 3.0)
        np.testing.assert_array_equal(ys, expected)
        assert c.n == i
    assert traces.n == 1
    hits, misses = hits_and_misses(stacked)
    assert hits.tolist() == [0, 0] and misses.tolist() == [3, 3]
    with pytest.warns(memox.UncachedWarning, match="batched"):
        assert not _method_runs_in_a_cond(run, stacked, xs)


def test_around_call_eager_batched_modules_each_fill_their_own_slot():
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
    hits, misses = hits_and_misses(stacked)
    assert hits.tolist() == [0, 0] and misses.tolist() == [2, 2]


@pytest.mark.parametrize("jit", ["jax.jit", "memox.jit"])
def test_vmap_of_jit(jit):
    c = Counter()
    if jit == "memox.jit":
        step = memox.jit(lambda m, x: m.b() * x)
    else:
        step = jax.jit(call_b_times)
    run = jax.jit(jax.vmap(step, in_axes=(None, 0), out_axes=(0, None)))
    f = memox.init(foo(c))
    xs = jnp.arange(4.0)
    for _ in range(2):
        ys, f = run(f, xs)
        np.testing.assert_array_equal(ys, np.asarray(f.a).sum() * np.arange(4.0))
    assert c.n == 1 and hits_and_misses(f) == (1, 1)


# -- `vmap` inside `memox.call` --------------------------------------------------------


def test_inside_call_unbatched_dependencies_is_a_real_branch():
    c = Counter()
    f = memox.init(foo(c))
    xs = jnp.arange(4.0)

    def fn(f, xs):
        return memox.call(f, lambda m: jax.vmap(lambda x: m.b() * x)(xs))

    assert _method_runs_in_a_cond(fn, f, xs)
    step = jax.jit(fn)
    for _ in range(3):
        ys, f = step(f, xs)
    np.testing.assert_array_equal(ys, np.asarray(f.a).sum() * np.arange(4.0))
    assert c.n == 1 and hits_and_misses(f) == (2, 1)


# -- batched arguments of a method with arguments --------------------------------------


class Keyed(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def apply(self, x):
        self.counter.tick()
        return self.w * x


def test_batched_fill_into_unbatched_slot_is_refused():
    m = Keyed(jnp.ones(3), Counter())
    with pytest.raises(ValueError) as excinfo:
        eqx.filter_jit(lambda m, xs: memox.call(m, lambda m: jax.vmap(m.apply)(xs)))(
            m, jnp.ones((2, 3))
        )
    msg = str(excinfo.value)
    assert msg.startswith(
        "`Keyed.apply` updates slot `cache` with values that belong to a JAX transformation"
    )
    assert "Either run `memox.call` inside the transformation" in msg


def test_batched_arguments_around_call_one_slot_per_element():
    # The documented fix for the error above: `memox.call` inside the `vmap`.
    c = Counter()
    m = memox.init(Keyed(jnp.arange(3.0), c), Keyed.apply, jnp.ones(3))
    xs = jnp.arange(6.0).reshape(2, 3)
    run = jax.jit(jax.vmap(lambda m, x: memox.call(m, Keyed.apply, x), in_axes=(None, 0)))
    with pytest.warns(memox.UncachedWarning, match="batched"):  # a key per element
        ys, ms = run(m, xs)
    np.testing.assert_array_equal(ys, np.arange(3.0) * np.arange(6.0).reshape(2, 3))
    hits, misses = hits_and_misses(ms, "cache")
    assert hits.tolist() == [0, 0] and misses.tolist() == [1, 1]
    assert c.n == 1  # one batched execution


def test_batched_arguments_around_call_eager_one_slot_per_element():
    m = memox.init(Keyed(jnp.ones(3), Counter()), Keyed.apply, jnp.ones(3))
    xs = jnp.arange(6.0).reshape(2, 3)
    with pytest.warns(memox.UncachedWarning, match="batched"):  # a key per element
        ys, ms = jax.vmap(lambda x: memox.call(m, Keyed.apply, x))(xs)
    assert jnp.allclose(ys, xs)
    assert ms.cache.value.shape[0] == 2  # one slot per element
