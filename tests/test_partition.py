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
