"""The partition of a call's inputs into slots and everything else, and its reassembly:
how `memox.jit` passes a call to `jax.jit` and puts the returned slots back.

The wrapper flattens its arguments once, without a Python test per node: where the
slots' leaves lie is worked out once per tree structure (`_sites.layout`; a module
whose nodes refuse that is taken apart node by node). The arrays are traced
arguments: the module's, then the arguments', then the allocated slots' leaves, one
list per slot (a slot object found at several paths is passed once: a buffer can be
donated only once). Everything else (the tree structures, static fields and
non-array leaves) is one hashable static argument, `Signature`: the semantics of
`eqx.filter_jit`, without its second partition of the same trees on every call. Which
slots the call may donate is read while the leaves are flattened, before anything
else holds them (`_donation.py`). The returned slots are spliced into the caller's
module (`_Split.put`): every other leaf is the caller's own array. Where every slot node
was donated and given its returned slot (`_Split.hand_over`), the module passed in holds
what the call returned, and nothing is spliced.

The entries of a slot whose hit was decided on the host are passed apart (read, not
donated) and put back inside the trace (`refilled`); the slot leaves the compiled
function as its counters alone: a donated slot node keeps its entries and is handed the
counters; anywhere else the slot passed in is rebuilt with them (`_Split._counted`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._caches import Cache
from ._donation import NOBODY, hand_over, references, shared
from ._jax_internals import is_concrete_array, node_data
from ._key import exact_under_eq, same, same_nodes, same_structures
from ._sites import Layout, layout as layout_of, replace_slots, with_nodes
from ._slot import FIELDS, Memo, is_memo, is_value_table, leaves_of, replaced
from ._table import copied
from ._token import token


ARRAY = object()  # marks a leaf passed as an array
# Where a slot's counters are among its leaves: after its value and key, one array each.
_COUNTS = FIELDS.index("counts")
# What `eqx.is_array` accepts, inlined (called on every leaf at every call; pinned by
# `test_partition.py` against `eqx.is_array`).
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def hashable_partition(leaves: Iterable[Any], arrays: list[Any]) -> tuple[Any, ...]:
    """The hashable half of `leaves` (as `equinox._compile_utils.hashable_partition`): each
    leaf where it is not an array, `ARRAY` where it is; the arrays are appended to
    `arrays`, in order. Every compiled wrapper takes its trees apart with this."""
    statics = []
    for x in leaves:
        if isinstance(x, ARRAY_TYPES):
            arrays.append(x)
            statics.append(ARRAY)
        else:
            statics.append(x)
    return tuple(statics)


def hashable_combine(statics: Iterable[Any], arrays: Iterator[Any]) -> list[Any]:
    """The leaves `hashable_partition` took apart, with the next of `arrays` for each
    `ARRAY`."""
    return [next(arrays) if x is ARRAY else x for x in statics]


_MEMO_TYPES = Cache("memo types", 4096)  # type -> whether it is a `Memo`


def _is_memo(x: Any) -> bool:
    """`is_memo`, with the answer kept per type (`isinstance` on an `eqx.Module` class
    goes through `ABCMeta`: called on every node of the module at every call)."""
    kind = type(x)
    found = _MEMO_TYPES.get(kind)
    if found is None:
        found = _MEMO_TYPES.put(kind, is_memo(x))
    return found


def _ready(slot: Memo) -> bool:
    """Whether `slot` needs neither allocation nor revival (the common case, checked fast:
    an empty slot may not need allocation, and is left to the slow path to decide)."""
    return slot.allocated and not (is_concrete_array(slot.value) and slot.value.is_deleted())


@dataclasses.dataclass(frozen=True)
class _SlotLeaf:
    """Marks leaf `j` of an allocated slot, passed in the `index`-th list of slot leaves
    (a slot object found at several paths, as in a shared submodule, is passed once: a
    buffer can be donated only once)."""

    index: int
    j: int


_SLOT_MARKERS = Cache("slot leaf markers", 1 << 16)  # (index, n) -> tuple of _SlotLeaf


def _slot_markers(index: int, n: int) -> tuple[_SlotLeaf, ...]:
    """The markers of the `n` leaves of the `index`-th slot passed, the same objects at
    every call (compared by identity first when `jax.jit` looks its signature up)."""
    found = _SLOT_MARKERS.get((index, n))
    if found is None:
        found = _SLOT_MARKERS.put((index, n), tuple(_SlotLeaf(index, j) for j in range(n)))
    return found


def _passed_statics(layout: Layout) -> tuple[Any, ...]:
    """`Signature.module_leaves` of a pytree of `layout` whose slots are each passed as
    its own leaves, in order, and whose other leaves are all arrays (computed once per
    layout: such calls share one tuple, which `Signatures.same` compares by identity)."""
    found = layout.derived.get("statics")
    if found is None:
        statics: list[Any] = [ARRAY] * layout.leaves
        _mark_slots(statics, layout, range(len(layout.ranges)))
        found = layout.derived["statics"] = tuple(statics)
    return found


def _mark_slots(statics: list[Any], layout: Layout, indices: Iterable[int]) -> None:
    """Put into `statics` each slot's leaf markers, the slot passed as the `index`-th
    list of leaves (`indices`, per slot of `layout`; -1 where it is not passed)."""
    for index, (a, b) in zip(indices, layout.ranges):
        if index >= 0:
            statics[a:b] = _slot_markers(index, b - a)


def _outside(statics: list[Any]) -> list[int]:
    """The positions of `statics` not marked as a slot's leaves (where some slot is not
    passed as leaves: `Layout.others` counts every slot's as inside)."""
    return [i for i, x in enumerate(statics) if type(x) is not _SlotLeaf]


def _concrete(leaves: list[Any]) -> bool:
    """Whether one slot's leaves (a slot is concrete or traced as a whole) are concrete."""
    return is_concrete_array(next(x for x in leaves if x is not None))


@dataclasses.dataclass
class _Split:
    """A call taken apart: the signature, the arrays, the slots' leaves (one list per
    slot), a function putting new slots (by index in flattening order) into the module,
    whether every slot is ready (needs neither allocation nor revival), and, with
    donation, the slots to hand over: per list of leaves, the `Memo` node they were
    flattened from (None where traced, or without donation), the positions of the
    leaves something else holds too, and the index of its slot."""

    signature: Signature
    arrays: list[Any]
    slot_leaves: list[list[Any]]
    put: Callable[[dict[int, Memo]], Any]
    ready: bool
    owners: list[Memo | None]
    shared: list[frozenset[int]]
    first: list[int]
    slots: int  # how many slots the module holds (empty ones included)
    # Whether every slot of `module` (the module taken apart) is allocated and passed as
    # the leaves of its own node (no node at two paths, no two nodes holding one slot).
    nodes_alone: bool
    module: Any
    structures: list[Any]  # the tree structure of each slot passed

    @functools.cached_property
    def flat(self) -> list[Any]:
        """The call's input arrays in one list: the arrays, then the slots' leaves (the
        positions `_decided.Hits` and the trace's `Scope` agree on)."""
        return [*self.arrays, *(x for leaves in self.slot_leaves for x in leaves)]

    def parted(self, hits: tuple) -> tuple[list[list[Any]], list[list[Any]]]:
        """The slots' leaves, with `None` for the entries of each slot whose hit was
        decided on the host, and those entries (passed apart: read, not donated)."""
        if not hits:
            return self.slot_leaves, []
        out = list(self.slot_leaves)
        starts = self.signature.starts(len(self.arrays), out)
        kept = []
        for h in hits:
            i = starts[h.entries[0]]
            leaves = out[i] = list(out[i])
            kept.append([leaves[j] for j in h.within])  # (`entry_leaves`' order)
            for j in h.within:
                leaves[j] = None
        return out, kept

    def donated(self, slot_leaves: list[list[Any]]) -> list[list[Any]]:
        """`slot_leaves` to donate: a copy of a slot's where something else holds one of
        the leaves passed (none in the threaded loop; the entries of a hit decided on the
        host are passed apart, `None` here), its node then not handed over; traced ones
        are not donated (an outer trace's)."""
        out = []
        for i, leaves in enumerate(slot_leaves):
            owner = self.owners[i]
            held = self.shared[i]
            if owner is not None and (held is NOBODY or all(leaves[j] is None for j in held)):
                out.append(leaves)
            elif owner is None and not _concrete(leaves):
                out.append(leaves)
            else:
                out.append(copied(leaves))
                self.owners[i] = None
        return out

    def hand_over(self, new_slots: dict[int, Any], decided: frozenset[int]) -> Any:
        """Give each donated slot node the slot returned in its place, and return the
        module the call returns: the module passed in, where that gave every slot of it
        its returned slot, of the same leaves (each slot node one of its own, at one
        path; every other leaf the caller's), else a new module (`put`).

        `decided`: the slots whose hits were decided on the host, returned as their
        counters alone (their entries, passed apart, are the caller's arrays). Such a
        node is handed the counters (it holds the entries already) and stands for that
        slot in `new_slots`; any other such slot is the slot passed in with the new
        counters. A new module gets a copy of a node handed the counters: it belongs to
        the module passed in alone."""
        every, nodes = self.nodes_alone, set()
        for i, (owner, k) in enumerate(zip(self.owners, self.first)):
            if k not in new_slots:
                every = False
            elif k in decided:
                if owner is not None:
                    hand_over(owner, new_slots[k])
                    new_slots[k] = owner
                    nodes.add(k)
                else:
                    new_slots[k] = self._counted(i, new_slots[k])
                    every = False
            elif owner is not None:
                hand_over(owner, new_slots[k])
                every = every and len(leaves_of(new_slots[k])) == len(self.slot_leaves[i])
            else:
                every = False
        if every:
            return self.module
        return self.put({k: replaced(s, {}) if k in nodes else s for k, s in new_slots.items()})

    def _counted(self, i: int, counts: Any) -> Memo:
        """The `i`-th slot passed, its counters `counts`."""
        leaves = list(self.slot_leaves[i])
        leaves[_COUNTS] = counts
        return jtu.tree_unflatten(self.structures[i], leaves)

    def hand_over_empty(self) -> None:
        """Where the call failed after consuming a donated slot: give its node an empty
        allocation of the same shapes (it recomputes; nothing the caller holds breaks)."""
        for owner, leaves in zip(self.owners, self.slot_leaves):
            if owner is not None and any(x.is_deleted() for x in leaves):
                hand_over(owner, jtu.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), owner))


@dataclasses.dataclass(frozen=True, eq=False)
class Signature:
    """What a call is compiled for (the static argument of `jax.jit`, hashable): the
    tree structures of the module and of the arguments, and every leaf that is not an
    array. The arrays travel separately: the module's then the arguments', and the
    allocated slots' leaves, one list per slot.

    Two signatures are equal exactly when their non-array parts have equal tokens
    (`_key.same` on `exact`): `jax.jit` finds a program by this equality, so a static
    field or a leaf going from `1` to `True`, or from `0.0` to `-0.0`, compiles anew,
    as the method's static key would differ (`PyTreeDef.__eq__` and `==` alone would
    not see it)."""

    module: Any  # treedef of the module
    module_leaves: tuple[Any, ...]  # the leaf where static, else `ARRAY` or a `_SlotLeaf`
    arguments: Any  # treedef of `(args, kwargs)`
    argument_leaves: tuple[Any, ...]  # the leaf where static; `ARRAY`

    def __hash__(self) -> int:
        # Hashed once: `jax.jit` hashes its static argument at every call, and the calls
        # of a loop pass one signature object (`Signatures.same`).
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.module, self.module_leaves, self.arguments, self.argument_leaves))
            object.__setattr__(self, "_hash", found)
        return found

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Signature:
            return NotImplemented
        return self.loosely(other) and same(self.exact, other.exact)

    def loosely(self, other: Signature) -> bool:
        """Equal by `==` (what `eqx.filter_jit` compares): necessary, not sufficient."""
        return (
            self.module == other.module
            and self.arguments == other.arguments
            and self.module_leaves == other.module_leaves
            and self.argument_leaves == other.argument_leaves
        )

    @functools.cached_property
    def exact(self) -> Any:
        """The tokens of the non-array parts (computed where two signatures equal by `==`
        are compared, once per signature object)."""
        statics = [x for x in (*self.module_leaves, *self.argument_leaves) if not _is_marker(x)]
        try:
            return token((self.module, self.arguments, tuple(statics)))
        except (TypeError, ValueError):  # no exact token (several processes): `==`
            return _LOOSE

    def starts(self, n_arrays: int, slot_leaves: list[list[Any]]) -> dict[int, int]:
        """`_starts` of a call of this signature (the same at every such call: the
        signature fixes how many arrays and slot leaves it passes), computed once."""
        found = self.__dict__.get("_starts")
        if found is None:
            found = _starts(n_arrays, slot_leaves)
            object.__setattr__(self, "_starts", found)
        return found

    @functools.cached_property
    def exact_modules(self) -> bool:
        """Whether `==` is exact on the module's tree structure (`_key.exact_under_eq`)."""
        return exact_under_eq(self.module)

    @functools.cached_property
    def exact_arguments(self) -> bool:
        """Whether `==` is exact on the arguments' tree structure."""
        return exact_under_eq(self.arguments)

    @functools.cached_property
    def module_data(self) -> list[Any]:
        """The data of every node of the module's tree structure (`node_data`), read once:
        each call of a loop compares its own with the last signature's."""
        return node_data(self.module)

    @functools.cached_property
    def argument_data(self) -> list[Any]:
        """The data of every node of the arguments' tree structure, read once."""
        return node_data(self.arguments)

    @classmethod
    def split(cls, module: Any, args: tuple, kwargs: dict, donate: bool) -> _Split:
        leaves, treedef = jtu.tree_flatten(module)
        layout = layout_of(treedef)
        if layout is None:
            del leaves  # (it holds the slots' arrays: `_split_nested` counts who does)
            return cls._split_nested(module, args, kwargs, donate)
        # Before anything else holds them: which slots' arrays something else holds too.
        if donate:
            counts = references(leaves)
            held = [shared(leaves, counts, a, b) if a >= 0 else None for a, b in layout.ranges]
        else:
            held = [None] * len(layout.ranges)
        slot_leaves: list[list[Any]] = []
        owners: list[Memo | None] = []
        shared_leaves: list[frozenset[int]] = []
        first: list[int] = []
        seen: dict[int, int] = {}
        indices: list[int] = []  # per slot, the index of its list of leaves (-1: not passed)
        structures: list[Any] = []
        holders = layout.holders
        ready = True
        for k, (a, b) in enumerate(layout.ranges):
            # (a slot's first leaf is its `value`: `_sites.holds_empty` reads it so too)
            if a < 0 or not is_value_table(leaves[a]):  # empty, or filtered out
                ready = False
                indices.append(-1)
                continue
            value = leaves[a]
            if is_concrete_array(value) and value.is_deleted():
                ready = False
            index = seen.setdefault(id(value), len(slot_leaves))
            indices.append(index)
            if index == len(slot_leaves):
                slot_leaves.append(leaves[a:b])
                node = held[k]
                if node is not None:
                    node = holders.node(module, k, value, node, layout.node)
                owners.append(node)
                shared_leaves.append(held[k] or NOBODY)
                first.append(k)
                structures.append(layout.structures[k])
        every = len(first) == len(layout.ranges)  # each slot passed as its own leaves
        arrays = [leaves[i] for i in layout.others]
        if every and all(map(isinstance, arrays, itertools.repeat(ARRAY_TYPES))):
            statics: Sequence[Any] = _passed_statics(layout)  # (one object per layout)
        else:
            arrays, statics = [], leaves[:]
            _mark_slots(statics, layout, indices)
            passed_all = all(a < 0 or i >= 0 for (a, _), i in zip(layout.ranges, indices))
            for i in layout.others if passed_all else _outside(statics):
                x = leaves[i]
                if isinstance(x, ARRAY_TYPES):
                    arrays.append(x)
                    statics[i] = ARRAY
            statics = tuple(statics)
        arg_statics, arg_treedef = cls._arguments(args, kwargs, arrays)

        def put(new_slots: dict[int, Memo]) -> Any:
            new = {k: leaves_of(slot) for k, slot in new_slots.items()}
            if any(len(x) != b - a for k, x in new.items() for a, b in [layout.ranges[k]]):
                # A slot the call allocated (an unused snapshot's marker became `None`):
                # the structure changed there.
                tree = jtu.tree_unflatten(treedef, leaves)
                return replace_slots(tree, {layout.paths[k]: s for k, s in new_slots.items()})
            paths = {layout.paths[k]: s for k, s in new_slots.items()}
            # Copying the nodes down the slots' paths costs a few times what unflattening
            # does per node: worth it where the paths cross a small part of the tree (one
            # slot among 1000 leaves: 1.9 -> 1.4 ms a call), not where they cross most.
            if 4 * sum(map(len, paths)) <= len(leaves):
                copied = with_nodes(module, paths)
                if copied is not None:
                    return copied
            for k, x in new.items():
                a, b = layout.ranges[k]
                leaves[a:b] = x
            return jtu.tree_unflatten(treedef, leaves)

        signature = cls(treedef, statics, arg_treedef, arg_statics)
        return _Split(
            signature,
            arrays,
            slot_leaves,
            put,
            ready,
            owners,
            shared_leaves,
            first,
            len(layout.ranges),
            ready and every,
            module,
            structures,
        )

    @classmethod
    def _split_nested(cls, module: Any, args: tuple, kwargs: dict, donate: bool) -> _Split:
        """`split` for a module whose structure cannot be rebuilt from placeholders:
        slots found as nodes (slower: a Python test on every node)."""
        leaves, treedef = jtu.tree_flatten(module, is_leaf=_is_memo)
        arrays: list[Any] = []
        slot_leaves: list[list[Any]] = []
        owners: list[Memo | None] = []
        shared_leaves: list[frozenset[int]] = []
        first: list[int] = []
        structures: list[Any] = []
        seen: dict[int, int] = {}
        statics, memos, ready = [], [], True
        for i, x in enumerate(leaves):
            if _is_memo(x):
                ready = ready and _ready(x)
                if not x.allocated:
                    statics.append(x)
                    memos.append(i)
                    continue
                if id(x) not in seen:
                    one_slot, slot_treedef = jtu.tree_flatten(x)
                    held = None
                    if donate:
                        held = shared(one_slot, references(one_slot), 0, len(one_slot))
                    seen[id(x)] = len(slot_leaves)
                    slot_leaves.append(one_slot)
                    owners.append(x if held is not None else None)
                    shared_leaves.append(held or NOBODY)
                    first.append(len(memos))
                    structures.append(slot_treedef)
                statics.append(_Slot(jtu.tree_structure(x), seen[id(x)]))
                memos.append(i)
            elif isinstance(x, ARRAY_TYPES):
                arrays.append(x)
                statics.append(ARRAY)
            else:
                statics.append(x)
        arg_statics, arg_treedef = cls._arguments(args, kwargs, arrays)

        def put(new_slots: dict[int, Memo]) -> Any:
            for k, slot in new_slots.items():
                leaves[memos[k]] = slot
            return jtu.tree_unflatten(treedef, leaves)

        signature = cls(treedef, tuple(statics), arg_treedef, arg_statics)
        return _Split(
            signature,
            arrays,
            slot_leaves,
            put,
            ready,
            owners,
            shared_leaves,
            first,
            len(memos),
            False,
            module,
            structures,
        )

    @staticmethod
    def _arguments(args: tuple, kwargs: dict, arrays: list[Any]) -> tuple[tuple, Any]:
        arg_leaves, arg_treedef = jtu.tree_flatten((args, kwargs))
        return hashable_partition(arg_leaves, arrays), arg_treedef

    def rebuild(self, arrays: list[Any], slot_leaves: list[list[Any]]) -> tuple[Any, tuple, dict]:
        arrays_ = iter(arrays)
        rebuilt: dict[int, Any] = {}
        leaves = []
        for x in self.module_leaves:
            if x is ARRAY:
                leaves.append(next(arrays_))
            elif isinstance(x, _SlotLeaf):
                leaves.append(slot_leaves[x.index][x.j])
            elif isinstance(x, _Slot):
                if x.index not in rebuilt:
                    rebuilt[x.index] = jtu.tree_unflatten(x.treedef, slot_leaves[x.index])
                leaves.append(rebuilt[x.index])
            else:
                leaves.append(x)
        arg_leaves = hashable_combine(self.argument_leaves, arrays_)
        args, kwargs = jtu.tree_unflatten(self.arguments, arg_leaves)
        return jtu.tree_unflatten(self.module, leaves), args, kwargs


class Signatures:
    """The signature a wrapper's last call had, passed again where a call's is provably
    the same (`jax.jit` then finds its program by identity, where comparing a new one
    computes its tokens): the same tree structures, every non-array leaf the same
    object, and, where `==` is not exact on the structures' node data, the same node
    data: against the module the last call was given or returned (`_key.same_nodes`: a
    threaded loop passes the returned one, which shares all but a few nodes), else node
    by node in the tree structures (`_key.same_structures`: the arguments, such as an
    optimizer state, are new objects at every call). Anything else gives the new
    signature, which `jax.jit` compares exactly."""

    def __init__(self) -> None:
        self._last: tuple[Signature, tuple[Any, ...]] | None = None

    def same(self, signature: Signature, module: Any) -> Signature:
        last = self._last  # (one read: another thread may replace it)
        if last is not None and _provably_same(last[0], signature, module, last[1]):
            signature = last[0]
        self._last = (signature, _refs(module))
        return signature

    def returned(self, signature: Signature, module: Any) -> None:
        """The call of `signature` returned `module` (a threaded loop's next input)."""
        last = self._last
        if last is not None and last[0] is signature:
            self._last = (signature, (*last[1], *_refs(module)))


def _refs(module: Any) -> tuple[Any, ...]:
    try:
        return (weakref.ref(module),)
    except TypeError:  # (a tuple or a dict of modules)
        return ()


def _provably_same(last: Signature, new: Signature, module: Any, refs: tuple[Any, ...]) -> bool:
    if not (
        _same_objects(last.module_leaves, new.module_leaves)
        and _same_objects(last.argument_leaves, new.argument_leaves)
        and last.module == new.module
        and last.arguments == new.arguments
    ):
        return False
    if not last.exact_arguments and not same_structures(new.arguments, last.argument_data):
        return False
    if last.exact_modules:
        return True
    for ref in refs:
        old = ref()
        if old is not None and same_nodes(module, old):
            return True
    return same_structures(new.module, last.module_data)


def _same_objects(one: tuple[Any, ...], other: tuple[Any, ...]) -> bool:
    """Whether two tuples hold the same objects, position by position."""
    return one is other or (len(one) == len(other) and all(map(operator.is_, one, other)))


def _is_marker(x: Any) -> bool:
    return x is ARRAY or type(x) is _SlotLeaf or type(x) is _Slot


_LOOSE = ("\x00loose",)  # `Signature.exact` where a part has no exact token


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Marks an allocated slot, passed as its leaves: the `index`-th list of slot leaves
    (for `Signature._split_nested`)."""

    treedef: Any
    index: int


def _starts(first: int, slot_leaves: list[list[Any]]) -> dict[int, int]:
    """The position of each slot's first leaf among a call's flat inputs (its arrays,
    then the slots' leaves), to the slot's index."""
    starts = {}
    for i, leaves in enumerate(slot_leaves):
        starts[first] = i
        first += len(leaves)
    return starts


def refilled(n_arrays: int, hits: tuple, slot_leaves: list, kept: list) -> list:
    """The slots' leaves with the entries of the slots whose hits were decided on the host
    (passed apart, in `kept`) put back."""
    if not hits:
        return slot_leaves
    out = list(slot_leaves)
    starts = _starts(n_arrays, slot_leaves)
    for h, entries in zip(hits, kept):
        i = starts[h.entries[0]]
        leaves = out[i] = list(out[i])
        for j, x in zip(h.within, entries):
            leaves[j] = x
    return out
