"""`Memo`: the cache slot, a fixed-shape table of stored values.

A slot is an ordinary pytree node with eight leaves and one static field, `size` (the
number of entries `K`, 1 unless declared `Memo(size=K)`). Empty (`Memo()`), each leaf is
the `EMPTY` marker. Allocated, they are fixed-shape arrays whatever the slot's state:

- per entry (leading axis `K`): `value`, the value's bits (see `_storage.py`); `valid`;
  `key`, the 64-bit fingerprint it was computed from; `age`, hits since then; `used`,
  when it was last used (least-recently-used eviction); `snapshot`, the dependencies'
  bytes where the policy needs them (`Drift`), else zero bytes;
- for the slot: `hits` and `misses`, `int32` counters.

No leaf is an inexact array: slots are invisible to `eqx.filter(...,
eqx.is_inexact_array)`, to `eqx.filter_grad` and to every optax optimizer. A slot has no
metadata that depends on its contents (how to decode `value` is known to the cached
method), so allocating, filling, hitting and invalidating never change the tree
structure: a filter spec or an optimizer state made from a freshly constructed model
fits it for good, and an allocated slot is legal as a `lax.scan` carry and never
retraces. (An empty slot's markers are not arrays: `eqx.filter_jit` treats them as
static, while `jax.jit` and `lax.scan` need the module allocated by `memox.init`.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Int, PyTree, UInt8, UInt32

from . import _errors
from ._storage import Spec, decode, encode, storage_struct


T = TypeVar("T")

KEY_WORDS = 2

# Validated by `Memo.__check_init__` with a message that says what to do; typed for
# static checkers only, so that a runtime type checker does not answer first.
Size = int if TYPE_CHECKING else Any


class _Empty:
    """The leaves of an empty slot."""

    _instance: _Empty | None = None

    def __new__(cls) -> _Empty:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _empty, ()

    def __repr__(self) -> str:
        # Shown by JAX when an empty slot reaches `jax.jit` or `lax.scan` as an argument.
        return (
            "<empty memox.Memo slot: allocate it first with `module = memox.init(module)`, "
            "or `memox.init(module, fn, *args)` for a method that takes arguments>"
        )


# JAX names only the type of a non-array argument it refuses (`jax.jit`, `lax.scan`): the
# type's name says what to do.
_Empty.__module__ = "memox"
_Empty.__qualname__ = _Empty.__name__ = "EmptySlot (allocate it with `memox.init(module)`)"

EMPTY = _Empty()


def _empty() -> _Empty:
    return EMPTY


class Memo(eqx.Module, Generic[T]):
    """A cache slot. Declare one per cached method, as a field of an `eqx.Module`.

    `Memo[T]` annotates the field (`T` is the type of the cached value); `Memo()` is the
    empty slot, usable as the field's default. `Memo(size=K)` is a table of `K` entries,
    keyed by the method's arguments, with least-recently-used eviction. A slot is filled
    by `memox.call` or `memox.jit` when its cached method runs, allocated in advance by
    `memox.init`, invalidated by `memox.clear`, and read by `memox.stats`. Its contents
    are integer and boolean arrays only, so optimizers and `eqx.filter_grad` never see
    them.

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

    # Per entry (leading axis `size`):
    value: Array | _Empty | None = EMPTY
    valid: Bool[Array, " K"] | _Empty | None = EMPTY
    key: UInt32[Array, "K 2"] | _Empty | None = EMPTY
    age: Int[Array, " K"] | _Empty | None = EMPTY
    used: Int[Array, " K"] | _Empty | None = EMPTY
    snapshot: UInt8[Array, "K bytes"] | _Empty | None = EMPTY
    # For the slot:
    hits: Int[Array, ""] | _Empty | None = EMPTY
    misses: Int[Array, ""] | _Empty | None = EMPTY
    size: Size = eqx.field(static=True, default=1)

    def __check_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(_errors.BAD_SIZE.format(size=self.size))

    @property
    def allocated(self) -> bool:
        """Whether the slot holds arrays (`False` when empty, or when filtered out)."""
        return self.value is not EMPTY and self.value is not None

    def holds(self, spec: Spec, snapshot_bytes: int) -> bool:
        """Whether this slot is allocated for values of `spec` (and such snapshots)."""
        if not self.allocated:
            return False
        shape, dtype = storage_struct(spec)
        return (self.value.shape, self.value.dtype, self.snapshot.shape) == (
            (self.size, *shape),
            dtype,
            (self.size, snapshot_bytes),
        )


# The leaves that hold entries (the rest are counters).
ENTRY_FIELDS = ("value", "valid", "key", "snapshot")


def is_memo(x: Any) -> bool:
    return isinstance(x, Memo)


def allocate(slot: Memo, spec: Spec, snapshot_bytes: int) -> Memo:
    """`slot` with room for values of `spec`, every entry invalid. Costs no FLOPs.

    Hit and miss counts carry over from an allocated `slot`."""
    k = slot.size
    shape, dtype = storage_struct(spec)
    # A buffer per leaf: `memox.jit` donates slot leaves, and a buffer is donated once.
    return Memo(
        value=jnp.zeros((k, *shape), dtype),
        valid=jnp.zeros((k,), jnp.bool_),
        key=jnp.zeros((k, KEY_WORDS), jnp.uint32),
        age=jnp.zeros((k,), jnp.int32),
        used=jnp.zeros((k,), jnp.int32),
        snapshot=jnp.zeros((k, snapshot_bytes), jnp.uint8),
        hits=slot.hits if slot.allocated else jnp.zeros((), jnp.int32),
        misses=slot.misses if slot.allocated else jnp.zeros((), jnp.int32),
        size=k,
    )


# The table operations are jitted: an eager `memox.call` then dispatches a few compiled
# programs instead of dozens of primitives; inside a trace they are inlined.


@functools.partial(jax.jit, static_argnums=2)
def entry(slot: Memo, index: Array, spec: Spec) -> PyTree[Array]:
    """The value stored in entry `index`."""
    return decode(lax.dynamic_index_in_dim(slot.value, index, keepdims=False), spec)


@jax.jit
def lookup(slot: Memo, key: Array, fresh: Array) -> tuple[Array, Array]:
    """Whether some entry holds `key` and may be reused (`fresh`), and which one."""
    match = slot.valid & jnp.all(slot.key == key[None, :], axis=-1) & fresh
    return jnp.any(match), jnp.argmax(match)


def _clock(slot: Memo) -> Array:
    return slot.hits + slot.misses


@jax.jit
def touched(slot: Memo, index: Array) -> Memo:
    """`slot` after a hit on entry `index`."""
    return dataclasses.replace(
        slot,
        age=slot.age.at[index].add(1),
        used=slot.used.at[index].set(_clock(slot)),
        hits=slot.hits + 1,
    )


@functools.partial(jax.jit, static_argnums=2)
def stored(
    slot: Memo, value: PyTree[Array], spec: Spec, key: Array, snapshot: Array
) -> tuple[Memo, Array]:
    """`slot` with `value` (of `spec`, computed from what has fingerprint `key`) written
    over the entry holding `key` if any, else an empty or the least recently used one;
    and that entry's index."""
    same = slot.valid & jnp.all(slot.key == key[None, :], axis=-1)
    oldest = jnp.argmin(jnp.where(slot.valid, slot.used, jnp.iinfo(jnp.int32).min))
    index = jnp.where(jnp.any(same), jnp.argmax(same), oldest)
    new = dataclasses.replace(
        slot,
        value=_put(slot.value, encode(value, spec), index),
        valid=slot.valid.at[index].set(True),
        key=slot.key.at[index].set(key),
        age=slot.age.at[index].set(0),
        used=slot.used.at[index].set(_clock(slot)),
        snapshot=_put(slot.snapshot, snapshot, index),
        misses=slot.misses + 1,
    )
    return new, index


def _explicit_mesh(x: Array) -> Any:
    """The mesh of `x`'s sharding type if it has `Explicit` axes, else `None`."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    return mesh


def _put(table: Array, update: Array, index: Array) -> Array:
    """`table` with entry `index` set to `update`. Where a mesh's axes are `Explicit`,
    sharding is part of the type and both must agree: the table takes the update's
    sharding (entries sharded like the value), or else the update the table's. Elsewhere
    XLA propagates shardings and nothing is resharded."""
    if (mesh := _explicit_mesh(update)) is not None:
        want = NamedSharding(mesh, PartitionSpec(None, *jax.typeof(update).sharding.spec))
        if jax.typeof(table).sharding != want:
            table = jax.sharding.reshard(table, want)
    elif (mesh := _explicit_mesh(table)) is not None:
        entry = PartitionSpec(*jax.typeof(table).sharding.spec[1:])
        update = jax.sharding.reshard(update, NamedSharding(mesh, entry))
    return lax.dynamic_update_index_in_dim(table, update, index, 0)


def invalidated(slot: Memo, when: Array | bool = True) -> Memo:
    """`slot` with every entry invalid where `when` holds, its allocation kept."""
    if not slot.allocated:
        return slot
    return dataclasses.replace(slot, valid=slot.valid & ~jnp.asarray(when, jnp.bool_))


def emptied(slot: Memo) -> Memo:
    """`slot` without arrays, as declared (its size kept)."""
    return Memo(size=slot.size)


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


def slots(tree: PyTree) -> dict[Path, Memo]:
    """Every `Memo` in `tree` by path, in flattening order."""
    items = jtu.tree_flatten_with_path(tree, is_leaf=is_memo)[0]
    return {path: leaf for path, leaf in items if is_memo(leaf)}


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
