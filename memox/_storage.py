"""How a cached value is stored: as bits, in one array that is never inexact.

A single array keeps its shape (its elements as unsigned integers holding their bits,
complex numbers as pairs of those), so its sharding carries over. Anything else (a
tuple, a dict, several arrays) is packed into one byte vector. A typed PRNG key is
stored as its `key_data`. `Spec` records what a cached method returns; it is known to
the method's plan, never stored in the slot, and gives a read value back its type
(weak type, key, `Explicit` sharding).

**Bits, for every dtype (`Bits`).** One rule, from the dtype's bit width `b`
(`jax.dtypes.itemsize_bits`), says how an element is seen as an unsigned integer, here
and by the fingerprint (`_fingerprint.words`), on the device and in NumPy alike:

- an element of 8 bits or more is bit-cast to JAX's unsigned integer of its width
  (`uint8` for the float8 family, `uint16` for `bfloat16`, ...);
- `bool` by value (0 or 1): XLA does not bit-cast it;
- a sub-byte element (`int4`, `uint2`, `float4_e2m1fn`, `float6_*`: any `b < 8`) by
  value, converted to the narrowest standard type of its kind that holds every value
  (`int8`/`uint8` for integers, `float16` for floats) and bit-cast from there: exact,
  and injective, which `Bits.of` checks on all `2**b` bit patterns (every one finite,
  and all distinct) before using it; a dtype that fails the check is refused. Never a
  bit-cast of a sub-byte type: XLA:CPU miscompiles one whose operand it produced by a
  conversion (an `i8` bit-cast to `i4`: "Invalid bitcast", found with a `float4_e2m1fn`
  slice stored in a `lax.scan` body), and a conversion is what XLA emits anyway.

No list of dtype names: a new dtype is covered by its width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, PyTree

from . import _jax_internals
from ._errors import NO_BITS
from ._jax_internals import explicit_sharding


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a cached method returns: the tree structure, each leaf's stored shape and
    dtype, and how to give the stored bits back their type.

    A slot does not record it: the method's plan knows it whenever the slot is read, and
    a slot is allocated for it when its storage has the matching shape and dtype. So a
    slot has no static metadata, and once its arrays are filtered out (as by
    `eqx.filter(model, eqx.is_inexact_array)`) an allocated slot and an empty one are
    the same tree: an optimizer state made before allocation fits the allocated model.

    `leaves` describe the data stored (a PRNG key as its `key_data`); `types` say, per
    leaf, what the method returned besides: whether it was weakly typed, the PRNG
    implementation of a key, and its sharding where that is part of its type.

    !!! Example

        ```python
        spec = memox.internal.Spec.of((jnp.ones(3), jnp.zeros((2, 2), jnp.int32)))
        assert spec.leaves == (((3,), "float32"), ((2, 2), "int32"))
        ```
    """

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]
    types: tuple[LeafType, ...] = ()

    @classmethod
    def of(cls, value: PyTree) -> Spec:
        leaves, treedef = jtu.tree_flatten(value)
        types = tuple(map(LeafType.of, leaves))
        data = []
        for x, t in zip(leaves, types):
            if t.key_impl is not None:
                x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
            data.append((tuple(x.shape), str(np.dtype(x.dtype))))
        return cls(treedef, tuple(data), types)

    @property
    def packed(self) -> bool:
        """Whether the value is stored as one byte vector (anything but a single array)."""
        return len(self.leaves) != 1

    def describe(self) -> str:
        return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in self.leaves) or "()"


@dataclasses.dataclass(frozen=True)
class LeafType:
    """The type of a returned leaf beyond its stored data: weakly typed or not, the
    implementation of a PRNG key, its sharding where that is part of its type.

    !!! Example

        ```python
        assert memox.internal.LeafType.of(jnp.float32(1.0)) == memox.internal.LeafType()
        assert memox.internal.LeafType.of(jnp.asarray(1.0)).weak
        ```
    """

    weak: bool = False
    key_impl: str | None = None  # the PRNG implementation of a typed key
    sharding: Any = None  # where it is part of the type (`Explicit` mesh axes)

    @classmethod
    def of(cls, x: Any) -> LeafType:
        aval = x if isinstance(x, (jax.ShapeDtypeStruct, jax.core.ShapedArray)) else jax.typeof(x)
        key_impl = None
        if _jax_internals.is_key(aval.dtype):
            key_impl = _jax_internals.key_impl_name(aval.dtype)
        sharding = getattr(aval, "sharding", None)
        explicit = explicit_sharding(aval) if sharding is not None else None
        return cls(bool(getattr(aval, "weak_type", False)), key_impl, explicit)


def as_data(x: Array) -> Array:
    """`x` as plain data: a typed PRNG key as its `key_data`, anything else as is."""
    return jax.random.key_data(x) if _jax_internals.is_key(x.dtype) else x


def _retyped(x: Array, t: LeafType) -> Array:
    """A stored leaf given back the type the method returned."""
    if t.key_impl is not None:
        x = jax.random.wrap_key_data(x, impl=t.key_impl)
    if t.weak:
        x = _jax_internals.weakly_typed(x)
    if t.sharding is not None and jax.typeof(x).sharding != t.sharding:
        x = jax.sharding.reshard(x, t.sharding)
    return x


def strong(value: PyTree[Array]) -> PyTree[Array]:
    """`value` without weak types, so that a computed and a stored value type-match."""
    return jtu.tree_map(lambda x: lax.convert_element_type(x, jnp.result_type(x)), value)


def retyped(value: PyTree[Array], spec: Spec) -> PyTree[Array]:
    """`value` (as computed, made strongly typed) with the types of `spec`'s leaves."""
    if not spec.types:
        return value
    leaves = jtu.tree_leaves(value)
    out = []
    for x, t in zip(leaves, spec.types):
        out.append(_jax_internals.weakly_typed(x) if t.weak else x)
    return jtu.tree_unflatten(spec.treedef, out)


@dataclasses.dataclass(frozen=True)
class Bits:
    """How the elements of a real dtype are held as unsigned integers, exactly (see the
    module docstring): `to_bits` and `from_bits` on the device, `host_bits` in NumPy."""

    dtype: np.dtype
    unsigned: np.dtype  # what holds an element's bits
    inner: np.dtype  # the type bit-cast to `unsigned`: the dtype, or one it converts to
    by_value: bool  # converted to `inner` by value (bool, sub-byte), not bit-cast

    @staticmethod
    @functools.cache
    def of(dtype: Any) -> Bits:
        dtype = np.dtype(dtype)
        if dtype == np.bool_:
            return Bits(dtype, np.dtype(np.uint8), np.dtype(np.uint8), True)
        b = jax.dtypes.itemsize_bits(dtype)
        if b >= 8:
            return Bits(dtype, np.dtype(getattr(jnp, f"uint{b}")), dtype, False)
        for via in _wider(dtype):
            # Checked on every bit pattern: exact, and injective.
            values = np.arange(2**b, dtype=np.uint8).view(dtype).astype(via)
            bits = values.view(f"uint{8 * via.itemsize}")
            if np.isfinite(values).all() and len(np.unique(bits)) == 2**b:
                return Bits(dtype, bits.dtype, via, True)
        raise TypeError(NO_BITS.format(dtype=dtype.name, bits=b))

    def to_bits(self, x: Array) -> Array:
        x = x.astype(self.inner) if self.by_value else x
        return lax.bitcast_convert_type(x, self.unsigned) if x.dtype != self.unsigned else x

    def from_bits(self, u: Array) -> Array:
        u = lax.bitcast_convert_type(u, self.inner) if u.dtype != self.inner else u
        return u.astype(self.dtype) if self.by_value else u

    def host_bits(self, x: np.ndarray) -> np.ndarray:
        """`to_bits`, in NumPy: the same bits."""
        x = np.asarray(x).astype(self.inner) if self.by_value else np.ascontiguousarray(x)
        return x.view(self.unsigned)


def _wider(dtype: np.dtype) -> tuple[np.dtype, ...]:
    """The types a sub-byte element may be converted to by value, narrowest first:
    integers to the 8-bit integer of their signedness, floats to `float16` (or `float32`,
    for a format `float16` does not hold)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(np.float16), np.dtype(np.float32)
    return (np.dtype(np.int8 if jnp.issubdtype(dtype, jnp.signedinteger) else np.uint8),)


def _float_view(dtype: np.dtype) -> np.dtype:
    """The real dtype a value is seen as before it is stored (complex: its parts)."""
    return (
        np.dtype(jnp.finfo(dtype).dtype) if jnp.issubdtype(dtype, jnp.complexfloating) else dtype
    )


def _as_real(x: Array) -> Array:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    return x


def _from_real(x: Array, dtype: np.dtype) -> Array:
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return lax.complex(x[..., 0], x[..., 1])
    return x


def _to_bytes(x: Array) -> Array:
    u = to_bits(x)
    if u.dtype != np.uint8:
        u = lax.bitcast_convert_type(u, jnp.uint8)
    return u.reshape(-1)


def _from_bytes(b: Array, shape: tuple[int, ...], dtype: np.dtype) -> Array:
    real = _float_view(dtype)
    shape = (*shape, 2) if real != dtype else shape
    bits = Bits.of(real)
    if bits.unsigned.itemsize > 1:
        shape = (*shape, bits.unsigned.itemsize)
    u = b.reshape(shape)
    u = lax.bitcast_convert_type(u, bits.unsigned) if u.dtype != bits.unsigned else u
    return _from_real(bits.from_bits(u), dtype)


def to_bits(x: Array) -> Array:
    """The bits of `x` (a complex number's parts along a new last axis), as unsigned
    integers (`Bits`)."""
    x = _as_real(x)
    return Bits.of(x.dtype).to_bits(x)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    shape, unsigned = _stored(shape, dtype)
    return int(np.prod(shape, dtype=np.int64)) * unsigned.itemsize


def pack(value: PyTree[Array]) -> Array:
    """`value` as one byte vector."""
    leaves = [as_data(x) for x in jtu.tree_leaves(value)]
    if not leaves:
        return jnp.zeros((0,), jnp.uint8)
    return jnp.concatenate([_replicated(_to_bytes(x)) for x in leaves])


def _replicated(x: Array) -> Array:
    """`x` replicated where its sharding is part of its type (`Explicit` mesh axes): the
    bytes of leaves sharded apart are concatenated into one replicated vector."""
    sharding = explicit_sharding(jax.typeof(x))
    if sharding is None or all(p is None for p in sharding.spec):
        return x
    return jax.sharding.reshard(
        x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    )


def unpack(stored: Array, spec: Spec) -> PyTree[Array]:
    leaves, offset = [], 0
    for shape, dtype in spec.leaves:
        n = _nbytes(shape, np.dtype(dtype))
        leaves.append(_from_bytes(stored[offset : offset + n], shape, np.dtype(dtype)))
        offset += n
    if spec.types:
        leaves = [_retyped(x, t) for x, t in zip(leaves, spec.types)]
    return jtu.tree_unflatten(spec.treedef, leaves)


def packed_size(spec: Spec) -> int:
    return sum(_nbytes(shape, np.dtype(d)) for shape, d in spec.leaves)


def encode(value: PyTree[Array], spec: Spec) -> Array:
    """`value` as one array that is never inexact (see the module docstring)."""
    if spec.packed:
        return pack(value)
    return to_bits(as_data(jtu.tree_leaves(value)[0]))


def decode(stored: Array, spec: Spec) -> PyTree[Array]:
    if spec.packed:
        return unpack(stored, spec)
    ((_, dtype),) = spec.leaves
    dtype = np.dtype(dtype)
    x = _from_real(Bits.of(_float_view(dtype)).from_bits(stored), dtype)
    if spec.types:
        x = _retyped(x, spec.types[0])
    return jtu.tree_unflatten(spec.treedef, [x])


def _stored(shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of `to_bits` of an array of `shape` and `dtype`."""
    real = _float_view(dtype)
    return ((*shape, 2) if real != dtype else shape), Bits.of(real).unsigned


def storage_struct(spec: Spec) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of the array `encode` makes for a value of `spec`."""
    if spec.packed:
        return (packed_size(spec),), np.dtype(np.uint8)
    ((shape, d),) = spec.leaves
    return _stored(shape, np.dtype(d))
