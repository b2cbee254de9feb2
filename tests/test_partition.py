"""The partition of a call's inputs into slots and everything else
(`memox/_partition.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import memox
from memox._partition import ARRAY_TYPES


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
