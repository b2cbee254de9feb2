"""`Memo`: the cache slot, and how a cached value is stored in it.

A slot is an ordinary pytree node with five leaves. Empty (`Memo()`), each leaf is the
`EMPTY` marker. Allocated, they are fixed-shape arrays whatever the slot's state:

- `value`: the cached value as one array of bit patterns, so that no slot leaf is ever
  an inexact array. That is what makes slots invisible to `eqx.filter(...,
  eqx.is_inexact_array)`, to `eqx.filter_grad` and to every optax optimizer. A single
  array keeps its shape (floats bit-cast to unsigned integers of the same width, so its
  sharding carries over); a tuple or other pytree of arrays is packed into bytes. One
  array, not a pytree of them: a slot has the same five children allocated or not.
- `valid`: a scalar `bool` array.
- `key`: `uint32[2]`, the fingerprint of what the value was computed from.
- `hits`, `misses`: scalar `int32` counters.

A slot has no static metadata: how to decode `value` is known to the cached method
(see `Spec`). So allocating, filling, hitting and invalidating a slot never change the
tree structure: a filter spec or an optimizer state made from a freshly constructed
model fits it for good, and an allocated slot is legal as a `lax.scan` carry and never
retraces. (An empty slot's markers are not arrays: `eqx.filter_jit` treats them as
static, while `jax.jit` and `lax.scan` need the module allocated by `memox.init`.)
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
    """What a cached method returns: the tree structure, and each leaf's shape and dtype.

    A slot does not record it: the method's plan knows it whenever the slot is read, and
    a slot is allocated for it when its storage has the matching shape and dtype. So a
    slot has no static metadata, and once its arrays are filtered out (as by
    `eqx.filter(model, eqx.is_inexact_array)`) an allocated slot and an empty one are
    the same tree: an optimizer state made before allocation fits the allocated model.
    """

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]

    @classmethod
    def of(cls, value: PyTree) -> Spec:
        leaves, treedef = jtu.tree_flatten(value)
        return cls(treedef, tuple((tuple(x.shape), str(np.dtype(x.dtype))) for x in leaves))

    @property
    def packed(self) -> bool:
        """Whether the value is stored as one byte vector (anything but a single array)."""
        return len(self.leaves) != 1

    def describe(self) -> str:
        return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in self.leaves) or "()"


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


def encode(value: PyTree[Array], spec: Spec) -> Array:
    """`value` as one array that is never inexact: a single array keeps its shape (and so
    its sharding) with floats bit-cast to unsigned integers; anything else is packed
    into a byte vector."""
    leaves = jtu.tree_leaves(value)
    if not spec.packed:
        x = _as_real(leaves[0])
        return (
            lax.bitcast_convert_type(x, _bits_dtype(x.dtype))
            if x.dtype != _bits_dtype(x.dtype)
            else x
        )
    if not leaves:
        return jnp.zeros((0,), jnp.uint8)
    return jnp.concatenate([_to_bytes(x) for x in leaves])


def decode(stored: Array, spec: Spec) -> PyTree[Array]:
    dtypes = [np.dtype(d) for _, d in spec.leaves]
    if not spec.packed:
        (dtype,) = dtypes
        real = _float_view(dtype)
        x = lax.bitcast_convert_type(stored, real) if stored.dtype != real else stored
        return jtu.tree_unflatten(spec.treedef, [_from_real(x, dtype)])
    leaves, offset = [], 0
    for (shape, _), dtype in zip(spec.leaves, dtypes):
        n = _nbytes(shape, dtype)
        leaves.append(_from_bytes(stored[offset : offset + n], shape, dtype))
        offset += n
    return jtu.tree_unflatten(spec.treedef, leaves)


def storage_struct(spec: Spec) -> tuple[tuple[int, ...], np.dtype]:
    if spec.packed:
        return (sum(_nbytes(shape, np.dtype(d)) for shape, d in spec.leaves),), np.dtype(np.uint8)
    ((shape, d),) = spec.leaves
    dtype = np.dtype(d)
    real = _float_view(dtype)
    return ((*shape, 2) if real != dtype else shape), _bits_dtype(real)


class _Empty:
    """The leaves of an empty slot."""

    _instance: _Empty | None = None

    def __new__(cls) -> _Empty:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> str:
        return "EMPTY"

    def __repr__(self) -> str:
        # Shown by JAX when an empty slot reaches `jax.jit` or `lax.scan` as an argument.
        return (
            "<empty memox.Memo slot: allocate it first with `module = memox.init(module)`, "
            "or `memox.init(module, fn, *args)` for a method that takes arguments>"
        )


EMPTY = _Empty()


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

    value: Array | _Empty | None = EMPTY
    valid: Bool[Array, ""] | _Empty | None = EMPTY
    key: UInt32[Array, 2] | _Empty | None = EMPTY
    hits: Int[Array, ""] | _Empty | None = EMPTY
    misses: Int[Array, ""] | _Empty | None = EMPTY

    @property
    def allocated(self) -> bool:
        """Whether the slot holds arrays (`False` when empty, or when filtered out)."""
        return self.value is not EMPTY and self.value is not None

    def holds(self, spec: Spec) -> bool:
        """Whether this slot is allocated for values of `spec`."""
        return self.allocated and (self.value.shape, self.value.dtype) == storage_struct(spec)

    def decoded(self, spec: Spec) -> PyTree[Array]:
        """The stored value, as a value of `spec` (meaningful only where `valid`)."""
        assert self.allocated
        return decode(self.value, spec)


def is_memo(x: Any) -> bool:
    return isinstance(x, Memo)


def allocate(spec: Spec) -> Memo:
    """An empty (invalid) slot with room for a value of `spec`. Costs no FLOPs."""
    shape, dtype = storage_struct(spec)
    return Memo(
        value=jnp.zeros(shape, dtype),
        valid=jnp.zeros((), jnp.bool_),
        key=jnp.zeros((KEY_WORDS,), jnp.uint32),
        hits=jnp.zeros((), jnp.int32),
        misses=jnp.zeros((), jnp.int32),
    )


def filled(slot: Memo, value: PyTree[Array], spec: Spec, key: Array) -> Memo:
    """`slot` holding `value` (of `spec`), computed from dependencies with fingerprint `key`."""
    return Memo(
        value=encode(value, spec),
        valid=jnp.ones((), jnp.bool_),
        key=key,
        hits=slot.hits,
        misses=slot.misses + 1,
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
