"""`jax.vmap` and `eqx.filter_vmap` around and inside `memox.call`: dependencies batched
(one slot per element, a select) and not batched (one slot, a real `cond`)."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, foo

import memox
from memox import Memo


def _counts(m, path="b_cache"):
    stats = memox.stats(m)[path]
    return stats.hits, stats.misses


def _primitives(jaxpr, in_cond=False):
    """`(name, inside a cond branch?)` for every equation of `jaxpr`, recursively."""
    found = []
    for eqn in jaxpr.eqns:
        found.append((eqn.primitive.name, in_cond))
        inner_in_cond = in_cond or eqn.primitive.name == "cond"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _primitives(sub, inner_in_cond)
    return found


def _method_runs_in_a_cond(fn, *args):
    """Whether `Foo.b`'s computation (its `debug_callback`) sits inside a real `cond`
    branch of `fn`'s jaxpr, rather than running unconditionally (as under a select)."""
    found = _primitives(jax.make_jaxpr(fn)(*args).jaxpr)
    callbacks = [in_cond for name, in_cond in found if name == "debug_callback"]
    assert callbacks, "the method's computation is missing from the jaxpr"
    return all(callbacks)


def _vmap(kind, fn, in_axes, out_axes):
    return (jax.vmap if kind == "jax.vmap" else eqx.filter_vmap)(
        fn, in_axes=in_axes, out_axes=out_axes
    )


def _scaled(f, x):
    return memox.call(f, lambda m: m.b() * x)


@pytest.mark.parametrize("kind", ["jax.vmap", "eqx.filter_vmap"])
def test_around_call_unbatched_dependencies_is_a_real_branch(kind):
    c = Counter()
    traces = 0

    def fn(f, x):
        nonlocal traces
        traces += 1
        return _scaled(f, x)

    run = _vmap(kind, fn, in_axes=(None, 0), out_axes=(0, None))
    f = memox.init(foo(c))
    xs = jnp.arange(3.0)
    step = eqx.filter_jit(run)
    for _ in range(3):
        ys, f = step(f, xs)
        np.testing.assert_array_equal(ys, np.asarray(f.a).sum() * np.arange(3.0))
    assert (traces, c.n) == (1, 1)
    assert _counts(f) == (2, 1)  # one (unbatched) check per batch
    assert _method_runs_in_a_cond(run, f, xs)


@pytest.mark.parametrize("kind", ["jax.vmap", "eqx.filter_vmap"])
def test_around_call_batched_dependencies_one_slot_per_element(kind):
    # A batched predicate would make the branch a select (both sides run): memox
    # computes and stores on every call (once per batch: `jax.debug.callback` is not
    # unrolled), counts misses per element, and says so; the values are exact.
    c = Counter()
    traces = 0

    def fn(f, x):
        nonlocal traces
        traces += 1
        return _scaled(f, x)

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
    assert traces == 1
    hits, misses = _counts(stacked)
    assert hits.tolist() == [0, 0] and misses.tolist() == [3, 3]
    with pytest.warns(memox.UncachedWarning, match="batched"):
        assert not _method_runs_in_a_cond(run, stacked, xs)


@pytest.mark.parametrize("jit", ["jax.jit", "memox.jit"])
def test_vmap_of_jit(jit):
    c = Counter()
    if jit == "memox.jit":
        step = memox.jit(lambda m, x: m.b() * x)
    else:
        step = jax.jit(_scaled)
    run = jax.jit(jax.vmap(step, in_axes=(None, 0), out_axes=(0, None)))
    f = memox.init(foo(c))
    xs = jnp.arange(4.0)
    for _ in range(2):
        ys, f = run(f, xs)
        np.testing.assert_array_equal(ys, np.asarray(f.a).sum() * np.arange(4.0))
    assert c.n == 1 and _counts(f) == (1, 1)


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
    assert c.n == 1 and _counts(f) == (2, 1)


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
    hits, misses = _counts(ms, "cache")
    assert hits.tolist() == [0, 0] and misses.tolist() == [1, 1]
    assert c.n == 1  # one batched execution
