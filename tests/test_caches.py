"""memox's process-wide caches (`memox/_caches.py`): bounded whatever a long-running
process does, emptied by `memox.clear_caches()`, and never the reason a value is wrong or
a filled slot is lost."""

import gc
import sys
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import Counter

import memox
from memox import _caches


def _fresh_model(i: int, counter: Counter):
    """A model of a class made here, for this call: a new class, method and closure each
    time, as a process that builds models in a loop makes them."""
    scale = float(i)

    class Fresh(eqx.Module):
        w: jax.Array
        c: memox.Memo[jax.Array] = memox.Memo()

        @memox.cached("c")
        def f(self):
            counter.tick()
            return jnp.sin(self.w).sum() * scale

    return Fresh, memox.init(Fresh(jnp.arange(3.0) + i))


def test_every_cache_stays_within_its_bound(monkeypatch):
    bounded = [t for t in _caches._REGISTRY.values() if isinstance(t, _caches.Cache)]
    assert len(bounded) >= 8  # plans, static keys, tokens, layouts, ...: all registered
    for table in bounded:
        monkeypatch.setattr(table, "max_size", 8)
    memox.clear_caches()
    step = memox.jit(lambda m: m.f())
    counter = Counter()
    for i in range(20):  # (more than twice each bound)
        kind, model = _fresh_model(i, counter)
        value, model = memox.call(model, kind.f)
        value2, model = step(model)
        assert float(value) == float(value2) == pytest.approx(float(jnp.sin(model.w).sum() * i))
        for table in bounded:
            assert len(table) <= 8, table.name
    del kind, model, value, value2
    gc.collect()
    # The weakly keyed tables hold only what is alive (at most the last loop's arrays).
    assert _caches.sizes()["allocated modules"] <= 1
    assert _caches.sizes()["fingerprints"] <= 4


class _Part:
    """A non-array part with no canonical token: memox numbers it by identity."""


class _WithPart(eqx.Module):
    w: jax.Array
    part: _Part = eqx.field(static=True)
    c: memox.Memo[jax.Array] = memox.Memo()

    @memox.cached("c")
    def f(self):
        return jnp.cos(self.w).sum()


def test_clear_caches_releases_what_the_keys_held():
    model = memox.init(_WithPart(jnp.arange(4.0), _Part()))
    # (Eagerly: a `jax.jit` of it leaves the part in JAX's own `lru_cache`s, which
    # `jax.clear_caches()` does not clear.)
    _, model = memox.call(model, _WithPart.f)
    part = weakref.ref(model.part)
    del model
    gc.collect()
    assert part() is not None  # memox's key holds it (numbered by identity) ...
    memox.clear_caches()
    jax.clear_caches()
    gc.collect()
    assert part() is None  # ... and nothing of memox's does after clear_caches
    assert all(n == 0 for n in _caches.sizes().values()), _caches.sizes()


_COUNTER = Counter()


class _Counted(eqx.Module):
    w: jax.Array
    c: memox.Memo[jax.Array] = memox.Memo()

    @memox.cached("c")
    def f(self):
        # (The counter is looked up by a string: a method's token holds the values of
        # the globals it names, and a `Counter` has no content, so it is numbered by
        # this process, anew after `memox.clear_caches()`.)
        getattr(sys.modules[__name__], "_COUNTER").tick()
        return jnp.tanh(self.w).sum()


def test_a_filled_slot_hits_after_clear_caches():
    start = _COUNTER.n
    first, model = memox.call(memox.init(_Counted(jnp.arange(5.0))), _Counted.f)
    memox.clear_caches()
    again, model = memox.call(model, _Counted.f)
    jax.effects_barrier()
    assert _COUNTER.n - start == 1  # computed once: the slot kept its value
    assert float(again) == float(first)
    moved = eqx.tree_at(lambda m: m.w, model, model.w + 1)
    memox.clear_caches()
    value, _ = memox.call(moved, _Counted.f)
    jax.effects_barrier()
    assert _COUNTER.n - start == 2  # never stale: a moved dependency recomputes
    assert float(value) == pytest.approx(float(jnp.tanh(moved.w).sum()))


def test_a_key_holding_a_numbered_part_misses_once_after_clear_caches():
    # `Fresh.f` closes over `counter`, an object memox can only number (by identity):
    # its number is new after a clear, so the slot recomputes once, then hits again.
    counter = Counter()
    kind, model = _fresh_model(2, counter)
    first, model = memox.call(model, kind.f)
    memox.clear_caches()
    for _ in range(3):
        value, model = memox.call(model, kind.f)
        assert float(value) == float(first)
    jax.effects_barrier()
    assert counter.n == 2
    assert memox.stats(model)["c"] == memox.SlotStats(hits=2, misses=2)


def test_two_caches_under_one_name_are_refused():
    with pytest.raises(RuntimeError, match="two caches named 'plans'"):
        _caches.Cache("plans", 4)
