"""How a cached value is stored: as bits, in one array that is never inexact.

A single array keeps its shape (floats bit-cast to unsigned integers of the same width,
complex numbers as pairs of those), so its sharding carries over. Anything else (a
tuple, a dict, several arrays) is packed into one byte vector. A typed PRNG key is
stored as its `key_data`. `Spec` records what a cached method returns; it is known to
the method's plan, never stored in the slot, and gives a read value back its type
(weak type, key, `Explicit` sharding).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, PyTree

from . import _jax_internals
from ._key import explicit_sharding


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
    """The type of a returned leaf beyond its stored data."""

    weak: bool = False
    key_impl: str | None = None  # the PRNG implementation of a typed key
    sharding: Any = None  # where it is part of the type (`Explicit` mesh axes)

    @classmethod
    def of(cls, x: Any) -> LeafType:
        aval = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
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


def retyped(value: PyTree[Array], spec: Spec) -> PyTree[Array]:
    """`value` (as computed, made strongly typed) with the types of `spec`'s leaves."""
    if not spec.types:
        return value
    leaves = jtu.tree_leaves(value)
    out = []
    for x, t in zip(leaves, spec.types):
        out.append(_jax_internals.weakly_typed(x) if t.weak else x)
    return jtu.tree_unflatten(spec.treedef, out)


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


def _bits_dtype(dtype: np.dtype) -> np.dtype:
    if jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")
    return np.dtype(dtype)


def _to_bytes(x: Array) -> Array:
    x = _as_real(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).reshape(-1)
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: Array, shape: tuple[int, ...], dtype: np.dtype) -> Array:
    real = _float_view(dtype)
    shape = (*shape, 2) if real != dtype else shape
    if dtype == np.bool_:
        return b.reshape(shape).astype(jnp.bool_)
    if real.itemsize > 1:
        shape = (*shape, real.itemsize)
    return _from_real(lax.bitcast_convert_type(b.reshape(shape), real), dtype)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def pack(value: PyTree[Array]) -> Array:
    """`value` as one byte vector."""
    leaves = [as_data(x) for x in jtu.tree_leaves(value)]
    if not leaves:
        return jnp.zeros((0,), jnp.uint8)
    return jnp.concatenate([_to_bytes(x) for x in leaves])


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
    x = _as_real(as_data(jtu.tree_leaves(value)[0]))
    bits = _bits_dtype(x.dtype)
    return lax.bitcast_convert_type(x, bits) if x.dtype != bits else x


def decode(stored: Array, spec: Spec) -> PyTree[Array]:
    if spec.packed:
        return unpack(stored, spec)
    ((_, dtype),) = spec.leaves
    dtype = np.dtype(dtype)
    real = _float_view(dtype)
    x = lax.bitcast_convert_type(stored, real) if stored.dtype != real else stored
    x = _from_real(x, dtype)
    if spec.types:
        x = _retyped(x, spec.types[0])
    return jtu.tree_unflatten(spec.treedef, [x])


def storage_struct(spec: Spec) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of the array `encode` makes for a value of `spec`."""
    if spec.packed:
        return (packed_size(spec),), np.dtype(np.uint8)
    ((shape, d),) = spec.leaves
    dtype = np.dtype(d)
    real = _float_view(dtype)
    return ((*shape, 2) if real != dtype else shape), _bits_dtype(real)
