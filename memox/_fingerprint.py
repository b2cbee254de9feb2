"""Fingerprints of what a cached value depends on.

A slot stores a 64-bit fingerprint (two `uint32` words) of the dependencies its value
was computed from; a hit requires the fingerprint of the current dependencies to match.
It costs O(1) memory per slot (no copy of the dependencies) and one fused pass over the
dependencies' bytes per check.

The dynamic part (array dependencies and array arguments) is hashed in-graph. Each
32-bit word `w_i` of an array's bit pattern (position `i`, array number `j`) is mixed
once and summed into two lanes:

    m_i   = fmix(w_i * A + i * B + seed_j)           (MurmurHash3's 32-bit finaliser)
    lane0 = fmix(salt0 + sum_i m_i)                  (mod 2**32)
    lane1 = fmix(salt1 + sum_i m_i * ((i * C) | 1))  (mod 2**32)

`fmix` and `w -> w * A + c` (odd `A`) are bijections, so changing any single element
changes `m_i` and therefore lane 0: a one-element change is detected with certainty. For
a random change of two or more elements the mixed differences are pseudo-random, each
lane collides with probability about 2**-32, and the two lanes weight them differently
(odd, position-dependent multipliers in lane 1): about 2**-64 in all.

Cost: one pass over the dependencies' bytes, about a dozen integer operations per word.
On a 2-core CPU that is ~2 ns per 4-byte word (XLA:CPU's integer loops are far slower
than its float ones: a 64 MB dependency costs ~30 ms to check, a float sum of it ~2 ms).

The static part (the method, the module's tree structure with its static fields, the
shapes and dtypes of the dependencies, non-array arguments) is hashed in Python with
BLAKE2b and enters as the salt: it is a compile-time constant.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, UInt32


_A, _B, _C = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F
_FMIX = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)


def static_digest(*parts: object) -> tuple[int, int]:
    """A stable 64-bit digest (two 32-bit words) of the `repr` of `parts`."""
    text = "\x1f".join(repr(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _u32(value: int) -> Array:
    return jnp.uint32(value & 0xFFFFFFFF)


def _fmix(h: Array) -> Array:
    s1, m1, s2, m2, s3 = _FMIX
    h = h ^ (h >> _u32(s1))
    h = h * _u32(m1)
    h = h ^ (h >> _u32(s2))
    h = h * _u32(m2)
    return h ^ (h >> _u32(s3))


def words(x: Array) -> UInt32[Array, " n"]:
    """The bit pattern of `x` as a flat vector of 32-bit words."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    size = np.dtype(x.dtype).itemsize
    if size >= 4:
        return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    narrow = lax.bitcast_convert_type(x, np.dtype(f"uint{8 * size}"))
    return narrow.astype(jnp.uint32).reshape(-1)


@functools.partial(jax.jit, static_argnums=1)
def fingerprint(leaves: Sequence[Array], salt: tuple[int, int]) -> UInt32[Array, 2]:
    """The 64-bit fingerprint of the values of `leaves`, salted by a static digest.

    Jitted so that an eager `memox.call` checks a slot in one dispatch; inside a trace it
    is inlined like any nested `jax.jit`."""
    flat = [words(x) for x in leaves]
    total = sum(int(w.size) for w in flat)
    lane0, lane1 = _u32(salt[0]), _u32(salt[1])
    for index, w in enumerate(flat):
        position = lax.iota(jnp.uint32, w.size)
        seed = static_digest("leaf", index)[0]
        mixed = _fmix(w * _u32(_A) + position * _u32(_B) + _u32(seed))
        lane0 = lane0 + jnp.sum(mixed, dtype=jnp.uint32)
        weights = (position * _u32(_C)) | _u32(1)
        lane1 = lane1 + jnp.sum(mixed * weights, dtype=jnp.uint32)
    size = _u32(total)
    return jnp.stack([_fmix(lane0 ^ size), _fmix(lane1 ^ size)])
