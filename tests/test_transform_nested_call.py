"""`memox.call` inside the `fn` of another `memox.call`, on the same module and on a
submodule. Results are always exact. The counts document what is shared: each call has
a frame of its own over the module it was given, and the outer call's returned module
holds only the outer frame's writes."""

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import Counter, Foo, Inner, Outer, foo, hits_and_misses_by_slot, outer

import memox


def _call(fn):
    """`memox.call(module, fn)`, compiled (eager op-by-op dispatch is slow under the leak
    checker, and not the point here)."""
    return jax.jit(lambda f: memox.call(f, fn))


def test_same_module_inner_result_discarded():
    # The inner call fills its own frame; its module is dropped, so the outer `m.b()`
    # finds the outer frame's slot empty and computes again: 2 computations, and the
    # outer module records only its own miss. The dropped store is reported (ledger).
    c = Counter()
    f = memox.init(foo(c))
    with pytest.warns(memox.UncachedWarning, match="the value is dropped"):
        out, f = _call(lambda m: memox.call(m, Foo.b)[0] + m.b())(f)
    assert out == 2 * np.asarray(f.a).sum()
    assert c.n == 2 and hits_and_misses_by_slot(f) == {"b_cache": (0, 1)}
    _, f = _call(Foo.b)(f)  # the outer fill is the caller's
    assert c.n == 2


def test_same_module_outer_first():
    # The inner call gets `m` as it was passed to `fn` (empty slot), not the outer
    # frame's state: it computes again.
    c = Counter()
    f = memox.init(foo(c))
    with pytest.warns(memox.UncachedWarning, match="the value is dropped"):
        out, f = _call(lambda m: m.b() + memox.call(m, Foo.b)[0])(f)
    assert out == 2 * np.asarray(f.a).sum()
    assert c.n == 2 and hits_and_misses_by_slot(f) == {"b_cache": (0, 1)}


def test_same_module_inner_module_returned():
    # The inner fill reaches the caller through the inner module returned as the result;
    # the outer module is untouched.
    c = Counter()
    f = memox.init(foo(c))
    (b, inner), outer = _call(lambda m: memox.call(m, Foo.b))(f)
    assert b == np.asarray(f.a).sum() and c.n == 1
    assert hits_and_misses_by_slot(inner) == {"b_cache": (0, 1)}
    assert hits_and_misses_by_slot(outer) == {"b_cache": (0, 0)}
    _, inner = _call(Foo.b)(inner)
    assert c.n == 1


def test_same_module_inner_module_used_in_outer_fn():
    # A module returned by the inner call is not threaded through the outer frame: its
    # (filled) slot is not found there, so `m1.b()` computes, and memox warns. Exact, but
    # the fill is not shared and the outer module records nothing.
    c = Counter()

    def fn(m):
        b1, m1 = memox.call(m, Foo.b)
        return b1 + m1.b()

    with pytest.warns(memox.UncachedWarning, match=r"`Foo.b` ran inside `memox.call` but"):
        out, f = _call(fn)(memox.init(foo(c)))
    assert out == 2 * np.asarray(f.a).sum()
    assert c.n == 2 and hits_and_misses_by_slot(f) == {"b_cache": (0, 0)}


def _outer():
    m, ci, co = outer()
    return memox.init(m), ci, co


def _chol_plain(m):
    x = np.asarray(m.inner.x, np.float64)
    return np.linalg.cholesky(x @ x.T + np.diag(np.asarray(m.y)))


def test_submodule_inner_call_then_outer_nested_method():
    # The inner call fills `inner.gram_cache` in its own frame; `m.chol()` reaches
    # `inner.gram()` through the outer frame, where that slot is still empty: `gram`
    # runs twice, `chol` once.
    m, ci, co = _outer()

    def fn(m):
        g, _ = memox.call(m.inner, Inner.gram)
        return g, m.chol()

    with pytest.warns(memox.UncachedWarning, match="the value is dropped"):
        (g, L), m = _call(fn)(m)
    x = np.asarray(m.inner.x)
    np.testing.assert_allclose(g, x @ x.T, rtol=1e-6)
    np.testing.assert_allclose(L, _chol_plain(m), rtol=1e-5)
    assert (ci.n, co.n) == (2, 1)
    assert hits_and_misses_by_slot(m) == {"inner.gram_cache": (0, 1), "chol_cache": (0, 1)}
    _, m = _call(Outer.chol)(m)  # both outer fills are the caller's
    assert (ci.n, co.n) == (2, 1)


def test_submodule_filled_by_inner_call_and_put_back():
    # Putting the inner call's module back with `eqx.tree_at` does not share its fill:
    # the outer frame keeps its own state for `inner.gram_cache` (empty), so `gram`
    # runs again inside `chol`.
    m, ci, co = _outer()

    def fn(m):
        g, inner = memox.call(m.inner, Inner.gram)
        m = eqx.tree_at(lambda t: t.inner, m, inner)
        return m.chol()

    with pytest.warns(memox.UncachedWarning, match="the value is dropped"):
        L, m = _call(fn)(m)
    np.testing.assert_allclose(L, _chol_plain(m), rtol=1e-5)
    assert (ci.n, co.n) == (2, 1)
    assert hits_and_misses_by_slot(m) == {"inner.gram_cache": (0, 1), "chol_cache": (0, 1)}


def test_submodule_call_on_the_root_inside_a_call_on_the_root():
    # The inner call on the whole module fills both slots (nested methods fill once),
    # but its module is dropped: the outer module records nothing.
    m, ci, co = _outer()
    with pytest.warns(memox.UncachedWarning, match="the value is dropped"):
        L, m_out = _call(lambda m: memox.call(m, Outer.chol)[0])(m)
    np.testing.assert_allclose(L, _chol_plain(m), rtol=1e-5)
    assert (ci.n, co.n) == (1, 1)
    assert hits_and_misses_by_slot(m_out) == {"inner.gram_cache": (0, 0), "chol_cache": (0, 0)}
