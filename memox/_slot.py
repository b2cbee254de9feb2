"""`Memo`: the cache slot, and how a cached value is stored in it.

A slot is an ordinary pytree node. Empty (`Memo()`), it has no leaves. Allocated, it
holds fixed-shape arrays whatever its state:

- `value`: the cached value, stored as bit patterns (floats are bit-cast to unsigned
  integers of the same width), so that no slot leaf is ever an inexact array. That is
  what makes slots invisible to `eqx.filter(..., eqx.is_inexact_array)`, to
  `eqx.filter_grad` and to every optax optimizer.
- `valid`: a scalar `bool` array.
- `key`: `uint32[2]`, the fingerprint of what the value was computed from.
- `hits`, `misses`: scalar `int32` counters.

How to decode `value` (its tree structure, shapes and dtypes) is static metadata, part
of the tree structure. Filling, hitting and invalidating a slot therefore never change
the structure: an allocated slot is legal as a `lax.scan` carry and never retraces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Int, PyTree, UInt32


T = TypeVar("T")

KEY_WORDS = 2


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a slot stores: the value's tree structure and each leaf's shape and dtype."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]

    @classmethod
    def of(cls, value: PyTree) -> Spec:
        leaves, treedef = jtu.tree_flatten(value)
        return cls(treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))

    def describe(self) -> str:
        shapes = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in self.leaves)
        return f"({shapes})"


def _storage_dtype(dtype: np.dtype) -> np.dtype:
    if jnp.issubdtype(dtype, jnp.complexfloating):
        dtype = jnp.finfo(dtype).dtype
    if jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")
    return np.dtype(dtype)


def _storage_shape(shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return (*shape, 2)
    return shape


def encode_leaf(x: Array) -> Array:
    """Stores `x` as bits: the result is never an inexact array."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return lax.bitcast_convert_type(x, _storage_dtype(x.dtype))
    return x


def decode_leaf(stored: Array, dtype: str) -> Array:
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = lax.bitcast_convert_type(stored, jnp.finfo(dtype).dtype)
        return lax.complex(parts[..., 0], parts[..., 1])
    if jnp.issubdtype(dtype, jnp.floating):
        return lax.bitcast_convert_type(stored, dtype)
    return stored


class Memo(eqx.Module, Generic[T]):
    """A cache slot. Declare one per cached method, as a field of an `eqx.Module`.

    `Memo[T]` annotates the field (`T` is the type of the cached value); `Memo()` is the
    empty slot, usable as the field's default. A slot is filled by `memox.call` or
    `memox.jit` when its cached method runs, allocated in advance by `memox.init`,
    invalidated by `memox.clear`, and read by `memox.stats`. Its contents are integer and
    boolean arrays only, so optimizers and `eqx.filter_grad` never see them.

    !!! Example

        ```python
        class Foo(eqx.Module):
            a: jax.Array
            b_cache: memox.Memo[jax.Array] = memox.Memo()

            @memox.cached("b_cache")
            def b(self):
                return jnp.sum(self.a)
        ```
    """

    value: PyTree[Array] | None = None
    valid: Bool[Array, ""] | None = None
    key: UInt32[Array, "2"] | None = None
    hits: Int[Array, ""] | None = None
    misses: Int[Array, ""] | None = None
    spec: Spec | None = eqx.field(static=True, default=None)

    @property
    def allocated(self) -> bool:
        return self.spec is not None

    def decoded(self) -> PyTree[Array]:
        """The stored value in its own dtypes (meaningful only where `valid`)."""
        assert self.spec is not None
        leaves = jtu.tree_leaves(self.value)
        dtypes = [dtype for _, dtype in self.spec.leaves]
        return jtu.tree_unflatten(
            self.spec.treedef, [decode_leaf(s, d) for s, d in zip(leaves, dtypes)]
        )


def is_memo(x: Any) -> bool:
    return isinstance(x, Memo)


def allocate(spec: Spec) -> Memo:
    """An empty (invalid) slot with room for a value of `spec`. Costs no FLOPs."""
    value = jtu.tree_unflatten(
        spec.treedef,
        [
            jnp.zeros(_storage_shape(shape, np.dtype(d)), _storage_dtype(np.dtype(d)))
            for shape, d in spec.leaves
        ],
    )
    return Memo(
        value=value,
        valid=jnp.zeros((), jnp.bool_),
        key=jnp.zeros((KEY_WORDS,), jnp.uint32),
        hits=jnp.zeros((), jnp.int32),
        misses=jnp.zeros((), jnp.int32),
        spec=spec,
    )


def filled(slot: Memo, value: PyTree[Array], key: Array) -> Memo:
    """`slot` holding `value`, computed from dependencies with fingerprint `key`."""
    return Memo(
        value=jtu.tree_map(encode_leaf, value),
        valid=jnp.ones((), jnp.bool_),
        key=key,
        hits=slot.hits,
        misses=slot.misses + 1,
        spec=slot.spec,
    )


def counted_hit(slot: Memo) -> Memo:
    return dataclasses.replace(slot, hits=slot.hits + 1)


def invalidated(slot: Memo) -> Memo:
    if not slot.allocated:
        return slot
    return dataclasses.replace(slot, valid=jnp.zeros_like(slot.valid))


def strong(value: PyTree[Array]) -> PyTree[Array]:
    """`value` without weak types, so that a computed and a stored value type-match."""
    return jtu.tree_map(lambda x: lax.convert_element_type(x, jnp.result_type(x)), value)


# -- where the slots of a pytree are --------------------------------------------------

Path = tuple[Any, ...]


def _child(node: Any, entry: Any) -> Any:
    if isinstance(entry, jtu.GetAttrKey):
        return getattr(node, entry.name)
    if isinstance(entry, jtu.SequenceKey):
        return node[entry.idx]
    if isinstance(entry, jtu.DictKey):
        return node[entry.key]
    if isinstance(entry, jtu.FlattenedIndexKey):
        return jtu.tree_flatten(node, is_leaf=lambda x: x is not node)[0][entry.key]
    raise TypeError(f"memox cannot follow the pytree path entry {entry!r}.")


@dataclasses.dataclass(frozen=True)
class SlotSite:
    """A slot found in a pytree: its path, the module that owns it, and the field name."""

    path: Path
    slot: Memo
    owner: Any
    field: str | None


def slot_sites(tree: PyTree) -> Iterator[SlotSite]:
    """Every `Memo` in `tree`, with the object owning it."""
    for path, leaf in jtu.tree_flatten_with_path(tree, is_leaf=is_memo)[0]:
        if not is_memo(leaf):
            continue
        owner = tree
        for entry in path[:-1]:
            owner = _child(owner, entry)
        last = path[-1] if path else None
        field = last.name if isinstance(last, jtu.GetAttrKey) else None
        yield SlotSite(path, leaf, owner if path else None, field)


def replace_slots(tree: PyTree, new: dict[Path, Memo]) -> PyTree:
    """`tree` with the slots at the paths in `new` replaced."""
    if not new:
        return tree
    items, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_memo)
    leaves = [new.get(path, leaf) for path, leaf in items]
    return jtu.tree_unflatten(treedef, leaves)


def path_name(path: Path) -> str:
    return jtu.keystr(path).lstrip(".")


def shape_struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
