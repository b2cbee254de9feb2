"""Fingerprints of what a cached value depends on.

A slot stores a 64-bit fingerprint (two `uint32` words) of the dependencies its value
was computed from; a hit requires the fingerprint of the current dependencies to match.
It costs O(1) memory per slot (no copy of the dependencies) and one fused pass over the
dependencies' bytes per check.

The dynamic part (array dependencies and array arguments) is hashed in-graph, lane by
lane, as

    lane(x) = fmix(salt + sum_i fmix(word_i * A + i * B + leaf_seed))   (mod 2**32)

where `word_i` are the 32-bit words of each array's bit pattern and `fmix` is a
bijective 32-bit finaliser (MurmurHash3's on lane 0, "lowbias32" on lane 1). Because
`fmix` and `word -> word * A + c` (odd `A`) are bijections, changing any single element
always changes each lane: a one-element change is detected with certainty. A change of
two or more elements collides with probability about 2**-32 per lane, and the two lanes
use independent constants, so about 2**-64 in all.

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


# (multiplier A, position multiplier B, fmix shift/multiply constants) per lane.
_LANES = (
    (0x9E3779B1, 0x85EBCA77, (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)),
    (0xC2B2AE3D, 0x27D4EB2F, (16, 0x7FEB352D, 15, 0x846CA68B, 16)),
)


def static_digest(*parts: object) -> tuple[int, int]:
    """A stable 64-bit digest (two 32-bit words) of the `repr` of `parts`."""
    text = "\x1f".join(repr(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _u32(value: int) -> Array:
    return jnp.uint32(value & 0xFFFFFFFF)


def _fmix(h: Array, constants: tuple[int, int, int, int, int]) -> Array:
    s1, m1, s2, m2, s3 = constants
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
def fingerprint(leaves: Sequence[Array], salt: tuple[int, int]) -> UInt32[Array, "2"]:
    """The 64-bit fingerprint of the values of `leaves`, salted by a static digest.

    Jitted so that an eager `memox.call` checks a slot in one dispatch; inside a trace it
    is inlined like any nested `jax.jit`."""
    flat = [words(x) for x in leaves]
    total = sum(int(w.size) for w in flat)
    lanes = []
    for lane, (mul, step, constants) in enumerate(_LANES):
        acc = _u32(salt[lane])
        for index, w in enumerate(flat):
            seed = static_digest("leaf", index, lane)[0]
            position = lax.iota(jnp.uint32, w.size) * _u32(step)
            terms = _fmix(w * _u32(mul) + position + _u32(seed), constants)
            acc = acc + jnp.sum(terms, dtype=jnp.uint32)
        lanes.append(_fmix(acc ^ _u32(total), constants))
    return jnp.stack(lanes)
