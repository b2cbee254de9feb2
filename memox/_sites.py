"""Where the slots of a pytree are: every `Memo` found by its path (`slots`), with the
module that owns it and its field name (`slot_sites`, `SlotSite`), and the pytree with
some of them replaced (`replace_slots`), by slots or by values `memox.hoist` read ahead.

Where they lie is worked out once per tree structure (`layout`: the module rebuilt with
integers for leaves, walked with paths once), so that finding the slots of a pytree
costs one flatten of it and a walk down each slot's path, and replacing them a copy of
the nodes on their paths (`with_nodes`), else one flatten and one unflatten: no Python
test on every node at every call. A pytree whose nodes refuse integer leaves is walked
node by node.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._caches import Cache
from ._donation import Holders
from ._slot import Memo, is_empty, is_memo, is_value_table


if TYPE_CHECKING:
    from ._hoisted import Hoisted  # (a node `memox.hoist` puts in place of a slot)


Path = tuple[Any, ...]


def child(node: Any, entry: Any) -> Any:
    if isinstance(entry, jtu.GetAttrKey):
        return getattr(node, entry.name)
    if isinstance(entry, jtu.SequenceKey):
        return node[entry.idx]
    if isinstance(entry, jtu.DictKey):
        return node[entry.key]
    if isinstance(entry, jtu.FlattenedIndexKey):
        return jtu.tree_flatten(node, is_leaf=lambda x: x is not node)[0][entry.key]
    raise TypeError(f"memox cannot follow the pytree path entry {entry!r}.")


def follow(node: Any, path: Path) -> Any:
    """The node at `path` below `node`."""
    for entry in path:
        if isinstance(entry, jtu.GetAttrKey):  # a field (`eqx.Module`'s lookup is slower)
            node = object.__getattribute__(node, entry.name)
        else:
            node = child(node, entry)
    return node


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the slots are in a pytree of one tree structure, in flattening order: the
    range of leaves of each (`(-1, -1)` where it has none), its path, and the tree
    structure of the slot itself."""

    ranges: tuple[tuple[int, int], ...]
    paths: tuple[Path, ...]
    structures: tuple[Any, ...]
    index: dict[Path, int]  # path -> position in the fields above
    leaves: int  # how many leaves the pytree has
    # What callers derive from the layout alone, computed once per layout by each.
    derived: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def others(self) -> tuple[int, ...]:
        """The positions of the leaves outside every slot, in order."""
        inside = {i for a, b in self.ranges for i in range(a, b)}
        return tuple(i for i in range(self.leaves) if i not in inside)

    @functools.cached_property
    def holders(self) -> Holders:
        """The slot nodes found at each position at the last call (`_donation.Holders`)."""
        return Holders(len(self.ranges))

    def node(self, tree: Any, k: int) -> Any:
        """The `k`-th slot node of `tree` (None where its path cannot be followed)."""
        try:
            return follow(tree, self.paths[k])
        except Exception:
            return None


_layouts = Cache("layouts", 1024)  # PyTreeDef -> Layout | None
_UNKNOWN: Any = object()


def layout(treedef: Any) -> Layout | None:
    """The layout of a pytree of structure `treedef` (computed once per structure, by
    rebuilding the pytree with integers for leaves; None where its nodes refuse that)."""
    try:
        found: Layout | None = _layouts.get(treedef, _UNKNOWN)  # (one hash of `treedef`)
    except Exception:  # compared with an equal-hash structure whose static fields
        # cannot be compared (a NumPy array): walked
        return None
    if found is not _UNKNOWN:
        return found
    try:
        tree = jtu.tree_unflatten(treedef, range(treedef.num_leaves))
        ranges, paths, structures = [], [], []
        for path, x in jtu.tree_flatten_with_path(tree, is_leaf=is_memo)[0]:
            if is_memo(x):
                idx: list[int] = jtu.tree_leaves(x)
                ranges.append((idx[0], idx[-1] + 1) if idx else (-1, -1))
                paths.append(path)
                structures.append(jtu.tree_structure(x))
        index = {path: k for k, path in enumerate(paths)}
        found = Layout(tuple(ranges), tuple(paths), tuple(structures), index, treedef.num_leaves)
    except Exception:  # a node that checks its leaves: walked node by node
        found = None
    return _layouts.put(treedef, found)


@dataclasses.dataclass(frozen=True)
class SlotSite:
    """A slot found in a pytree: its path, the slot, the module that owns it, and the
    field name (None where the owner is not a module, such as a list).

    !!! Example

        ```python
        (site,) = memox.internal.slot_sites(foo)
        assert isinstance(site, memox.internal.SlotSite) and site.field == "b_cache"
        ```
    """

    path: jtu.KeyPath
    slot: Memo
    owner: Any
    field: str | None


def slots(tree: PyTree) -> dict[Path, Memo]:
    """Every `Memo` in `tree` by path, in flattening order."""
    items = jtu.tree_flatten_with_path(tree, is_leaf=is_memo)[0]
    return {path: leaf for path, leaf in items if is_memo(leaf)}


def slot_sites(tree: PyTree) -> Iterator[SlotSite]:
    """Every `Memo` in `tree`, with the object owning it: each as a `SlotSite` with
    `path`, `slot`, `owner` and `field`.

    !!! Example

        ```python
        (site,) = memox.internal.slot_sites(foo)
        assert (site.owner, site.field) == (foo, "b_cache")
        ```
    """
    found = layout(jtu.tree_structure(tree))
    located = None if found is None else _located(tree, found)
    if located is None:
        items = jtu.tree_flatten_with_path(tree, is_leaf=is_memo)[0]
        located = [
            (path, functools.reduce(child, path[:-1], tree), leaf)
            for path, leaf in items
            if is_memo(leaf)
        ]
    for path, owner, slot in located:
        last = path[-1] if path else None
        # (JAX types `GetAttrKey` as `Any`, so `isinstance` does not rule out `None`.)
        field = last.name if isinstance(last, jtu.GetAttrKey) else None  # pyright: ignore[reportOptionalMemberAccess]
        yield SlotSite(path, slot, owner if path else None, field)


def holds_empty(tree: PyTree, leaves: list[Any], treedef: Any) -> bool:
    """Whether `tree` (of leaves `leaves` and structure `treedef`) holds a slot still to
    allocate (`is_empty`). Where the layout is known, a slot's first leaf is its `value`,
    its first field, as `memox.jit` reads it (`_partition.Signature.split`): no walk, and
    the markers found in whatever container they came back."""
    found = layout(treedef)
    if found is None:
        return any(map(is_empty, slots(tree).values()))
    return any(a >= 0 and not is_value_table(leaves[a]) for a, _ in found.ranges)


def _located(tree: PyTree, found: Layout) -> list[tuple[Path, Any, Memo]] | None:
    """Each slot of `tree` (of layout `found`) with its owner, found down its path; None
    where a path cannot be followed to a `Memo` (a node whose keys name no attribute)."""
    located = []
    try:
        for path in found.paths:
            owner = follow(tree, path[:-1])
            slot = follow(owner, path[-1:])
            if not is_memo(slot):
                return None
            located.append((path, owner, slot))
    except Exception:
        return None
    return located


def replace_slots(
    tree: PyTree, new: Mapping[Path, Memo | Hoisted], *, rebuild: bool = False
) -> PyTree:
    """`tree` with the slots at the paths in `new` replaced (by slots, or by values read
    ahead by `memox.hoist`); with `rebuild`, a new tree (new node objects) even when
    `new` is empty."""
    if not new and not rebuild:
        return tree
    if not rebuild:
        copied = with_nodes(tree, new)
        if copied is not None:
            return copied
    leaves, treedef = jtu.tree_flatten(tree)
    found = layout(treedef)
    if found is not None and _spliced(leaves, found, new):
        return jtu.tree_unflatten(treedef, leaves)
    items, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_memo)
    leaves = [new.get(path, leaf) for path, leaf in items]
    return jtu.tree_unflatten(treedef, leaves)


def _spliced(leaves: list[Any], found: Layout, new: Mapping[Path, Memo | Hoisted]) -> bool:
    """Put the leaves of the slots in `new` into `leaves` (of a tree of layout `found`)
    where each has the structure of the slot it replaces; False, with `leaves` as they
    were, where one has not (a slot allocated or emptied, a value read ahead) or is no
    slot's path."""
    parts = []
    for path, slot in new.items():
        k = found.index.get(path)
        if k is None or not is_memo(slot):
            return False
        slot_leaves, structure = jtu.tree_flatten(slot)
        if structure != found.structures[k]:
            return False
        parts.append((found.ranges[k], slot_leaves))
    for (a, b), slot_leaves in parts:
        if a >= 0:
            leaves[a:b] = slot_leaves
    return True


class _Put:
    """A node to put at the end of a path (`with_nodes`)."""

    __slots__ = ("node",)

    def __init__(self, node: Any):
        self.node = node


def with_nodes(tree: Any, new: Mapping[Path, Any]) -> Any | None:
    """`tree` with the nodes at the paths in `new` replaced by its values, copying only the
    nodes on those paths, each once, as `jtu.tree_unflatten` builds them: every other
    node is the very object of `tree` (a model with one slot among 1000 leaves copies
    three nodes, not 500). None where a path passes through a node memox does not copy
    (only fields of an `eqx.Module`, items of a `tuple` or `list` and values of a `dict`
    are): the caller rebuilds the whole tree."""
    if () in new:
        return new[()] if len(new) == 1 else None
    trie: dict[Any, Any] = {}
    for path, node in new.items():
        level = trie
        for entry in path[:-1]:
            level = level.setdefault(entry, {})
            if not isinstance(level, dict):  # (a path through another's end)
                return None
        level[path[-1]] = _Put(node)
    return _copied(tree, trie)


def _copied(node: Any, trie: dict[Any, Any]) -> Any | None:
    """`node` with its children at the entries of `trie` replaced (`_Put`) or copied in
    turn (a nested trie)."""
    children = {}
    for entry, below in trie.items():
        if isinstance(below, _Put):
            children[entry] = below.node
            continue
        try:
            old = follow(node, (entry,))
        except Exception:
            return None
        copied = _copied(old, below)
        if copied is None:
            return None
        children[entry] = copied
    kind = type(node)
    if kind is tuple or kind is list:
        if not all(isinstance(e, jtu.SequenceKey) for e in children):
            return None
        items = list(node)
        for entry, child_ in children.items():
            items[entry.idx] = child_
        return kind(items)
    if kind is dict:
        if not all(isinstance(e, jtu.DictKey) for e in children):
            return None
        out = dict(node)
        for entry, child_ in children.items():
            out[entry.key] = child_
        return out
    if isinstance(node, eqx.Module):
        if not all(isinstance(e, jtu.GetAttrKey) for e in children):
            return None
        out = object.__new__(kind)
        fields = object.__getattribute__(node, "__dict__")
        target = object.__getattribute__(out, "__dict__")
        # What Equinox's unflatten sets: the fields, and a wrapper's `__module__`, ...
        target.update((k, v) for k, v in fields.items() if k in _unflattened(kind))
        for entry, child_ in children.items():
            target[entry.name] = child_
        return out
    return None


_UNFLATTENED = Cache("unflattened attributes", 4096)  # eqx.Module type -> names


def _unflattened(kind: type) -> frozenset[str]:
    """The attributes `jtu.tree_unflatten` sets on an `eqx.Module` of type `kind`: its
    fields, and the attributes of a wrapper (`eqx.module_update_wrapper`)."""
    found = _UNFLATTENED.get(kind)
    if found is None:
        names = {f.name for f in dataclasses.fields(kind)} | set(_WRAPPER_ATTRIBUTES)
        found = _UNFLATTENED.put(kind, frozenset(names))
    return found


# The attributes Equinox's flatten carries for a wrapper module
# (`equinox/_module/_flatten.py`, `WRAPPER_FIELD_NAMES`).
_WRAPPER_ATTRIBUTES = ("__module__", "__name__", "__qualname__", "__doc__", "__annotations__")


def path_name(path: Path) -> str:
    return jtu.keystr(path).lstrip(".")
