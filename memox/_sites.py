"""Where the slots of a pytree are: every `Memo` found by its path (`slots`), with the
module that owns it and its field name (`slot_sites`, `SlotSite`), and the pytree with
some of them replaced (`replace_slots`), by slots or by values `memox.hoist` read ahead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax.tree_util as jtu
from jaxtyping import PyTree

from ._hoist import Hoisted
from ._slot import Memo, is_memo


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
            owner = child(owner, entry)
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
