"""`memox.jit`'s donation: nothing the caller holds loses its arrays (issue 18). A slot's
arrays are donated only where its node alone holds them, and that node is given the
returned slot; anything else holding them gets a copy donated in their place
(`memox/_donation.py`)."""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import Checked, Counter, Foo, foo, run_threads

import memox
import memox._partition
from memox._table import copied


def _usable(tree, tmp_path):
    """Everything a user does with a module they kept works: serialise, fetch, compile."""
    eqx.tree_serialise_leaves(tmp_path / "kept.eqx", tree)
    jax.device_get(tree)
    return eqx.filter_jit(lambda t: jax.tree.map(jnp.copy, eqx.filter(t, eqx.is_array)))(tree)


def test_a_module_kept_across_steps_stays_usable(tmp_path):
    # Regression: an early-stopping `best = model` lost its slot buffers to the next
    # `memox.jit` step (donated): serialising, `jax.device_get` and `eqx.filter_jit` of
    # it raised JAX's "Array has been deleted".
    c = Counter()
    step = memox.jit(lambda f, x: f.b() * x)
    f = foo(c)
    _, f = step(f, jnp.float32(1))
    best = f
    for i in range(3):
        _, f = step(f, jnp.float32(i))
        f = eqx.tree_at(lambda t: t.a, f, f.a + 1.0)  # the parameters move: recomputes
    _usable(best, tmp_path)
    assert not any(x.is_deleted() for x in jax.tree.leaves(best))
    jax.effects_barrier()
    assert c.n == 3  # one computation per parameter value
    # Its slot is the one the step after it left: filled for its parameters, a hit.
    b, best2 = memox.call(best, Foo.b)  # no warning (pytest: warnings are errors)
    jax.effects_barrier()
    assert b == jnp.sum(best.a) and best2.a is best.a and c.n == 3


def test_the_module_passed_in_stays_usable_and_keeps_what_the_call_stored(tmp_path):
    c = Counter()
    step = memox.jit(Foo.b)
    f = memox.init(foo(c))
    b1, g = step(f)  # f, not threaded: it still works, and holds the value computed
    b2, h = step(f)
    assert c.n == 1 and b1 == b2 == jnp.sum(f.a)
    _usable(f, tmp_path)
    _usable(g, tmp_path)
    _, h = step(h)
    assert c.n == 1 and memox.stats(h)["b_cache"].hits == 2


@pytest.mark.parametrize("holder", ["leaves", "tree_map", "the slot", "the value"])
def test_arrays_held_elsewhere_are_not_donated(holder, tmp_path):
    c = Counter()
    step = memox.jit(Foo.b)
    _, f = step(foo(c))
    kept = {
        "leaves": lambda: jax.tree.leaves(f),
        "tree_map": lambda: jax.tree.map(lambda x: x, f),  # new nodes, the same arrays
        "the slot": lambda: f.b_cache,
        "the value": lambda: [f.b_cache.value],
    }[holder]()
    for _ in range(2):
        _, f = step(f)
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
    _usable(kept, tmp_path)
    assert c.n == 1


class Holder(eqx.Module):
    extra: jax.Array | Checked
    f: Foo


@pytest.mark.parametrize("extra", ["array", "node that checks its leaves"])
def test_a_hit_in_the_threaded_loop_copies_no_table(extra):
    # The threaded loop donates the slot's buffers: the table stays where it is (a hit
    # copies nothing), also after the one step that copies because an old module was kept.
    c = Counter()
    step = memox.jit(lambda h, x: h.f.b() * x)
    h = Holder(jnp.ones(2) if extra == "array" else Checked(jnp.ones(2)), foo(c))
    _, h = step(h, jnp.float32(1))
    pointer = h.f.b_cache.value.unsafe_buffer_pointer()
    for i in range(3):
        _, h = step(h, jnp.float32(i))
        assert h.f.b_cache.value.unsafe_buffer_pointer() == pointer
    best = h  # kept: the next step leaves it readable (one copy), then donates again
    _, h = step(h, jnp.float32(1))
    _, h = step(h, jnp.float32(2))
    pointer = h.f.b_cache.value.unsafe_buffer_pointer()
    for i in range(3):
        _, h = step(h, jnp.float32(i))
        assert h.f.b_cache.value.unsafe_buffer_pointer() == pointer
    assert not any(x.is_deleted() for x in jax.tree.leaves(best)) and c.n == 1


def test_a_module_kept_costs_one_copy_though_it_shares_the_hits_entries(monkeypatch):
    # Regression: a hit decided on the host passes its slot's entries through, so a
    # module kept from an earlier step holds the entries of every later one. Only the
    # slot's other leaves are donated, yet every later step copied them all (s12, with
    # the module of the first call kept: 400 copies per call at 100 slots).
    c = Counter()
    step = memox.jit(lambda h, x: h.f.b() * x)
    _, h = step(Holder(jnp.ones(2), foo(c)), jnp.float32(1))
    _, h = step(h, jnp.float32(1))
    # A copy of the module made by a tree operation (as `eqx.apply_updates` makes one):
    # its slot nodes are new objects holding the same arrays.
    best = jax.tree.map(lambda x: x, h)
    copies = []

    def counted(leaves):
        copies.append(len(leaves))
        return copied(leaves)

    monkeypatch.setattr(memox._partition, "copied", counted)
    for i in range(4):
        _, h = step(h, jnp.float32(i))
    # The step after `best` was kept copies (it shares the counters too), then none.
    assert len(copies) == 1
    assert memox.stats(h)["f.b_cache"].hits == 5 and c.n == 1
    assert not any(x.is_deleted() for x in jax.tree.leaves(best))
    assert memox.stats(best)["f.b_cache"].hits == 1  # (as the call it was passed to left it)


def test_the_threaded_loop_gets_back_the_module_it_passed():
    # Where every slot node of the module passed in is given its returned slot, that
    # module holds what the call returned: it comes back, its parameters untouched, and
    # an alias of it reads the slots as the latest call left them (never a deleted array).
    c = Counter()
    step = memox.jit(lambda h, x: h.f.b() * x)
    h = memox.init(Holder(jnp.ones(2), foo(c)))
    w = h.extra
    alias = h
    for i in range(4):
        y, h = step(h, jnp.float32(i))
        assert h is alias and h.extra is w and float(y) == 36.0 * i
    assert memox.stats(alias)["f.b_cache"].hits == 3 and c.n == 1
    assert not any(x.is_deleted() for x in jax.tree.leaves(alias))


def test_a_slot_node_found_without_a_walk_is_the_one_in_the_module_passed():
    # A donating call finds each slot node again from the last call (`_donation.Holders`)
    # only where the reference counts prove it the node of the module passed in: a copy
    # of the module (new nodes holding the same arrays) is handed its own returned slots,
    # and the module it was copied from, still held, keeps readable arrays.
    c = Counter()
    step = memox.jit(lambda h, x: h.f.b() * x)
    h = memox.init(Holder(jnp.ones(2), foo(c)))
    for i in range(3):
        _, h = step(h, jnp.float32(i))
    copy = jax.tree.map(lambda x: x, h)  # new slot nodes, the same arrays
    assert copy.f.b_cache is not h.f.b_cache
    for i in range(3):
        y, copy = step(copy, jnp.float32(i))
        assert float(y) == 36.0 * i
    assert memox.stats(copy)["f.b_cache"].hits == 5 and memox.stats(h)["f.b_cache"].hits == 2
    alone = jax.tree.map(lambda x: x, copy)
    del copy  # (`alone`'s nodes now hold the arrays by themselves)
    for _ in range(2):
        y, back = step(alone, jnp.float32(1))
        assert back is alone and float(y) == 36.0
    assert memox.stats(alone)["f.b_cache"].hits == 7 and c.n == 1
    assert not any(x.is_deleted() for t in (h, alone) for x in jax.tree.leaves(t))


class _Pair(eqx.Module):
    p: Foo
    q: Foo
    # (enough leaves that a new module copies the nodes down the slots' paths alone)
    rest: tuple = tuple(jnp.zeros(()) for _ in range(32))


def test_a_node_handed_a_decided_hits_counters_is_not_shared_with_a_new_module():
    # A slot whose hit is decided on the host keeps its entries in its node, which is
    # handed the counters alone. Where another slot is held elsewhere (here its counters:
    # a copy is donated), the call returns a new module: it gets a node of its own, with
    # the same arrays, so the module passed in and the one returned never share a node.
    c = Counter()
    step = memox.jit(lambda m: m.p.b() + m.q.b())
    m = memox.init(_Pair(foo(c), foo(c, n=2)))
    before, held = [], []
    for _ in range(4):
        held.append(m.q.b_cache.counts)  # (the counters of `q` are held: never donated)
        before.append(m)
        y, m = step(m)
        assert float(y) == 36.0 + 6.0
        assert m is not before[-1] and m.p.b_cache is not before[-1].p.b_cache
        assert m.rest is before[-1].rest  # (the nodes off the slots' paths are shared)
        assert m.p.b_cache.value is before[-1].p.b_cache.value  # (entries kept, no copy)
    assert "conditional" not in step.lower(m).as_text()  # (both hits decided on the host)
    assert c.n == 2 and memox.stats(m)["p.b_cache"].hits == 3
    assert memox.stats(m)["q.b_cache"].hits == 3
    assert not any(x.is_deleted() for t in (*before, *held, m) for x in jax.tree.leaves(t))


class _Served(eqx.Module):
    w: jax.Array
    cache: memox.Memo[jax.Array] = memox.Memo()

    @memox.cached("cache")
    def gram(self):
        return jnp.tanh(self.w @ self.w.T)


def test_threads_sharing_one_model_lose_nothing_to_donation():
    # Regression (issue 31, case 8): four threads serving one filled model through one
    # `memox.jit` (donating, the returned model not threaded) raised "Buffer has been
    # deleted or donated" (3 to 122 calls of 800): one thread donated the slot's arrays
    # that another had just flattened.
    step = memox.jit(lambda m, x: m.gram() @ x)
    model = _Served(jnp.ones((32, 32)) / 32)
    for _ in range(2):
        _, model = step(model, jnp.ones(32))
    expected = jnp.tanh(model.w @ model.w.T)
    lock, results = threading.Lock(), []

    def serve(i, barrier):
        barrier.wait()
        for k in range(100):
            x = jnp.full(32, float(k + i))
            y, _ = step(model, x)
            with lock:
                results.append((x, y))

    run_threads(serve, n=4)
    assert len(results) == 400
    for x, y in results:
        assert jnp.allclose(y, expected @ x, rtol=1e-5)
