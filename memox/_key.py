"""The cache key: exactly what a stored value may be reused for.

**The rule: what `jax.jit` keys on, plus the values read.** A stored value is reused
only when everything the method's output can depend on is the same as when it was
computed:

1. the *trace context*: the JAX configuration `jax.jit` puts in its own cache key
   (`jax_enable_x64`, the PRNG flags, default matmul precision, dtype promotion, the
   mesh and axis environment, ...: `_jax_internals.trace_context`, read from JAX, not a
   list of memox's own);
2. the *abstract type* of every array the method receives: each array of the module
   (`self` and its submodules, whether the method reads it or not) and each array
   argument: shape, dtype, weak type, and sharding where it is part of the type
   (`Explicit` mesh axes, `shard_map`'s varying axes);
3. the *non-array parts*: the method and its policy, the module's tree structure with
   its static fields, its non-array leaves (activation functions, flags, ...), and the
   method's non-array arguments and their structure, by their *token* (`_token.py`);
4. the *values* (bits) of the arrays the method reads, and of its array arguments: a
   fingerprint (`_fingerprint.py`). Policies (`Exact`, `Drift`, `Manual`) relax this
   part only, for the module's arrays.

(1)-(3) are known when the method is traced: together they are the *static key*, which
also selects the method's plan, and whose 64-bit digest salts the fingerprint of (4).
This module computes it, in one place. Its bytes are the canonical bytes of its tokens
(`_token.serialise`), the same in every process, unless it holds a part this process
numbered (`_token.py`): its digest is then salted with a per-process nonce.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import os
import types
from typing import Any

import jax
import numpy as np

from . import _jax_internals
from ._jax_internals import children_and_data, explicit_sharding, node_data
from ._token import serialise, token


# -- (2) the abstract type of an array -------------------------------------------------


def signature(x: Any) -> tuple[Any, ...]:
    """The abstract type of array `x` as the key sees it: shape, dtype, weak type,
    sharding where it is part of the type (`Explicit` mesh axes) and `shard_map`'s
    varying axes. Hashable, equal for arrays of the same type."""
    aval = jax.typeof(x)
    weak = bool(getattr(aval, "weak_type", False))
    sharding = explicit_sharding(aval)
    placed = None if sharding is None else _sharding_parts(sharding)
    return (tuple(aval.shape), str(aval.dtype), weak, placed, varying(aval))


def _sharding_parts(sharding: Any) -> tuple[Any, ...]:
    """A `NamedSharding` as plain values: mesh axes, sizes and types, and the spec."""
    mesh = sharding.mesh
    spec = tuple(e if e is None or isinstance(e, str) else tuple(e) for e in sharding.spec)
    types = tuple(str(t) for t in mesh.axis_types)
    return tuple(mesh.axis_names), tuple(mesh.axis_sizes), types, spec


def varying(aval: Any) -> tuple[str, ...]:
    """The `shard_map` mesh axes `aval` varies over (empty outside `shard_map`), sorted."""
    return tuple(sorted(map(str, _jax_internals.varying_axes(aval))))


# -- the static key: (1)-(3) as the canonical bytes of their tokens --------------------


_NONCE = os.urandom(16)


@dataclasses.dataclass(frozen=True)
class StaticKey:
    """The static part of a cache key (see the module docstring): hashable and equal
    exactly when two calls have the same non-array parts and array types. `digest` is
    its 64-bit salt, stable across processes unless `local`."""

    encoded: bytes
    local: bool

    @functools.cached_property
    def digest(self) -> tuple[int, int]:
        text = self.encoded + (_NONCE if self.local else b"")
        digest = hashlib.blake2b(text, digest_size=8).digest()
        return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def static_key(*tokens: Any) -> StaticKey:
    """The static key made of `tokens` (of the method and its policy, the trace context,
    tree structures, non-array leaves and array signatures), as the module docstring
    states."""
    out: list[bytes] = []
    local = serialise(tokens, out)
    return StaticKey(b"".join(out), local)


# -- static parts compared exactly, cheaply -------------------------------------------


def exact_under_eq(treedef: Any) -> bool:
    """Whether `PyTreeDef.__eq__`, which compares the data of each node with `==`, is
    exact for tree structures equal to `treedef`: no node holds data that an unequal
    value could equal. Strings, `None`, classes, functions and objects compared by
    identity are exact; numbers are not (`1 == True == 1.0`, `0.0 == -0.0`), nor are
    arrays and objects with their own `__eq__`. Both sides of an equality fall in the
    same class, so the answer for one structure holds for every structure equal to it."""
    stack = [treedef]
    while stack:
        t = stack.pop()
        data = t.node_data()
        if data is not None and not _exact_datum(data[1]):
            return False
        stack.extend(t.children())
    return True


def _exact_datum(x: Any) -> bool:
    kind = type(x)
    if x is None or kind is str:
        return True
    if kind is tuple or kind is list:  # (a dict's keys are a list)
        return all(map(_exact_datum, x))
    if isinstance(x, type) or kind is types.FunctionType or kind is types.BuiltinFunctionType:
        return True
    return kind.__eq__ is object.__eq__  # compared by identity


def same_nodes(new: Any, old: Any) -> bool:
    """Whether pytrees `new` and `old`, whose tree structures are equal, hold exactly the
    same data in every node. A subtree that both share (the same object) is skipped: a
    threaded module shares all but the nodes on the paths to its slots. Elsewhere the
    data of two nodes are equal where each part is the same object, else where their
    tokens are equal. Leaves are not compared."""
    stack = [(new, old)]
    while stack:
        a, b = stack.pop()
        if a is b or isinstance(a, _ARRAYS):
            continue
        one, other = children_and_data(a), children_and_data(b)
        if one is None or other is None:
            continue
        if not _same_data(one[1], other[1]):
            return False
        stack.extend(zip(one[0], other[0]))
    return True


def same_structures(new: Any, old: list[Any]) -> bool:
    """Whether tree structure `new` holds exactly the data `old` holds in every node
    (`old`: the `node_data` of a structure equal to `new` by `==`): `same_nodes` for the
    structures alone, where no earlier pytree is at hand (a training loop's optimizer
    state is a new tuple at every call)."""
    one = node_data(new)
    if len(one) != len(old):
        return False
    for a, b in zip(one, old):
        if a is not b and not _same_data(a, b):
            return False
    return True


def _same_data(a: Any, b: Any) -> bool:
    if a is b:
        return True
    # (a node's data is often a tuple or a list made anew, of the same objects)
    if type(a) is type(b) and type(a) in (tuple, list) and len(a) == len(b):
        if all(map(operator.is_, a, b)):
            return True
    return token(a) == token(b)


_ARRAYS = (jax.Array, np.ndarray, np.generic)


# -- the verdict -----------------------------------------------------------------------


def same(recorded: Any, now: Any) -> bool:
    """Whether key `recorded`, under which a value was stored, is key `now` of a call:
    the one comparison of keys on the host (in-graph: `_table.holds_key`). A key here is
    a frozen value built of static keys (their canonical bytes), input positions and
    value types, so equality is exact (never a user object's `==`). The values read
    complete it: the in-graph check compares their fingerprints, salted with the static
    key's digest; a compiled wrapper's host compares the arrays themselves by identity
    (`_decided.Hits.decide`: an immutable array is its fingerprint)."""
    return recorded is now or recorded == now
