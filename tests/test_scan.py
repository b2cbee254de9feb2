"""Loops around `memox.call` (`lax.scan`, `fori_loop`, `while_loop`): the module as the
carry, the module closed over, and loops composed with `grad`, `jit` and `vmap`.
(`memox.scan` has its own tests, test_memox_scan.py.)"""

import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, Traces, foo, hits_and_misses
from jax import lax

import memox
from memox import Memo


T = 6  # loop length


def _body(f, x):
    b, f = memox.call(f, Foo.b)
    return f, b * x


def _loop(kind, body, module, xs):
    """Run `body(module, x) -> (module, y)` over `xs` with `kind`; `(module, sum of y)`."""
    if kind == "scan":
        module, ys = lax.scan(body, module, xs)
        return module, ys.sum()

    def step(i, carry):
        module, acc = carry
        module, y = body(module, xs[i])
        return module, acc + y

    if kind == "fori_loop":
        return lax.fori_loop(0, xs.shape[0], step, (module, jnp.float32(0)))
    _, module, acc = lax.while_loop(
        lambda c: c[0] < xs.shape[0],
        lambda c: (c[0] + 1, *step(c[0], c[1:])),
        (0, module, jnp.float32(0)),
    )
    return module, acc


# -- the module as the carry ------------------------------------------------------------


def test_eager_scan_fills_once_and_propagates():
    c = Counter()
    f = memox.init(foo(c))
    f, ys = lax.scan(_body, f, jnp.arange(5.0))
    assert c.n == 1
    assert jnp.allclose(ys, jnp.sum(f.a) * jnp.arange(5.0))
    assert memox.stats(f)["b_cache"] == memox.SlotStats(hits=4, misses=1)
    # The slot filled inside the scan reached the caller: the next call is a hit.
    _, f = memox.call(f, Foo.b)
    assert c.n == 1


def test_eager_fori_loop_and_while_loop():
    c = Counter()
    f = memox.init(foo(c))

    def body(i, carry):
        f, acc = carry
        b, f = memox.call(f, Foo.b)
        return f, acc + b

    f, acc = lax.fori_loop(0, 4, body, (f, jnp.float32(0)))
    assert c.n == 1 and acc == 4 * jnp.sum(f.a)

    def cond(carry):
        return carry[1] < 3

    def wbody(carry):
        f, i = carry
        _, f = memox.call(f, Foo.b)
        return f, i + 1

    f, _ = lax.while_loop(cond, wbody, (f, 0))
    assert c.n == 1 and memox.stats(f)["b_cache"].hits == 6


@pytest.mark.parametrize("kind", ["scan", "fori_loop", "while_loop"])
def test_module_as_carry_fills_once_and_propagates(kind):
    c = Counter()
    traces = Traces()

    @jax.jit
    def run(f, xs):
        traces.tick()
        return _loop(kind, _body, f, xs)

    f = memox.init(foo(c))
    xs = jnp.arange(T, dtype=jnp.float32)
    for _ in range(2):
        f, total = run(f, xs)
        assert total == np.asarray(f.a).sum() * np.arange(T).sum()
    assert (traces.n, c.n) == (1, 1)
    assert hits_and_misses(f) == (2 * T - 1, 1)


@pytest.mark.parametrize("k", [1, 3, 4, 10])
def test_dependency_changing_every_k_steps(k):
    steps = 10
    c = Counter()

    def body(f, t):
        bump = jnp.where((t > 0) & (t % k == 0), 1.0, 0.0)
        f = eqx.tree_at(lambda m: m.a, f, f.a.at[0, 0].add(bump))
        b, f = memox.call(f, Foo.b)
        return f, b

    f0 = memox.init(foo(c))
    f, bs = jax.jit(lambda f: lax.scan(body, f, jnp.arange(steps)))(f0)
    assert c.n == math.ceil(steps / k)
    expected = jnp.sum(f0.a) + (jnp.arange(steps) // k).astype(jnp.float32)
    assert jnp.allclose(bs, expected)


# -- the module closed over -------------------------------------------------------------


def test_module_closed_over_in_scan_recomputes_every_step_and_memox_warns():
    # A module that is not the carry cannot carry a fill from one step to the next:
    # each step's call sees the same (empty) slot, so memox says so. Values stay exact.
    c = Counter()
    f = memox.init(foo(c))

    def body(carry, x):
        b, _ = memox.call(f, Foo.b)
        return carry + b * x, None

    with pytest.warns(memox.UncachedWarning, match=r"inside a `scan` body on a module that"):
        out, _ = lax.scan(body, jnp.float32(0), jnp.ones(3))
    jax.effects_barrier()
    assert out == 3 * jnp.sum(f.a)
    assert c.n == 3  # every step

    c.n = 0  # the fix for your own loop: the module is the carry
    with warnings.catch_warnings():
        warnings.simplefilter("error", memox.UncachedWarning)
        f, ys = lax.scan(_body, f, jnp.ones(3))
    jax.effects_barrier()
    assert c.n == 1


@pytest.mark.parametrize("loop", ["fori_loop", "while_loop"])
def test_module_closed_over_in_other_loops_warns(loop):
    f = memox.init(foo(Counter()))

    def body(i, acc):
        return acc + memox.call(f, Foo.b)[0]

    run = {
        "fori_loop": lambda: lax.fori_loop(0, 3, body, jnp.float32(0)),
        "while_loop": lambda: lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, body(c[0], c[1])), (0, jnp.float32(0))
        )[1],
    }[loop]
    with pytest.warns(memox.UncachedWarning, match=r"on a module that the loop closes over"):
        out = run()
    assert out == 3 * jnp.sum(f.a)


def test_module_closed_over_in_scan_opened_inside_call_fill_is_refused():
    # A scan opened inside `fn` over a closed-over module: the fill belongs to the loop
    # body and cannot leave it.
    f = memox.init(foo(Counter()))

    def fn(m):
        return lax.scan(lambda acc, x: (acc + m.b() * x, None), jnp.float32(0), jnp.ones(3))[0]

    with pytest.raises(ValueError, match=r"`Foo.b` updates slot `b_cache` with values that"):
        memox.call(f, fn)


def test_hit_on_module_closed_over_in_scan_opened_inside_call_is_refused():
    # Even a hit updates the slot (its counters) from inside the loop body: refused.
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)

    def fn(m):
        return lax.scan(lambda acc, x: (acc + m.b() * x, None), jnp.float32(0), jnp.ones(3))[0]

    with pytest.raises(ValueError, match=r"or read the value before it"):
        memox.call(f, fn)

    def read_first(m):
        b = m.b()
        return lax.scan(lambda acc, x: (acc + b * x, None), jnp.float32(0), jnp.ones(3))[0]

    total, f = memox.call(f, read_first)
    assert total == 3 * np.asarray(f.a).sum() and c.n == 1


# -- with a dependency that changes every K steps, under `grad` ------------------------
#
# `helpers.Counter.tick()` takes no operand, so under `grad` JAX's scan partial
# evaluation hoists it out of the loop as loop-invariant and it counts once. `Gram`'s
# callback reads the dependency, which changes along the loop, so it counts every real
# execution.
#
# Under `grad`, a `jax.debug.callback` that reads a value inside a `lax.scan` trips JAX's
# leak checker without memox (a false positive: the tracer is held by the partial-eval
# trace's effect handles; `jax.grad` of `lax.scan(lambda w, _: (w + 1,
# jax.debug.callback(f, w)) ...)` reproduces it). The counted gradient runs therefore turn
# the checker off, and `test_grad_of_scan` checks the same computations, uncounted, with
# it on.


class Gram(eqx.Module):
    w: jax.Array  # (3, 3) parameter
    counter: Counter | None = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def gram(self):
        if self.counter is not None:
            bump = self.counter._bump  # not a closure over `self`: that would hold tracers
            jax.debug.callback(lambda _: bump(), self.w)
        return jnp.tanh(self.w @ self.w.T)


K = 2  # the dependency changes at steps K, 2K, ...
N_COMPUTE = math.ceil(T / K)


def _bump(t):
    return jnp.where((t > 0) & (t % K == 0), 0.1, 0.0).astype(jnp.float32)


def _loss_memo(m, xs):
    def body(m, tx):
        t, x = tx
        m = eqx.tree_at(lambda m: m.w, m, m.w + _bump(t))
        g, m = memox.call(m, Gram.gram)
        return m, x @ g @ x

    m, ys = lax.scan(body, m, (jnp.arange(T), xs))
    return ys.sum(), m


@jax.jit
def _loss_plain(w, xs):
    total = jnp.float32(0)
    for t in range(T):
        w = w + _bump(t)
        total = total + xs[t] @ jnp.tanh(w @ w.T) @ xs[t]
    return total


def _gram(counted=True):
    c = Counter()
    return memox.init(Gram(jnp.arange(9.0).reshape(3, 3) / 10, c if counted else None)), c


XS = jnp.linspace(-1, 1, 3 * T).reshape(T, 3)


def test_forward_computes_once_per_dependency_change():
    m0, c = _gram()
    value, m = jax.jit(_loss_memo)(m0, XS)
    np.testing.assert_allclose(value, _loss_plain(m0.w, XS), rtol=1e-6)
    assert c.n == N_COMPUTE
    assert hits_and_misses(m, "cache") == (T - N_COMPUTE, N_COMPUTE)


def _grad_w(m, xs):
    return eqx.filter_value_and_grad(_loss_memo, has_aux=True)(m, xs)


def _grad_xs(m, xs):
    return jax.value_and_grad(lambda xs: _loss_memo(m, xs), has_aux=True)(xs)


def _grad_plain(wrt, w, xs):
    return jax.jit(jax.grad(_loss_plain, argnums=0 if wrt == "w" else 1))(w, xs)


@pytest.mark.parametrize("wrt", ["w", "xs"])
def test_grad_of_scan(wrt):
    # Eager `grad` (the scan itself is compiled), under the leak checker, uncounted.
    m, _ = _gram(counted=False)
    (value, m_out), g = (_grad_w if wrt == "w" else _grad_xs)(m, XS)
    np.testing.assert_allclose(value, _loss_plain(m.w, XS), rtol=1e-6)
    np.testing.assert_allclose(g.w if wrt == "w" else g, _grad_plain(wrt, m.w, XS), rtol=1e-5)
    per_call = T if wrt == "w" else N_COMPUTE
    assert hits_and_misses(m_out, "cache") == (T - per_call, per_call)


@pytest.mark.parametrize("wrt", ["w", "xs"])
def test_jit_of_grad_of_scan(wrt):
    # W.r.t. `w`, the dependency carries a tangent: every step is differentiated as if
    # unmemoized and recomputes (and stores) the value. W.r.t. `xs` only, the
    # dependency is frozen: the cached path stands and computes once per change.
    m, c = _gram()
    traces = Traces()

    @eqx.filter_jit
    def grads(m, xs):
        traces.tick()
        return (_grad_w if wrt == "w" else _grad_xs)(m, xs)

    g_ref = _grad_plain(wrt, m.w, XS)
    per_call = T if wrt == "w" else N_COMPUTE
    with jax.check_tracer_leaks(False):  # see the note above `Gram`
        for i in range(1, 3):
            (value, m_out), g = grads(m, XS)
            np.testing.assert_allclose(value, _loss_plain(m.w, XS), rtol=1e-6)
            np.testing.assert_allclose(g.w if wrt == "w" else g, g_ref, rtol=1e-5)
            assert c.n == i * per_call
    assert traces.n == 1
    assert hits_and_misses(m_out, "cache") == (T - per_call, per_call)


# -- loops and `vmap` -------------------------------------------------------------------


def test_scan_of_vmap_inside_call_unbatched_dependencies():
    # `vmap` inside `fn` over arguments only: one real check for the batch, and the fill
    # propagates through the carry.
    c = Counter()

    def body(f, xs):
        ys, f = memox.call(f, lambda m: jax.vmap(lambda x: m.b() * x)(xs))
        return f, ys

    f = memox.init(foo(c))
    xs = jnp.arange(3.0 * T).reshape(T, 3)
    f, ys = jax.jit(lambda f, xs: lax.scan(body, f, xs))(f, xs)
    np.testing.assert_allclose(ys, np.asarray(f.a).sum() * np.asarray(xs))
    assert c.n == 1 and hits_and_misses(f) == (T - 1, 1)


def test_scan_of_vmap_around_call_batched_modules():
    # A stack of 2 modules as the carry, `vmap` around `memox.call` in the body: one slot
    # per element. The predicate is batched (a select would run both sides), so memox
    # computes at every step (once per batch: `jax.debug.callback` is not unrolled),
    # counts misses per element and says so; values are exact.
    c = Counter()
    stacked = eqx.filter_vmap(memox.init)(Foo(jnp.arange(18.0).reshape(2, 3, 3), c))

    def step(f, x):
        bs, f = eqx.filter_vmap(lambda f: memox.call(f, Foo.b))(f)
        return f, bs * x

    loop = jax.jit(lambda f, xs: lax.scan(step, f, xs))
    with pytest.warns(memox.UncachedWarning, match="batched"):
        stacked, ys = loop(stacked, jnp.arange(1.0, T + 1))
    b = np.asarray(stacked.a).sum(axis=(1, 2))
    np.testing.assert_allclose(ys, np.arange(1.0, T + 1)[:, None] * b[None, :])
    hits, misses = hits_and_misses(stacked)
    assert hits.tolist() == [0] * 2 and misses.tolist() == [T] * 2
    assert c.n == T
