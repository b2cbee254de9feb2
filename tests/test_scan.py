"""`lax.scan` (and other loops) with the module as the carry."""

import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import Counter, Foo, foo

import memox


def _body(f, x):
    b, f = memox.call(f, Foo.b)
    return f, b * x


def test_fill_once_and_propagate_out_of_scan():
    c = Counter()
    f = memox.init(foo(c))
    f, ys = jax.lax.scan(_body, f, jnp.arange(5.0))
    assert c.n == 1
    assert jnp.allclose(ys, jnp.sum(f.a) * jnp.arange(5.0))
    assert memox.stats(f)["b_cache"] == memox.SlotStats(hits=4, misses=1)
    # The slot filled inside the scan reached the caller: the next call is a hit.
    _, f = memox.call(f, Foo.b)
    assert c.n == 1


def test_scan_inside_jit_traces_once():
    c = Counter()
    traces = []

    @jax.jit
    def run(f, xs):
        traces.append(None)
        return jax.lax.scan(_body, f, xs)

    f = memox.init(foo(c))
    for _ in range(3):
        f, ys = run(f, jnp.ones(4))
    assert len(traces) == 1 and c.n == 1
    assert memox.stats(f)["b_cache"] == memox.SlotStats(hits=11, misses=1)


@pytest.mark.parametrize("k", [1, 3, 4, 10])
def test_dependency_changing_every_k_steps(k):
    T = 10
    c = Counter()

    def body(f, t):
        bump = jnp.where((t > 0) & (t % k == 0), 1.0, 0.0)
        f = eqx.tree_at(lambda m: m.a, f, f.a.at[0, 0].add(bump))
        b, f = memox.call(f, Foo.b)
        return f, b

    f0 = memox.init(foo(c))
    f, bs = jax.jit(lambda f: jax.lax.scan(body, f, jnp.arange(T)))(f0)
    assert c.n == math.ceil(T / k)
    expected = jnp.sum(f0.a) + (jnp.arange(T) // k).astype(jnp.float32)
    assert jnp.allclose(bs, expected)


def test_fori_loop_and_while_loop():
    c = Counter()
    f = memox.init(foo(c))

    def body(i, carry):
        f, acc = carry
        b, f = memox.call(f, Foo.b)
        return f, acc + b

    f, acc = jax.lax.fori_loop(0, 4, body, (f, jnp.float32(0)))
    assert c.n == 1 and acc == 4 * jnp.sum(f.a)

    def cond(carry):
        return carry[1] < 3

    def wbody(carry):
        f, i = carry
        _, f = memox.call(f, Foo.b)
        return f, i + 1

    f, _ = jax.lax.while_loop(cond, wbody, (f, 0))
    assert c.n == 1 and memox.stats(f)["b_cache"].hits == 6


def test_module_closed_over_in_scan_recomputes_every_step_and_memox_warns():
    # A module that is not the carry cannot carry a fill from one step to the next:
    # each step's call sees the same (empty) slot, so memox says so. Values stay exact.
    c = Counter()
    f = memox.init(foo(c))

    def body(carry, x):
        b, _ = memox.call(f, Foo.b)
        return carry + b * x, None

    with pytest.warns(memox.UncachedWarning, match=r"inside a `scan` body on a module that"):
        out, _ = jax.lax.scan(body, jnp.float32(0), jnp.ones(3))
    jax.effects_barrier()
    assert out == 3 * jnp.sum(f.a)
    assert c.n == 3  # every step

    def carried(f, x):  # the fix for your own loop: the module is the carry
        b, f = memox.call(f, Foo.b)
        return f, b * x

    c.n = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", memox.UncachedWarning)
        f, ys = jax.lax.scan(carried, f, jnp.ones(3))
    jax.effects_barrier()
    assert c.n == 1


@pytest.mark.parametrize("loop", ["fori_loop", "while_loop"])
def test_module_closed_over_in_other_loops_warns(loop):
    f = memox.init(foo(Counter()))

    def body(i, acc):
        return acc + memox.call(f, Foo.b)[0]

    run = {
        "fori_loop": lambda: jax.lax.fori_loop(0, 3, body, jnp.float32(0)),
        "while_loop": lambda: jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, body(c[0], c[1])), (0, jnp.float32(0))
        )[1],
    }[loop]
    with pytest.warns(memox.UncachedWarning, match=r"on a module that the loop closes over"):
        out = run()
    assert out == 3 * jnp.sum(f.a)
