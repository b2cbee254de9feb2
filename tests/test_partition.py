"""The partition of a call's inputs into slots and everything else
(`memox/_partition.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import memox
from memox import _filter_jit, _partition, _plan
from memox._partition import ARRAY, ARRAY_TYPES, hashable_combine, hashable_partition


def test_the_inlined_array_test_is_equinoxs():
    # `ARRAY_TYPES` inlines `eqx.is_array` (no private Equinox import): it must agree
    # with it on every kind of leaf a module holds.
    leaves = [
        jnp.ones(2),
        np.ones(2),
        np.float32(1.0),
        jax.random.key(0),
        1.0,
        3,
        True,
        None,
        "s",
        jnp.sin,
        memox.Memo(),
    ]
    assert [isinstance(x, ARRAY_TYPES) for x in leaves] == list(map(eqx.is_array, leaves))


def _tree(w):
    return {"w": w, "n": np.arange(3), "k": 3, "f": jnp.sin, "s": "relu", "x": None}


def _split(tree):
    leaves, treedef = jtu.tree_flatten(tree)
    arrays = []
    return treedef, hashable_partition(leaves, arrays), arrays


def test_one_partition_takes_every_tree_apart_and_back():
    # The hashable half is the same for two trees that differ only in their arrays'
    # values (one compilation), holds no array, and the arrays go back where they were.
    tree = _tree(jnp.ones(2))
    treedef, statics, arrays = _split(tree)
    other = _split(_tree(jnp.zeros(2)))
    assert (treedef, statics) == other[:2] and hash(statics) == hash(other[1])
    assert sum(x is ARRAY for x in statics) == len(arrays) == 2
    assert not any(isinstance(x, ARRAY_TYPES) for x in statics)
    back = jtu.tree_unflatten(treedef, hashable_combine(statics, iter(arrays)))
    assert all(a is b for a, b in zip(jtu.tree_leaves(back), jtu.tree_leaves(tree), strict=True))


def test_every_wrapper_partitions_alike():
    # memox.jit's arguments, memox.filter_jit's call and the planning skeleton mark
    # the same leaves as arrays (one mechanism, not three that can drift apart).
    tree = _tree(jnp.ones(2))
    _, statics, _ = _split(tree)
    signature = _partition.Signature.split(eqx.nn.Identity(), (tree,), {}, False).signature
    call, _ = _filter_jit._Call.split(None, (tree,), {}, "none")
    parts, _ = _plan.Parts.split(tree)
    assert signature.argument_leaves == statics
    assert call.leaves == statics
    assert parts.statics == statics


class _Cached(eqx.Module):
    w: jax.Array
    cache: memox.Memo[jax.Array] = memox.Memo()
    other: memox.Memo[jax.Array] = memox.Memo()

    @memox.cached("cache")
    def scaled(self):
        return 2 * self.w

    @memox.cached("other", policy=memox.policies.Drift(rtol=0.1))
    def shifted(self):
        return self.w + 1


def test_a_slots_leaves_are_read_as_jax_flattens_them():
    from memox._slot import leaves_of

    m = _Cached(jnp.ones(3))
    filled = memox.call(memox.init(m), lambda m: (m.scaled(), m.shifted()))[1]
    filtered = eqx.filter(filled, eqx.is_inexact_array)  # (every slot field `None`)
    # Empty, allocated (with an unused snapshot, `None`, and a used one), filtered.
    for slot in (m.cache, filled.cache, filled.other, filtered.cache):
        expected = jtu.tree_leaves(slot)
        assert len(leaves_of(slot)) == len(expected)
        assert all(a is b for a, b in zip(leaves_of(slot), expected))


def test_a_loop_passes_one_signature_hashed_once(monkeypatch):
    hashed = []
    original = _partition.Signature.__hash__

    def counted(self):
        hashed.append(self.__dict__.get("_hash") is None)
        return original(self)

    monkeypatch.setattr(_partition.Signature, "__hash__", counted)
    step = memox.jit(lambda m, x: m.scaled() * x)
    m = _Cached(jnp.ones(3))
    signatures = []
    for x in (1.0, 2.0, 3.0, 4.0):
        y, m = step(m, jnp.float32(x))
        np.testing.assert_allclose(y, 2 * x * np.ones(3))
        signatures.append(step._signatures._last[0])
    # The signature of the loop's calls is one object from the second call on (the first
    # call allocated the slots: another signature), hashed when it was new only.
    assert signatures[1] is signatures[2] is signatures[3]
    assert sum(hashed) <= 3, hashed
    # A call with another static part (a Python float for an array) gets its own.
    y, m = step(m, 5.0)
    np.testing.assert_allclose(y, 10 * np.ones(3))
    assert step._signatures._last[0] is not signatures[3]
    assert step._signatures._last[0] != signatures[3]


class _Counted(eqx.Module):
    """An argument whose tree structure holds a number: `==` on its structure is not
    exact (`1 == True`), so its node data must be proven the same another way."""

    v: jax.Array
    n: int = eqx.field(static=True)


def test_a_loop_passing_new_arguments_and_a_rebuilt_module_passes_one_signature():
    # A training loop: an optimizer state is a new tuple at every call, and the module
    # is rebuilt by the caller (`eqx.combine`), not the one the call returned, which is
    # gone. Their node data are the same objects: the signature is passed again, not
    # compared by tokens.
    step = memox.jit(lambda m, s, x: m.scaled() * s.v * x)
    m = _Cached(jnp.ones(3))
    state = _Counted(jnp.ones(3), 1000)
    signatures = []
    for x in (1.0, 2.0, 3.0, 4.0):
        y, new = step(m, state, jnp.float32(x))
        np.testing.assert_allclose(y, 2 * x * np.ones(3))
        m = jtu.tree_unflatten(jtu.tree_structure(new), jtu.tree_leaves(new))  # rebuilt
        del new  # (nor is the module passed in kept: neither can vouch for the new one)
        state = _Counted(state.v + 0, state.n)  # new, holding the same number
        signatures.append(step._signatures._last[0])
    assert signatures[1] is signatures[2] is signatures[3]
    assert memox.stats(m)["cache"].hits == 3


def test_a_number_in_a_structure_that_changes_to_an_equal_one_of_another_type_compiles_anew():
    # `1 == True`, so the tree structures are equal by `==`; the node data are other
    # objects, whose tokens differ: a new signature, a new trace (the result's dtype
    # follows the type of the number).
    step = memox.jit(lambda m, s: (m.scaled(), jnp.asarray(s.n)))
    m = _Cached(jnp.ones(3))
    (_, n), m = step(m, _Counted(jnp.ones(3), 1))
    (_, n2), m = step(m, _Counted(jnp.ones(3), 1))
    assert n.dtype == n2.dtype == jnp.int32
    first = step._signatures._last[0]
    (_, n3), m = step(m, _Counted(jnp.ones(3), True))
    assert n3.dtype == jnp.bool_
    assert step._signatures._last[0] is not first and step._signatures._last[0] != first
    # The same in the module, a new one at every call.
    step2 = memox.jit(lambda c: jnp.asarray(c.n))
    one, _ = step2(_Counted(jnp.ones(3), 1))
    one, _ = step2(_Counted(jnp.ones(3), 1))
    other, _ = step2(_Counted(jnp.ones(3), True))
    assert one.dtype == jnp.int32 and other.dtype == jnp.bool_
