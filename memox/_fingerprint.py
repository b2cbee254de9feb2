"""Fingerprints of what a cached value depends on.

A slot stores a 64-bit fingerprint (two `uint32` words) of the dependencies its value
was computed from; a hit requires the fingerprint of the current dependencies to match.
It costs O(1) memory per slot (no copy of the dependencies) and one fused pass over the
dependencies' bytes per check.

The dynamic part (array dependencies and array arguments) is hashed in-graph, array by
array. Each 32-bit word `w_i` of an array's bit pattern is mixed once and summed into
two lanes, and the arrays' fingerprints are then chained:

    m_i   = fmix(w_i * A + i * B)                   (MurmurHash3's 32-bit finaliser)
    f     = (fmix(n ^ sum_i m_i), fmix(n ^ C ^ sum_i m_i * ((i * C) | 1)))   (mod 2**32)
    key   = chain over arrays j: lane -> fmix(lane * A + f_j + j), from the salt

`fmix` and `w -> w * A + c` (odd `A`) are bijections, so changing any single element
changes `m_i` and therefore lane 0 of its array, and every chaining step is a bijection
too: a one-element change is detected with certainty. For a random change of two or more
elements the mixed differences are pseudo-random, each lane collides with probability
about 2**-32, and the two lanes weight them differently (odd, position-dependent
multipliers in lane 1): about 2**-64 in all.

Cost: one pass over the dependencies' bytes, about a dozen integer operations per word.
On a 2-core CPU that is ~2 ns per 4-byte word (XLA:CPU's integer loops are far slower
than its float ones: a 64 MB dependency costs ~30 ms to check, a float sum of it ~2 ms).

Fingerprints are computed per array and combined (`combine`). A concrete array's
fingerprint is kept by identity (`known`): an eager `memox.call`, or `memox.jit`, hashes
an unchanged dependency once, not at every check; inside a user's own `jit` the
dependencies are tracers and are hashed in-graph. A small concrete array is hashed in
NumPy (`host_fingerprint`, the same bits): compiling the XLA hash for each new shape
took ~0.6 s on the third `memox.jit` call of a model with three small dependencies.

The static part of the key (`_key.py`: the method, the module's structure and non-array
parts, the types of all arrays) enters as the salt: a compile-time constant.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, UInt32

from ._storage import as_data


_A, _B, _C = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F
_FMIX = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)


def _u32(value: int) -> Array:
    return jnp.uint32(value & 0xFFFFFFFF)


def _fmix(h: Array | np.ndarray, u32: Callable[[int], Any] = _u32) -> Array | np.ndarray:
    """MurmurHash3's finaliser, elementwise (`u32` makes the constants: `jnp` or NumPy)."""
    s1, m1, s2, m2, s3 = _FMIX
    h = h ^ (h >> u32(s1))
    h = h * u32(m1)
    h = h ^ (h >> u32(s2))
    h = h * u32(m2)
    return h ^ (h >> u32(s3))


def _mix(w: Array | np.ndarray, xp: types.ModuleType) -> Array | np.ndarray:
    """The fingerprint of a vector of 32-bit words, with `xp` = `jnp` or NumPy (the
    same arithmetic modulo 2**32, so the same bits)."""
    u32 = xp.uint32
    position = xp.arange(w.size, dtype=u32)
    mixed = _fmix(w * u32(_A) + position * u32(_B), u32)
    lane0 = xp.sum(mixed, dtype=u32)
    lane1 = xp.sum(mixed * ((position * u32(_C)) | u32(1)), dtype=u32)
    size = u32(w.size & 0xFFFFFFFF)
    return _fmix(xp.stack([lane0 ^ size, lane1 ^ size ^ u32(_C)]), u32)


def words(x: Array) -> UInt32[Array, " n"]:
    """The bit pattern of `x` as a flat vector of 32-bit words (a typed PRNG key's:
    its `key_data`'s)."""
    x = as_data(jnp.asarray(x))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    size = np.dtype(x.dtype).itemsize
    if size >= 4:
        return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    narrow = lax.bitcast_convert_type(x, np.dtype(f"uint{8 * size}"))
    return narrow.astype(jnp.uint32).reshape(-1)


@jax.jit
def array_fingerprint(x: Array) -> UInt32[Array, 2]:
    """The 64-bit fingerprint of one array's bits (its shape and dtype are in the salt)."""
    return _mix(words(lax.stop_gradient(x)), jnp)


@functools.partial(jax.jit, static_argnums=1)
def combine(fingerprints: Sequence[Array], salt: tuple[int, int]) -> UInt32[Array, 2]:
    """One fingerprint of several arrays' fingerprints, in order, salted.

    Each step `lane -> fmix(lane * A + f + j)` is a bijection of both `lane` and `f`, so
    a change of any one array's fingerprint changes the result."""
    lane0, lane1 = _u32(salt[0]), _u32(salt[1])
    for j, f in enumerate(fingerprints):
        lane0 = _fmix(lane0 * _u32(_A) + f[0] + _u32(j))
        lane1 = _fmix(lane1 * _u32(_C) + f[1] + _u32(j))
    return jnp.stack([lane0, lane1])


def _host_words(x: np.ndarray) -> np.ndarray:
    """`words`, in NumPy (the same bits in the same order)."""
    if np.iscomplexobj(x):
        x = np.stack([x.real, x.imag], axis=-1)
    if x.dtype == np.bool_:
        return x.astype(np.uint32).reshape(-1)
    size = x.dtype.itemsize
    if size >= 4:
        return np.ascontiguousarray(x).view(np.uint32).reshape(-1)
    return np.ascontiguousarray(x).view(f"uint{8 * size}").astype(np.uint32).reshape(-1)


def host_fingerprint(x: np.ndarray) -> np.ndarray:
    """`array_fingerprint`, in NumPy: equal bit for bit.

    For small arrays, where compiling `array_fingerprint` for a new shape costs far more
    than hashing on the host."""
    return _mix(_host_words(np.asarray(x)), np)


def fingerprint(leaves: Sequence[Array], salt: tuple[int, int]) -> UInt32[Array, 2]:
    """The fingerprint of the values of `leaves`, salted by a static digest."""
    return combine([array_fingerprint(x) for x in leaves], salt)


# Concrete arrays up to this many elements are fingerprinted on the host (a 64K-element
# array in ~1 ms; compiling `array_fingerprint` for its shape takes ~100 ms on a CPU).
HOST_HASH_MAX_SIZE = 1 << 16


class _Known:
    """Fingerprints of concrete arrays, by identity.

    A `jax.Array` is immutable: while the same object is alive, its fingerprint cannot
    change. So a dependency passed unchanged from call to call is hashed once, and a
    later check costs a dictionary lookup. Entries go when their array is collected."""

    def __init__(self) -> None:
        # id -> (weak reference, fingerprint, fingerprint in NumPy or None)
        self._entries: dict[int, tuple[weakref.ref, Array | np.ndarray, np.ndarray | None]] = {}

    def _entry(self, x: jax.Array) -> tuple[weakref.ref, Array | np.ndarray, np.ndarray | None]:
        entry = self._entries.get(id(x))
        if entry is None or entry[0]() is not x:
            key = id(x)
            ref = weakref.ref(x, lambda _, key=key: self._entries.pop(key, None))
            if x.size <= HOST_HASH_MAX_SIZE and x.is_fully_addressable:
                host = host_fingerprint(np.asarray(as_data(x)))
                entry = (ref, host, host)
            else:
                # Computed now, not staged into a trace that may be running: a concrete
                # array's fingerprint is a concrete value (a constant in any trace).
                with jax.ensure_compile_time_eval():
                    entry = (ref, array_fingerprint(x), None)
            self._entries[key] = entry
        return entry

    def __call__(self, x: jax.Array) -> Array | np.ndarray:
        """The fingerprint of `x` (on its device, or in NumPy for a small `x`), computed
        at most once per object."""
        return self._entry(x)[1]

    def host(self, x: jax.Array) -> np.ndarray:
        """The fingerprint of `x` as a NumPy array (waits for it once per object)."""
        ref, fp, host = self._entry(x)
        if host is None:
            host = np.asarray(fp)
            self._entries[id(x)] = (ref, fp, host)
        return host


known = _Known()


def is_concrete_array(x: object) -> bool:
    """Whether `x` is an immutable array with a value now (not a tracer, not NumPy)."""
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
