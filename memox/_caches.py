"""memox's process-wide caches, in one registry: each bounded, all cleared by
`memox.clear_caches()`.

Every cache here remembers a pure function of its key: the plan of a method on a static
key, a static key per tree skeleton, the token of a function or class, the layout of a
tree structure, the fingerprint of an immutable array, the value an entry of an
immutable value table holds. Dropping an entry therefore costs only its recomputation (a
miss, a plan traced again), never a wrong value. A `Cache` holds at most `max_size`
entries and starts afresh when full, so a long-running process that makes ever new
models (classes defined in a function, methods of fresh closures) holds at most the sum
of the bounds. Tables that hold their keys weakly (fingerprints by array identity,
`ByIdentity`) register their own `clear`; they shrink by themselves as their keys are
collected.

What is not here is state, not a cache: the per-thread stacks of the call being run
(`_context`, `_ledger`, `_prehash`), the arrays `memox.filter_jit` handed back (it
guards them against donation), and each wrapper's own record of decided hits (bounded per
wrapper, `_decided.Hits`, and gone with the wrapper).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, runtime_checkable

import jax.tree_util as jtu

from ._jax_internals import is_concrete_array


class Cache(dict):
    """A `dict` of at most `max_size` entries, registered under `name`: `put` clears it
    when full (what is dropped is recomputed on its next use). Reads are a plain `dict`'s
    (`get`, `in`, `[]`)."""

    __slots__ = ("max_size", "name")

    def __init__(self, name: str, max_size: int) -> None:
        super().__init__()
        self.name, self.max_size = name, max_size
        register(name, self)

    def put(self, key: Any, value: Any) -> Any:
        """Store `value` under `key` and return it."""
        if len(self) >= self.max_size:
            self.clear()
        self[key] = value
        return value


class ByIdentity:
    """Values by the identity of their key, held weakly: the one put last for each key,
    while the key lives and none of the value's arrays was deleted since (donated).
    Registered under `name` where process-wide (a wrapper's own table is not)."""

    def __init__(self, name: str | None = None) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}
        if name is not None:
            register(name, self._entries)

    def get(self, key: Any) -> Any | None:
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            return None
        value = entry[1]
        for x in jtu.tree_leaves(value):
            if is_concrete_array(x) and x.is_deleted():
                return None
        return value

    def put(self, key: Any, value: Any) -> None:
        try:
            ref = weakref.ref(key, lambda _, k=id(key): self._entries.pop(k, None))
        except TypeError:  # not weakly referenceable (a tuple): not kept
            return
        self._entries[id(key)] = (ref, value)


@runtime_checkable
class Table(Protocol):
    def clear(self) -> None: ...
    def __len__(self) -> int: ...


_REGISTRY: dict[str, Table] = {}


def register(name: str, table: Table) -> None:
    """Register `table` under `name`: a `Cache`, or a table that holds its keys weakly
    (its entries go as their keys are collected)."""
    if name in _REGISTRY:
        raise RuntimeError(f"memox: two caches named {name!r}")
    _REGISTRY[name] = table


def sizes() -> dict[str, int]:
    """The number of entries of every registered cache, by name."""
    return {name: len(table) for name, table in _REGISTRY.items()}


def clear_caches() -> None:
    """Clear memox's internal caches (plans of cached methods, static keys, tokens,
    tree layouts, fingerprints of arrays), as `eqx.clear_caches` does Equinox's.

    Nothing cached in your modules is touched: a slot keeps its value, and its next read
    hits. What memox recomputes after a clear is its own bookkeeping: a method is planned
    again at its next call (its jaxpr traced once more), and an array's fingerprint is
    hashed again. One exception: a key holding a part memox can only number in this
    process (an object compared by identity or by its own `__eq__`, such as a method
    closing over a non-canonical object; see "What a cache key covers" in the docs) gets
    a new number, so that slot recomputes once, then hits again.

    Best used before `jax.clear_caches()`, which releases JAX's compiled programs
    (memox's wrappers then compile at their next call). Call it between calls, not while
    another thread runs one.

    **Arguments:**

    None.

    **Returns:**

    None.

    !!! Example

        ```python
        memox.clear_caches()
        jax.clear_caches()
        ```
    """
    for table in _REGISTRY.values():
        table.clear()
