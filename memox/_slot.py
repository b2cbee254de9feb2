"""`Memo`: the cache slot, a fixed-shape table of stored values.

A slot is an ordinary pytree node with eight fields and one static field, `size` (the
number of entries `K`, 1 unless declared `Memo(size=K)`). Empty (`Memo()`), each field
holds the `EMPTY` marker, the integer 0 marked as such. Allocated, the fields are
fixed-shape arrays whatever the slot's state:

- per entry (leading axis `K`): `value`, the value's bits (see `_storage.py`); `valid`;
  `key`, the 64-bit fingerprint it was computed from; `age`, hits since then; `used`,
  when it was last used (least-recently-used eviction); `snapshot`, the dependencies'
  bytes where the policy keeps them (`Drift`; under every other policy `None`, no leaf:
  checkpointers refuse a zero-size array);
- for the slot: `hits` and `misses`, `int32` counters.

No leaf is an inexact array: slots are invisible to `eqx.filter(...,
eqx.is_inexact_array)`, to `eqx.filter_grad` and to every optax optimizer. A slot has no
metadata that depends on its contents (how to decode `value` is known to the cached
method), so allocating, filling, hitting and invalidating never change the tree
structure: a filter spec or an optimizer state made from a freshly constructed model
fits it for good (an empty field is a leaf where the allocated slot has an array, and
an unused `snapshot` is `None` in both once filtered), and an allocated slot is legal as
a `lax.scan` carry and never retraces.

The marker is an integer so that every checkpointer writes a model with empty slots, or
a `memox.strip`ped one, as it is and reads it back (orbax and Equinox rebuild a leaf as
`type(like)(value)`), and `eqx.filter_jit` treats it as static. Passed through `jax.jit`
or `lax.scan` it becomes a traced integer, which memox cannot allocate in place (a loop
carry would change type): `allocate` refuses it, naming `memox.init`. A slot is
allocated while its `value` has the entries' axis (`Memo.allocated`): a 0-d value, the
marker as `jax.eval_shape` or a checkpoint gave it back, is an empty slot.

Allocated tables are placed where they will stay (`allocate`): on a mesh, as global
arrays over the mesh of the module's arrays, the value table sharded like the value
where its sharding is part of its type (`Explicit` axes), everything else replicated;
so the first call changes no slot's type or placement (no retrace, no resharding of a
donated buffer, the same `lax.scan` carry type).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import typing
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Int, PyTree, UInt8, UInt32

from . import _errors
from ._fingerprint import is_concrete_array
from ._hoist import Hoisted as Hoisted
from ._key import explicit_sharding
from ._storage import Spec, decode, encode, storage_struct


T = TypeVar("T")

KEY_WORDS = 2

# Validated by `Memo.__check_init__` with a message that says what to do; typed for
# static checkers only, so that a runtime type checker does not answer first.
if TYPE_CHECKING:
    Size: typing.TypeAlias = int
else:
    Size = Any


class _Empty(int):
    """The fields of an empty slot: the integer 0, marked.

    A leaf, where an allocated slot has its arrays: `eqx.filter(model, ...)` takes both
    out alike, so a filter spec or an optimizer state made from a freshly constructed
    model fits the model once allocated. An integer: every checkpointer writes it and
    reads it back (orbax and Equinox rebuild a leaf as `type(like)(value)`: the marker),
    and `eqx.filter_jit` treats it as static. Through `jax.jit` or `lax.scan` it becomes
    a traced 0-d integer, which `allocate` refuses with the fix."""

    _instance: _Empty | None = None

    def __new__(cls, _value: int = 0) -> _Empty:
        if cls._instance is None:
            cls._instance = super().__new__(cls, 0)
        return cls._instance

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _empty, ()

    def __repr__(self) -> str:
        return (
            "<empty memox.Memo slot: allocate it first with `module = memox.init(module)`, "
            "or `memox.init(module, fn, *args)` for a method that takes arguments>"
        )


_Empty.__module__ = "memox"
_Empty.__qualname__ = _Empty.__name__ = "EmptySlot"

EMPTY = _Empty()

# A field of a slot: `Leaf[X]` is the array `X` once the slot is allocated, the `EMPTY`
# marker before (or `None` where `eqx.filter` took the slot out), and is checked as
# exactly that at run time. Static checkers see `X | Any`: memox reads a slot's leaves
# only where `slot.allocated` holds, which they cannot narrow the leaves by.
if TYPE_CHECKING:
    Leaf: typing.TypeAlias = T | Any
else:

    class Leaf:
        def __class_getitem__(cls, array: Any) -> Any:
            return array | _Empty | None


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
    value: Leaf[Array] = EMPTY
    valid: Leaf[Bool[Array, " K"]] = EMPTY
    key: Leaf[UInt32[Array, "K 2"]] = EMPTY
    age: Leaf[Int[Array, " K"]] = EMPTY
    used: Leaf[Int[Array, " K"]] = EMPTY
    snapshot: Leaf[UInt8[Array, "K bytes"]] = EMPTY
    # For the slot:
    hits: Leaf[Int[Array, ""]] = EMPTY
    misses: Leaf[Int[Array, ""]] = EMPTY
    size: Size = eqx.field(static=True, default=1)

    def __set_name__(self, owner: type, name: str) -> None:
        # A slot declared with a default (`b_cache: Memo[...] = Memo()`) becomes a field
        # whose default is set on every instance, even by a custom `__init__` that does
        # not assign it (Equinox sets a field with a converter after `__init__`; a plain
        # default would be missing from the instance and its pytree).
        if (
            isinstance(owner, type)
            and issubclass(owner, eqx.Module)
            and "__dataclass_fields__" not in owner.__dict__
            and name in annotations_of(owner)
        ):
            setattr(owner, name, eqx.field(default=self, converter=_as_slot))

    def __check_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(_errors.BAD_SIZE.format(size=self.size))

    @property
    def allocated(self) -> bool:
        """Whether the slot holds its tables (`False` when empty, or when filtered out).
        A table has its entries along a leading axis; a 0-d `value` is the `EMPTY` marker,
        or what it became through `jax.jit`, `jax.eval_shape` or a checkpoint."""
        return getattr(self.value, "ndim", 0) > 0

    def holds(self, spec: Spec, snapshot_bytes: int | None) -> bool:
        """Whether this slot is allocated for values of `spec` (and such snapshots; None:
        no snapshot table)."""
        if not self.allocated:
            return False
        shape, dtype = storage_struct(spec)
        snapshot = self.snapshot.shape[1] if eqx.is_array(self.snapshot) else None
        return (self.value.shape, self.value.dtype, snapshot) == (
            (self.size, *shape),
            dtype,
            snapshot_bytes,
        )


def _as_slot(x: T) -> T:
    """The converter of a slot field: the value as given (see `Memo.__set_name__`)."""
    return x


def annotations_of(cls: type) -> dict[str, Any]:
    """The annotations `cls` itself declares (Python 3.14's lazy annotations too:
    unresolvable names come back as forward references)."""
    if sys.version_info >= (3, 14):
        import annotationlib

        return dict(annotationlib.get_annotations(cls, format=annotationlib.Format.FORWARDREF))
    return dict(cls.__dict__.get("__annotations__", {}))


def is_memo_annotation(annotation: Any) -> bool:
    """Whether a field annotation declares a slot (`Memo`, `Memo[...]`, as a string too)."""
    if isinstance(annotation, str):
        return annotation.split("[")[0].split(".")[-1].strip() == "Memo"
    name = getattr(annotation, "__forward_arg__", None)
    if isinstance(name, str):
        return is_memo_annotation(name)
    return annotation is Memo or typing.get_origin(annotation) is Memo


# The fields that hold entries (the rest are counters).
ENTRY_FIELDS = ("value", "valid", "key", "snapshot")
FIELDS = ("value", "valid", "key", "age", "used", "snapshot", "hits", "misses")


def is_memo(x: Any) -> bool:
    return isinstance(x, Memo)


def is_empty(x: Any) -> bool:
    """Whether `x` is a slot as declared, not yet allocated (not a filter's image of a
    slot, whose fields are `None`)."""
    return isinstance(x, Memo) and x.value is not None and not x.allocated


def allocate(slot: Memo, spec: Spec, snapshot_bytes: int | None, mesh: Mesh | None = None) -> Memo:
    """`slot` with room for values of `spec`, every entry invalid. Costs no FLOPs.

    With a `mesh` (that of the module's arrays, `mesh_of`), the tables are global arrays
    over it, placed as they will stay: the value table sharded like the value where that
    sharding is part of its type (`Explicit` axes), every other leaf replicated. No
    snapshot table unless the policy keeps snapshots (`snapshot_bytes` is not None):
    checkpointers refuse a zero-size array. Hit and miss counts carry over from
    an allocated `slot`."""
    traced = isinstance(slot.value, jax.Array) and not is_concrete_array(slot.value)
    if traced and not slot.allocated:
        raise TypeError(_errors.EMPTY_TRACED)
    k = slot.size
    shape, dtype = storage_struct(spec)
    explicit = spec.types[0].sharding if not spec.packed and spec.types else None
    # A buffer per leaf: `memox.jit` donates slot leaves, and a buffer is donated once.
    return Memo(
        value=_zeros((k, *shape), dtype, mesh, _table_spec(explicit, len(shape))),
        valid=_zeros((k,), jnp.bool_, mesh),
        key=_zeros((k, KEY_WORDS), jnp.uint32, mesh),
        age=_zeros((k,), jnp.int32, mesh),
        used=_zeros((k,), jnp.int32, mesh),
        snapshot=None if snapshot_bytes is None else _zeros((k, snapshot_bytes), jnp.uint8, mesh),
        hits=slot.hits if slot.allocated else _zeros((), jnp.int32, mesh),
        misses=slot.misses if slot.allocated else _zeros((), jnp.int32, mesh),
        size=k,
    )


def allocate_like(shapes: Memo, mesh: Mesh | None = None) -> Memo:
    """A slot of zeros shaped like `shapes` (a slot of `jax.ShapeDtypeStruct`s, as from
    `jax.eval_shape`), placed on `mesh` as `allocate` places it."""

    def zeros(name: str, s: jax.ShapeDtypeStruct) -> Array:
        explicit = explicit_sharding(s) if name == "value" else None  # (the table's)
        return _zeros(s.shape, s.dtype, mesh, None if explicit is None else explicit.spec)

    return dataclasses.replace(
        shapes,
        **{
            f: zeros(f, x)
            for f in FIELDS
            if isinstance(x := getattr(shapes, f), jax.ShapeDtypeStruct)
        },
    )


def mesh_of(arrays: Iterable[Any]) -> Mesh | None:
    """The mesh that concrete `arrays` are laid out on (the first found with a
    `NamedSharding`), or where none is concrete the mesh set by `jax.set_mesh`; None
    where there is none (inside a trace, `conformed` gives a table its type)."""
    concrete = False
    for x in arrays:
        if not is_concrete_array(x):
            continue
        concrete, sharding = True, x.sharding
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    if concrete:  # on one device: where `jnp.zeros` puts them
        return None
    try:
        found = jax.sharding.get_mesh()
    except ValueError:  # inside `jax.jit`
        return None
    return found if isinstance(found, Mesh) and not found.empty else None


def _table_spec(value: NamedSharding | None, ndim: int) -> PartitionSpec:
    """The spec of a table (entries along a replicated leading axis) whose entries have
    `ndim` axes and are sharded like `value` (complex parts, keys: trailing axes)."""
    if value is None:
        return PartitionSpec()
    return PartitionSpec(None, *value.spec, *(None,) * (ndim - len(value.spec)))


def _zeros(shape: tuple[int, ...], dtype: Any, mesh: Mesh | None, spec: Any = None) -> Array:
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return jnp.zeros(shape, dtype, device=NamedSharding(mesh, spec or PartitionSpec()))


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


def holding(slot: Memo, key: Array) -> Array:
    """The index of the valid entry of `slot` that holds `key` (one is known to)."""
    return lookup(slot, key, jnp.ones_like(slot.valid))[1]


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


def passed_on(slot: Memo, index: Array) -> Memo:
    """`slot` after a hit on entry `index` read without a check (a pinned slot of
    `memox.scan`'s loop, a hit decided on the host): counters touched, entries passed on
    as the very arrays that came in."""
    after = touched(slot, index)  # (jitted: its outputs are new arrays)
    return dataclasses.replace(after, **{f: getattr(slot, f) for f in ENTRY_FIELDS})


def entry_leaves(slot: Memo) -> list[Array]:
    """The arrays of an allocated slot's entries (`ENTRY_FIELDS` but an unused snapshot)."""
    return [x for f in ENTRY_FIELDS if (x := getattr(slot, f)) is not None]


@functools.partial(jax.jit, static_argnums=2)
def stored(
    slot: Memo, value: PyTree[Array], spec: Spec, key: Array, snapshot: Array | None
) -> tuple[Memo, Array]:
    """`slot` with `value` (of `spec`, computed from what has fingerprint `key`) written
    over the entry holding `key` if any, else an empty or the least recently used one,
    with the dependencies' `snapshot` where the slot keeps them; and that entry's index."""
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
        snapshot=slot.snapshot
        if snapshot is None or not eqx.is_array(slot.snapshot)  # no snapshot table
        else _put(slot.snapshot, snapshot, index),
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
    sharding is part of the type and both must agree: the update takes the table's
    sharding, so that the table's type never changes (a `cond`'s branches, a loop's
    carry); `conformed` gave the table the value's sharding beforehand. Elsewhere XLA
    propagates shardings and nothing is resharded."""
    if (mesh := _explicit_mesh(table)) is not None:
        entry = NamedSharding(mesh, PartitionSpec(*jax.typeof(table).sharding.spec[1:]))
        if jax.typeof(update).sharding != entry:
            update = jax.sharding.reshard(update, entry)
    elif _explicit_mesh(update) is not None:
        update = jax.sharding.reshard(update, jax.typeof(table).sharding)
    return lax.dynamic_update_index_in_dim(table, update, index, 0)


def conformed(slot: Memo, spec: Spec, inputs: list[Any]) -> Memo:
    """`slot` whose table is sharded like values of `spec` (entries along a replicated
    leading axis), where that sharding is part of the type (`Explicit` mesh axes): done
    before the hit/miss branch, so that both branches return a table of one type. Its
    other leaves are replicated over the same mesh (one set of devices per slot). Outside
    a trace, the devices are those of the concrete `inputs` on that mesh."""
    if spec.packed or not spec.types or spec.types[0].sharding is None:
        return slot
    sharding = spec.types[0].sharding
    want = NamedSharding(sharding.mesh, _table_spec(sharding, slot.value.ndim - 1))
    if jax.typeof(slot.value).sharding == want:
        return slot
    mesh = sharding.mesh
    for x in inputs:  # eagerly: the concrete mesh the inputs live on
        concrete = (
            getattr(getattr(x, "sharding", None), "mesh", None) if is_concrete_array(x) else None
        )
        if concrete is not None and getattr(concrete, "abstract_mesh", None) == mesh:
            mesh = concrete
            break
    want = NamedSharding(mesh, want.spec)
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(name: str, x: Array) -> Array:
        target = want if name == "value" else replicated
        if is_concrete_array(x):
            return jax.device_put(x, target)
        return jax.sharding.reshard(x, target)

    fields = [f for f in FIELDS if eqx.is_array(getattr(slot, f))]
    return dataclasses.replace(slot, **{f: place(f, getattr(slot, f)) for f in fields})


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
        # (JAX types `GetAttrKey` as `Any`, so `isinstance` does not rule out `None`.)
        field = last.name if isinstance(last, jtu.GetAttrKey) else None  # pyright: ignore[reportOptionalMemberAccess]
        yield SlotSite(path, leaf, owner if path else None, field)


def replace_slots(
    tree: PyTree, new: Mapping[Path, Memo | Hoisted], *, rebuild: bool = False
) -> PyTree:
    """`tree` with the slots at the paths in `new` replaced (by slots, or by values read
    ahead by `memox.hoist`); with `rebuild`, a new tree (new node objects) even when
    `new` is empty."""
    if not new and not rebuild:
        return tree
    items, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_memo)
    leaves = [new.get(path, leaf) for path, leaf in items]
    return jtu.tree_unflatten(treedef, leaves)


def path_name(path: Path) -> str:
    return jtu.keystr(path).lstrip(".")
