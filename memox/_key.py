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
import os
from typing import Any

import jax

from . import _jax_internals
from ._token import serialise


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


def explicit_sharding(aval: Any) -> Any:
    """The sharding of `aval` where its mesh has `Explicit` axes (part of the type
    there), else `None` (placement only: XLA propagates it, the value is the same)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return None
    return sharding


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
