"""Operations on a slot's table: allocation and placement, lookup, store with
least-recently-used eviction, invalidation.

A slot (`Memo`, `_slot.py`) holds `K` entries; these functions take a slot and return
it changed, never its tree structure. The value table is written with the value's
bits (`_storage.py`); how to decode them is the caller's (the method's plan).

Allocated tables are placed where they will stay (`allocate`): on a mesh, as global
arrays over the mesh of the module's arrays, the value table sharded like the value
where its sharding is part of its type (`Explicit` axes), everything else replicated;
so the first call changes no slot's type or placement (no retrace, no resharding of a
donated buffer, the same `lax.scan` carry type). A value that a method puts on other
devices is copied onto the table's to be stored, and read back where the method put it
(`stored`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, PyTree

from . import _errors, _jax_internals
from ._caches import ByIdentity
from ._jax_internals import explicit_sharding, is_concrete_array
from ._slot import ENTRY_FIELDS, FIELDS, Memo, fields_of, replaced
from ._storage import Spec, decode, encode, storage_struct


KEY_WORDS = 2


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
    # Keys of zeros: no entry holds a value.
    return Memo(
        value=_zeros((k, *shape), dtype, mesh, _table_spec(explicit, len(shape))),
        key=_zeros((k, KEY_WORDS), jnp.uint32, mesh),
        counts=_counts(_zeros((k + 1, 2), jnp.int32, mesh), slot),
        snapshot=None if snapshot_bytes is None else _zeros((k, snapshot_bytes), jnp.uint8, mesh),
        size=k,
    )


def _counts(new: Array, slot: Memo | None) -> Array:
    """`new`, a table of counts (zeros), with the hits and misses of `slot` where it is
    allocated."""
    if slot is None or not slot.allocated:
        return new
    carried = slot.counts[..., -1, :]
    if is_concrete_array(new) and is_concrete_array(carried):
        carried = jax.device_put(carried, new.sharding)
    return new.at[..., -1, :].set(carried)


def allocate_like(shapes: Memo, mesh: Mesh | None = None, counts: Memo | None = None) -> Memo:
    """A slot of zeros shaped like `shapes` (a slot of `jax.ShapeDtypeStruct`s, as from
    `jax.eval_shape`), placed on `mesh` as `allocate` places it; hit and miss counts
    carried over from an allocated `counts`."""

    def zeros(name: str, s: jax.ShapeDtypeStruct) -> Array:
        new = _zeros(s.shape, s.dtype, mesh, _typed_spec(name, s))
        return _counts(new, counts) if name == "counts" else new

    return dataclasses.replace(
        shapes,
        **{
            f: zeros(f, x)
            for f in FIELDS
            if isinstance(x := getattr(shapes, f), jax.ShapeDtypeStruct)
        },
    )


def storage(slot: Memo) -> list[tuple[str, Any, Any, Any]]:
    """What `allocate_like` makes of each table of `slot` (arrays or shapes): its name,
    shape and dtype, and the value table's sharding where it is part of the type. Two
    slots with equal storage hold each other's tables: a scan carry keeps its type."""
    out = []
    for name in FIELDS:
        for x in jtu.tree_leaves(getattr(slot, name)):  # (a snapshot: a tree)
            spec = _typed_spec(name, x)
            padded = None if spec is None else (*spec, *[None] * (len(x.shape) - len(spec)))
            out.append((name, x.shape, x.dtype, padded))
    return out


def _typed_spec(name: str, x: Any) -> PartitionSpec | None:
    """The spec a table is allocated with: the value table's, where its mesh has
    `Explicit` axes (the sharding is part of its type); else none (replicated)."""
    explicit = explicit_sharding(x) if name == "value" else None
    return None if explicit is None else explicit.spec


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
def read_entry(table: Array, index: Array, spec: Spec) -> PyTree[Array]:
    """The value of `spec` that entry `index` of the value table `table` holds."""
    return decode(lax.dynamic_index_in_dim(table, index, keepdims=False), spec)


def entry(slot: Memo, index: Array, spec: Spec) -> PyTree[Array]:
    """The value stored in entry `index` of `slot`."""
    return read_entry(slot.value, index, spec)


# A value table -> the entry read last and its value, decoded (see `entry_kept`).
_DECODED = ByIdentity("decoded entries")


def entry_kept(slot: Memo, index: Array, spec: Spec) -> PyTree[Array]:
    """`entry` of a concrete slot (an eager call): decoded once per value table and entry,
    and kept while the table lives, so that a hit reads it with no copy (a hit passes the
    table on as it is: `passed_on`). The value is the same array at every hit; one
    deleted since (donated) is decoded again. It is where the method put it (`stored`)."""
    i = int(index)
    found = _DECODED.get(slot.value)
    if found is not None and found[0] == i and found[1] == spec:
        return found[2]
    value = entry(slot, index, spec)
    placed = _PLACED.get(slot.value)
    if placed is not None and i in placed:
        leaves, treedef = jtu.tree_flatten(value)
        value = treedef.unflatten(
            x if s is None else jax.device_put(x, s) for x, s in zip(leaves, placed[i])
        )
    _DECODED.put(slot.value, (i, spec, value))
    return value


def holds_key(slot: Memo, key: Array) -> Array:
    """Per entry, whether it is stored under `key`: the in-graph verdict of the key rule
    (`_key.py`), the one comparison of a call's key with the stored ones. An entry that
    holds nothing has a key of zeros, which no call's key is (`_fingerprint.combine`)."""
    return jnp.all(slot.key == key[None, :], axis=-1)


@jax.jit
def lookup(slot: Memo, key: Array, fresh: Array) -> tuple[Array, Array]:
    """Whether some entry holds `key` and may be reused (`fresh`), and which one."""
    match = holds_key(slot, key) & fresh
    return jnp.any(match), _first(match)


def _first(flags: Array) -> Array:
    """The index of the first true entry of `flags` (0 if none). With one entry, the
    constant 0: no reduction for XLA to compile."""
    if flags.shape[0] == 1:
        return jnp.zeros((), int)  # `jnp.argmax`'s type
    return jnp.argmax(flags)


def holding(slot: Memo, key: Array) -> Array:
    """The index of the valid entry of `slot` that holds `key` (one is known to)."""
    return lookup(slot, key, jnp.ones(slot.key.shape[:-1], jnp.bool_))[1]


@jax.jit
def counts_after(counts: Array, index: Array, hit: ArrayLike) -> Array:
    """`counts` after a use of entry `index`: a hit where `hit` holds, else a store. A hit
    ages the entry by one and counts a hit; a store makes its age 0 and counts a miss;
    both make its last use the clock (hits and misses so far). Elementwise, so XLA runs
    it as one operation (an update at `index` would be one per counter), fused with its
    neighbours: in a traced call it follows the branch, with `hit` the branch's
    predicate, so that neither branch has an operation of its own for it. Jitted: the
    slots of one trace with counters of one shape share its trace and its lowering, and
    XLA inlines the call before it fuses."""
    k = counts.shape[0] - 1
    # Column by column and row by row, then put together: no mask of rows or columns,
    # which XLA would hoist out of a loop as kernels of their own.
    age, used, total = counts[:k, 0], counts[:k, 1], counts[k]
    entry = jnp.arange(k, dtype=jnp.int32) == index.astype(jnp.int32)  # (int64 under x64)
    hit = jnp.asarray(hit, jnp.bool_)
    age = jnp.where(entry, jnp.where(hit, age + 1, 0), age)
    used = jnp.where(entry, total[0] + total[1], used)  # the clock
    total = total + jnp.stack([hit, ~hit]).astype(counts.dtype)  # (hits, misses)
    return jnp.concatenate([jnp.stack([age, used], axis=1), total[None]])


@jax.jit
def _hit_counts(counts: Array, index: Array) -> Array:
    return counts_after(counts, index, True)


def passed_on(slot: Memo, index: Array) -> Memo:
    """`slot` after a hit on entry `index`: its counters moved, and what a hit leaves
    unchanged (the entries) passed on as the very arrays that came in. Only the
    counters go through a computation: eagerly, a jitted function of the whole slot
    would copy its tables into new outputs at every hit."""
    return replaced(slot, {"counts": _hit_counts(slot.counts, index)})


def entry_leaves(slot: Memo) -> list[Array]:
    """The arrays of an allocated slot that a hit leaves unchanged (`ENTRY_FIELDS` but an
    unused snapshot): its entries."""
    fields = fields_of(slot)
    return [x for f in ENTRY_FIELDS if (x := fields[f]) is not None]


# A value table -> where the method put the values of some of its entries, where not on
# the table's devices: entry -> the sharding of each leaf (None: the table's).
_PLACED = ByIdentity("entries placed elsewhere")


def stored(
    slot: Memo,
    value: PyTree[Array],
    spec: Spec,
    key: Array,
    snapshot: Array | None,
    counted: bool = True,
) -> tuple[Memo, Array]:
    """`slot` with `value` (of `spec`, computed from what has fingerprint `key`) written
    over the entry holding `key` if any, else an empty or the least recently used one,
    with the dependencies' `snapshot` where the slot keeps them; and that entry's index.
    The store is counted (`counts_after`) unless the caller counts it (not `counted`).

    Eagerly, a value the method put on other devices (its own `jax.device_put`) is
    copied onto the slot's: the tables stay where they are (where the module's arrays are
    while not committed), and where the method put it is kept by the table's identity,
    as the decoded entries are, so that the entry is read back there (`entry_kept`), as
    the method returns it. Inside a trace, the trace places the value."""
    table = slot.value
    if not is_concrete_array(table) or not is_concrete_array(key):
        return _stored(slot, value, spec, key, snapshot, counted)
    home = table.sharding if table.committed else key.sharding
    leaves, treedef = jtu.tree_flatten(value)
    placement = tuple(map(functools.partial(_elsewhere, home=home.device_set), leaves))
    moved = any(s is not None for s in placement)
    before = _PLACED.get(table)
    if not moved and before is None:  # (the common case)
        return _stored(slot, value, spec, key, snapshot, counted)
    if moved:
        onto = _replicated(home)
        value = treedef.unflatten(
            x if s is None else jax.device_put(x, onto) for x, s in zip(leaves, placement)
        )
    new, index = _stored(slot, value, spec, key, snapshot, counted)
    i = int(index)
    placed = {j: s for j, s in (before or {}).items() if j != i}
    if moved:
        placed[i] = placement
    if placed:
        _PLACED.put(new.value, placed)
    return new, index


def _elsewhere(x: Any, home: Any) -> Any:
    """The sharding of `x` where it is committed to devices other than `home`, else None
    (an uncommitted array goes where the computation does)."""
    if not is_concrete_array(x) or not x.committed or x.sharding.device_set == home:
        return None
    return x.sharding


def _replicated(sharding: Any) -> Any:
    """Every device of `sharding` holding all of a value."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding


@functools.partial(jax.jit, static_argnums=(2, 5))
def _stored(
    slot: Memo,
    value: PyTree[Array],
    spec: Spec,
    key: Array,
    snapshot: Array | None,
    counted: bool,
) -> tuple[Memo, Array]:
    """`stored`, its inputs on one set of devices."""
    k = slot.key.shape[0]
    if k == 1:  # the only entry: the constant 0
        index = _first(slot.valid)
    else:
        same = holds_key(slot, key)
        oldest = jnp.argmin(jnp.where(slot.valid, slot.used, jnp.iinfo(jnp.int32).min))
        index = jnp.where(jnp.any(same), jnp.argmax(same), oldest)
    # Elementwise updates, not scatters: XLA fuses them into their neighbours, which
    # compiles faster (a slot's store is compiled once per slot of a model).
    at = jnp.arange(k, dtype=jnp.int32) == index.astype(jnp.int32)
    new = dataclasses.replace(
        slot,
        value=_put(slot.value, encode(value, spec), index),
        key=jnp.where(at[:, None], key[None, :], slot.key),
        counts=counts_after(slot.counts, index, False) if counted else slot.counts,
        snapshot=slot.snapshot
        if snapshot is None or not eqx.is_array(slot.snapshot)  # no snapshot table
        else _put(slot.snapshot, snapshot, index),
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
    """`slot` whose value table has the type values of `spec` give it, where sharding is
    part of the type (`Explicit` mesh axes): sharded like them (entries along a
    replicated leading axis), or replicated where they have no such sharding (a slot
    filled on a mesh, then called off it). Done before the hit/miss branch, so that both
    branches return a table of one type. Its other leaves are replicated over the same
    mesh (one set of devices per slot). Outside a trace, the devices are those of the
    concrete `inputs` on that mesh, else the table's own."""
    if spec.packed or not spec.types:
        return slot
    sharding, current = spec.types[0].sharding, explicit_sharding(jax.typeof(slot.value))
    if sharding is None:  # replicated, if the table is not
        if current is None or all(axis is None for axis in current.spec):
            return slot
        mesh, table_spec = current.mesh, PartitionSpec()
    else:
        mesh, table_spec = sharding.mesh, _table_spec(sharding, slot.value.ndim - 1)
        if jax.typeof(slot.value).sharding == NamedSharding(mesh, table_spec):
            return slot
    for x in [*inputs, slot.value]:  # eagerly: the concrete mesh the arrays live on
        concrete = (
            getattr(getattr(x, "sharding", None), "mesh", None) if is_concrete_array(x) else None
        )
        if concrete is not None and getattr(concrete, "abstract_mesh", None) == mesh:
            mesh = concrete
            break
    if not isinstance(mesh, Mesh) and not _jax_internals.transforming():
        raise ValueError(_errors.MESH_NOT_FOUND.format(axes=tuple(mesh.axis_names)))
    want = NamedSharding(mesh, table_spec)
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(name: str, x: Array) -> Array:
        target = want if name == "value" else replicated
        if is_concrete_array(x):
            return jax.device_put(x, target)
        return jax.sharding.reshard(x, target)

    fields = [f for f in FIELDS if eqx.is_array(getattr(slot, f))]
    return dataclasses.replace(slot, **{f: place(f, getattr(slot, f)) for f in fields})


def invalidated(slot: Memo, when: ArrayLike = True) -> Memo:
    """`slot` with every entry invalid (its key zeros) where `when` holds, its allocation
    kept."""
    if not slot.allocated:
        return slot
    when = jnp.asarray(when, jnp.bool_)[..., None]
    return dataclasses.replace(slot, key=jnp.where(when, jnp.zeros_like(slot.key), slot.key))


def emptied(slot: Memo) -> Memo:
    """`slot` without arrays, as declared (its size kept)."""
    return Memo(size=slot.size)


@jax.jit
def copied(leaves: list[Any]) -> list[Any]:
    """Copies of `leaves` in new buffers (one dispatch: `jax.device_put(...,
    may_alias=False)` costs ~15x more on XLA:CPU for a slot's eight small arrays);
    `None` stays `None`."""
    return [None if x is None else jnp.copy(x) for x in leaves]
