"""Fingerprints of what a cached value depends on.

A slot stores a 64-bit fingerprint (two `uint32` words) of the dependencies its value
was computed from; a hit requires the fingerprint of the current dependencies to match.
It costs O(1) memory per slot (no copy of the dependencies) and one fused pass over the
dependencies' bytes per check.

The dynamic part (array dependencies and array arguments) is hashed in-graph, array by
array. Word `w_i` of an array's bit pattern (32 bits; narrower elements widened, one per
word) is keyed by its position, mixed, and summed into two lanes; the arrays'
fingerprints are then chained. The bit pattern is every element's bits as
`_storage.Bits` holds them: one rule from the dtype's bit width, so every dtype JAX has
(sub-byte ones included) gives the same words on the device and in NumPy:

    k_i   = i * K                                   (K odd: the position key)
    m_i   = mix(w_i + k_i)
    f     = (mix(n ^ sum_i m_i), mix(n ^ C ^ sum_i m_i * (k_i | 1)))    (mod 2**32)
    key   = chain over arrays j: lane -> mix(lane * A + f_j + j), from the salt

where `mix` is a two-round xorshift-multiply finaliser (`x ^= x >> 16; x *= 0x21F0AAAD;
x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15`, C. Wellons' hash-prospector search).

**Guarantees.** `mix` (xorshifts and odd multiplications) and `w -> w + k` are
bijections of 32-bit words, so changing any single element changes its `m_i` and
therefore lane 0 of its array; every chaining step is a bijection too: a one-element
change is detected with certainty. For a random change of two or more elements the mixed
differences are pseudo-random: lane 0 collides with probability about 2**-32, and lane 1
weights them by distinct odd multipliers, so that both collide with probability about
2**-64 in all. (For exactly two changed positions a distance `d` apart, lane 1 loses the
trailing zero bits of `d`: 2**-(64 - v) with `v` those bits, e.g. 2**-54 for two cells
of one column of a 1024-wide matrix.)

**Cost: one fused pass near memory bandwidth.** The two lanes are one *variadic*
reduction (`lax.reduce` over both at once) over the trailing axes of the words as they
lie, the position key computed from each axis' index: XLA fuses the bit-cast, the keys,
the mix and both sums into a single loop that reads each word once (on CPU, split
across threads over the leading axis); the per-row lanes are then summed plainly. An
array of at most `ONE_PASS_WORDS` words on a single device is reduced over every axis
at once: one kernel, where splitting it across threads costs more than it saves, and
fewer kernels for XLA to compile per check. Two separate sums over the whole array
(`jnp.sum`) do not fuse on XLA:CPU: its
tree-reduction rewrite (not applied to variadic reductions) turns each into
`reduce-window`s over a materialised operand, so the bit-cast array and the mixed array
were written out whole (64 MB float32: ~30 ms, against ~2.5 ms for a float sum of the
same array; now ~3 ms, see `benchmarks/s10_finetune.py`). No reshape: a sharded array is
reduced where it lies, and a row-sharded one needs one all-reduce of the two lanes.
Integer addition is associative: the NumPy version (`host_fingerprint`) sums the flat
array to the same bits.

**Versions.** Fingerprints are not stable across memox versions: this hash replaced the
earlier mix (MurmurHash3's finaliser of `w_i * A + i * B`) after memox 0.1.0. A slot
filled by another version (restored from a checkpoint) does not match and recomputes
once: never stale, only one miss.

Fingerprints are computed per array and combined (`combine`). A concrete array's
fingerprint is kept by identity (`known`): an eager `memox.call`, `memox.jit` or
`memox.filter_jit` hashes an unchanged dependency once, not at every check; inside a
user's own `jit` the dependencies are tracers and are hashed in-graph, unless a
`prehash` scope (`memox.jit`, `memox.filter_jit`) brought their fingerprints in. A small
concrete array is hashed in NumPy (`host_fingerprint`, the same bits): compiling the XLA
hash for each new shape took ~0.6 s on the third `memox.jit` call of a model with three
small dependencies.

The static part of the key (`_key.py`: the method, the module's structure and non-array
parts, the types of all arrays) enters as the salt: a compile-time constant.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax import lax
from jaxtyping import Array, UInt32

from . import _jax_internals
from ._caches import register
from ._jax_internals import is_concrete_array
from ._storage import Bits, as_data, to_bits


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


_K, _A, _C = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F
_MIX = (16, 0x21F0AAAD, 15, 0x735A2D97, 15)


def _mix(h: Any, u32: Any) -> Any:
    """The 32-bit finaliser, elementwise (`u32` makes the constants: `jnp.uint32` or
    `np.uint32`; the arithmetic is modulo 2**32 in both)."""
    s1, m1, s2, m2, s3 = _MIX
    h = h ^ (h >> u32(s1))
    h = h * u32(m1)
    h = h ^ (h >> u32(s2))
    h = h * u32(m2)
    return h ^ (h >> u32(s3))


def _terms(w: Any, key: Any, u32: Any) -> tuple[Any, Any]:
    """The summands of both lanes for words `w` at position keys `key` (= i * K)."""
    m = _mix(w + key, u32)
    return m, m * (key | u32(1))


def _finish(lane0: Any, lane1: Any, n: int, xp: types.ModuleType) -> Any:
    u32 = xp.uint32
    size = u32(n & 0xFFFFFFFF)
    # Each lane mixed, then joined: `combine` reads the lanes back, and XLA then fuses
    # both steps into one kernel (a mix after joining kept them two). As arrays of one
    # element: NumPy warns of the wrap-around in a product of scalars.
    lanes = xp.reshape(lane0 ^ size, 1), xp.reshape(lane1 ^ size ^ u32(_C), 1)
    return xp.concatenate([_mix(lane, u32) for lane in lanes])


def _sum2(a: Array, b: Array, axes: tuple[int, ...]) -> tuple[Array, Array]:
    """Both lanes' sums in ONE variadic reduction: XLA fuses it with the words' mix."""
    zero = jnp.uint32(0)
    return lax.reduce((a, b), (zero, zero), lambda x, y: (x[0] + y[0], x[1] + y[1]), axes)


# Up to this many words on a single device, a fingerprint is one reduction over every
# axis (one kernel); past it, rows first, then their sums, which XLA:CPU runs across
# threads (see the module's docstring). Integer sums in any order give the same bits.
ONE_PASS_WORDS = 1 << 17


def _device_fingerprint(w: UInt32[Array, "*shape"]) -> UInt32[Array, 2]:
    """The fingerprint of words `w` (any shape; position = row-major index)."""
    u32 = jnp.uint32
    if w.ndim == 0:
        w = w.reshape(1)
    # k_i for the row-major index i = sum_d index_d * stride_d, as
    # sum_d index_d * (stride_d * K): the same value mod 2**32, and no reshape (a reshape
    # of a sharded array may need its data moved).
    key, stride = None, 1
    for axis in reversed(range(w.ndim)):
        term = lax.broadcasted_iota(u32, w.shape, axis) * u32((stride * _K) & 0xFFFFFFFF)
        key = term if key is None else key + term
        stride *= w.shape[axis]
    if w.size <= ONE_PASS_WORDS and jax.device_count() == 1:
        # One reduction over every axis: one kernel. Only where nothing can be sharded:
        # XLA combines a sharded array's partial sums by one all-reduce in the two steps
        # below, and by gathering them for a reduction over every axis.
        lane0, lane1 = _sum2(*_terms(w, key, u32), tuple(range(w.ndim)))
        return _finish(lane0, lane1, w.size, jnp)
    # One fused pass over the trailing axes (on CPU split across threads over the
    # leading one), then the leading axis summed plainly: where that axis is sharded (as
    # parameters usually are), XLA combines both sums into one all-reduce of two words.
    lane0, lane1 = _sum2(*_terms(w, key, u32), tuple(range(1, w.ndim)) or (0,))
    if w.ndim > 1:
        lane0, lane1 = jnp.sum(lane0, dtype=u32), jnp.sum(lane1, dtype=u32)
    return _finish(lane0, lane1, w.size, jnp)


def canonical(x: Any) -> Any:
    """`x` as JAX computes with it: a 64-bit array made under x64 converted (rounded, or
    wrapped for integers, as `jax.jit` converts an argument) where x64 is now off, so
    that a fingerprint sees the value a computation reads."""
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    return x if dtype == x.dtype else x.astype(dtype)


def words(x: Array) -> UInt32[Array, "*words"]:
    """The bit pattern of `x` as 32-bit words, in row-major order: each element's bits
    as `_storage.to_bits` holds them (every dtype, sub-byte ones included; a typed PRNG
    key's `key_data`; a complex number's parts along a new last axis), narrower ones
    widened, one per word, wider ones split along a new last axis."""
    u = to_bits(canonical(as_data(jnp.asarray(x))))
    if u.dtype.itemsize < 4:
        return u.astype(jnp.uint32)
    return lax.bitcast_convert_type(u, jnp.uint32) if u.dtype != jnp.uint32 else u


@jax.jit
def array_fingerprint(x: Array) -> UInt32[Array, 2]:
    """The 64-bit fingerprint of one array's bits (its shape and dtype are in the salt)."""
    return _device_fingerprint(words(lax.stop_gradient(x)))


@functools.partial(jax.jit, static_argnums=1)
def combine(fingerprints: Sequence[Array], salt: tuple[int, int]) -> UInt32[Array, 2]:
    """One fingerprint of several arrays' fingerprints, in order, salted: a call's key,
    never all zeros.

    Each step `lane -> mix(lane * A + f + j)` is a bijection of both `lane` and `f`, so
    a change of any one array's fingerprint changes the result."""
    u32 = jnp.uint32
    lane0, lane1 = u32(salt[0] & 0xFFFFFFFF), u32(salt[1] & 0xFFFFFFFF)
    for j, f in enumerate(fingerprints):
        lane0 = _mix(lane0 * u32(_A) + f[0] + u32(j), u32)
        lane1 = _mix(lane1 * u32(_C) + f[1] + u32(j), u32)
    # Never all zeros, the key of an entry that holds nothing (`_slot.Memo`): (0, 0)
    # becomes (0, 1). Lane 0 is unchanged, so a one-element change is still detected.
    lane1 = jnp.where((lane0 == 0) & (lane1 == 0), u32(1), lane1)
    return jnp.stack([lane0, lane1])


def _host_words(x: npt.NDArray[np.generic]) -> np.ndarray:
    """`words`, in NumPy (the same bits in the same order)."""
    if np.iscomplexobj(x):
        x = np.stack([x.real, x.imag], axis=-1)
    u = Bits.of(x.dtype).host_bits(x)
    if u.dtype.itemsize < 4:
        u = u.astype(np.uint32)
    return np.ascontiguousarray(u).view(np.uint32).reshape(-1)


def host_fingerprint(x: np.ndarray) -> np.ndarray:
    """`array_fingerprint`, in NumPy: equal bit for bit.

    For small arrays, where compiling `array_fingerprint` for a new shape costs far more
    than hashing on the host."""
    w = _host_words(np.asarray(x))
    u32 = np.uint32
    m0, m1 = _terms(w, np.arange(w.size, dtype=u32) * u32(_K), u32)
    lanes = np.sum(m0, dtype=u32), np.sum(m1, dtype=u32)
    return _finish(np.asarray(lanes[0]), np.asarray(lanes[1]), w.size, np)


def fingerprint(leaves: Sequence[Array], salt: tuple[int, int]) -> UInt32[Array, 2]:
    """The fingerprint of the values of `leaves`, salted by a static digest: two
    `uint32` words, equal for equal values.

    !!! Example

        ```python
        key = memox.internal.fingerprint([jnp.ones(3)], (0, 0))
        assert (key == memox.internal.fingerprint([jnp.ones(3)], (0, 0))).all()
        ```
    """
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
        register("fingerprints", self._entries)

    def _entry(self, x: jax.Array) -> tuple[weakref.ref, Array | np.ndarray, np.ndarray | None]:
        entry = self._entries.get(id(x))
        if entry is None or entry[0]() is not x:
            key = id(x)
            ref = weakref.ref(x, lambda _, key=key: self._entries.pop(key, None))
            if x.size <= HOST_HASH_MAX_SIZE and x.is_fully_addressable:
                host = host_fingerprint(canonical(np.asarray(as_data(x))))
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

    def host(self, x: jax.Array) -> np.ndarray | None:
        """The fingerprint of `x` as a NumPy array (waits for it once per object), or
        `None` where `x` is not fully addressable: its fingerprint is then the output of
        a program over every process's devices, which this process alone does not read
        (the caller keeps the in-graph hash)."""
        if not x.is_fully_addressable:
            return None
        ref, fp, host = self._entry(x)
        if host is None:
            host = np.asarray(fp)
            self._entries[id(x)] = (ref, fp, host)
        return host


known = _Known()


def across_processes(arrays: Sequence[Any]) -> bool:
    """Whether a call on `arrays` runs one program over the devices of several processes
    (an input is not fully addressable). What reaches such a program must be the same in
    every process, so nothing a process remembers of its own earlier calls (which arrays
    it saw: `known`, `_prehash.Inputs`, `_decided.Hits`) may change what it passes in."""
    if _jax_internals.process_count() == 1:
        return False
    return any(is_concrete_array(x) and not x.is_fully_addressable for x in arrays)
