"""Slots round-trip through `eqx.tree_serialise_leaves`; a restored slot is a hit only on
the dependencies it was computed from."""

import equinox as eqx
import jax.numpy as jnp
from helpers import Counter, Foo, foo

import memox


def test_restored_slot_hits_on_same_weights_and_recomputes_on_others(tmp_path):
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, f)

    like = memox.init(foo(c))
    restored = eqx.tree_deserialise_leaves(path, like)
    b, restored = memox.call(restored, Foo.b)
    assert c.n == 1 and b == jnp.sum(f.a)  # same weights: a hit

    other = eqx.tree_at(lambda t: t.a, restored, restored.a.at[1, 1].set(-5.0))
    b, _ = memox.call(other, Foo.b)
    assert c.n == 2 and b == jnp.sum(other.a)  # other weights: recomputed


def test_slot_restored_onto_other_weights_recomputes(tmp_path):
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, f)
    # A model with other weights loads the slot (saved with the old ones): not a hit.
    other = memox.init(Foo(jnp.ones((3, 3)), c))
    loaded = eqx.tree_deserialise_leaves(path, other)
    loaded = eqx.tree_at(lambda t: t.a, loaded, jnp.ones((3, 3)))
    b, _ = memox.call(loaded, Foo.b)
    assert c.n == 2 and b == 9.0


def test_checkpoint_without_caches_holds_no_cache_data_and_refills(tmp_path):
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)
    full, bare, fresh = tmp_path / "full.eqx", tmp_path / "bare.eqx", tmp_path / "fresh.eqx"
    eqx.tree_serialise_leaves(full, f)
    eqx.tree_serialise_leaves(bare, memox.strip(f))
    eqx.tree_serialise_leaves(fresh, foo(c))
    # No cache data: what a model as constructed writes (its slots' empty markers).
    assert bare.read_bytes() == fresh.read_bytes() != full.read_bytes()
    # A stripped module is a model as constructed: it loads into `memox.strip(like)`,
    # whatever `like`'s slots hold.
    for like in (foo(c), memox.strip(f), memox.strip(memox.init(foo(c)))):
        loaded = eqx.tree_deserialise_leaves(bare, like)
        assert jnp.array_equal(loaded.a, f.a) and not loaded.b_cache.allocated
    b, _ = memox.call(loaded, Foo.b)
    assert c.n == 2 and b == jnp.sum(f.a)
