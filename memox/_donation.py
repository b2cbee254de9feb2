"""Who holds a slot's arrays: where `memox.jit` may donate them, and what the slot's
node holds after.

**Nothing the caller holds loses its arrays.** `memox.jit` donates the slots, so that a
hit, whose table passes through unchanged, copies nothing and a miss writes its entry in
place. A donated array is deleted, so the rule is: a slot's arrays are donated only
where the slot (the `Memo` node in the module passed in) is the one object that holds
them (`shared`), and after the call that node is given the returned slot's arrays
(`hand_over`). The entries of a hit decided on the host are passed apart, not donated:
whoever else holds them (a module the caller kept, which a hit's entries reach at every
later call) costs no copy. Every object that reaches the module passed in (an early-stopping
`best = model`, the caller's own variable) therefore still holds readable arrays: the
slot as the call left it (valid by the key rule, so a later call on it hits where its
parameters match), and its parameters never crossed the boundary. Where anything else
holds a slot's arrays too (a list of leaves, a copy of the module made by a tree
operation, the node of an older module given the same arrays), the call donates a copy
of them instead: one copy of the table. Who holds an array is read from its reference
count (as NumPy elides temporaries): exact in CPython, calibrated once, and only ever
wrong towards copying. In the threaded loop (`out, model = step(model, x)`) the module
returned is the one passed in, its nodes given the returned slots (or, where a new
module was built, the old one is gone by the next call), so every hit copies nothing;
a module kept as another object costs one copy at the next call.

**Threads.** Reference counts say who holds an array at one moment; another thread may
flatten the same module a moment later, and pass arrays that this call then deletes.
So a donating call reads the counts, dispatches and hands over under one lock
(`exclusive`): a thread that shares the module finds, once the lock is free, the node
as the call left it, with live arrays. One thread alone takes a free lock (~0.1 us).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ._jax_internals import is_concrete_array
from ._slot import Memo


def references(leaves: list) -> list[int]:
    """`sys.getrefcount` of each of `leaves`, in one pass, counted the same way wherever
    it is called from (compared with `_HELD_ONCE` only, which this same function
    measured). Taken right after a flatten, before anything else holds the leaves."""
    return list(map(sys.getrefcount, leaves))


def _calibrated() -> int:
    """`references` of an object held by one list and by one other object: a slot's
    array held by its `Memo` node and by the list of leaves flattened from it."""
    probe = object()
    node, leaves = [probe], [probe]
    del probe
    (found,) = references(leaves)
    del node
    return found


_HELD_ONCE = _calibrated()
NOBODY: frozenset[int] = frozenset()


def shared(leaves: list, counts: list[int], a: int, b: int) -> frozenset[int] | None:
    """Which of the concrete arrays `leaves[a:b]` (one slot's) something holds besides
    `leaves` and the node they were flattened from, by position in the slot (`NOBODY`:
    the node alone holds them), from their `references` (`counts`, of every leaf); None
    where they are traced (a slot is concrete or traced as a whole), never donated."""
    if not is_concrete_array(leaves[a]):
        return None
    mine = counts[a:b]
    if mine.count(_HELD_ONCE) == len(mine):
        return NOBODY
    return frozenset([j for j, n in enumerate(mine) if n != _HELD_ONCE])


class Holders:
    """The `Memo` node that held each slot's arrays at the last call, per slot position
    of one layout (weakly): found again with no walk down the slot's path. A node found
    there is the module's own where `shared` says `NOBODY` (each of the slot's arrays is
    held by the list of leaves and by one object alone, the node it was flattened from)
    and that node holds the slot's first array: then it is that one object."""

    def __init__(self, n: int):
        self._refs: list[weakref.ref | None] = [None] * n

    def node(self, module: Any, k: int, value: Any, held: frozenset[int], walk: Callable) -> Any:
        """The node of slot `k` of `module`, whose first leaf is `value` (`walk(module,
        k)` follows its path where the last node cannot be proven it); None where the
        path does not lead to a `Memo` holding `value`."""
        if held is NOBODY:
            ref = self._refs[k]
            node = None if ref is None else ref()
            if node is not None and object.__getattribute__(node, "value") is value:
                return node
        node = walk(module, k)
        if not isinstance(node, Memo) or object.__getattribute__(node, "value") is not value:
            return None
        self._refs[k] = weakref.ref(node)
        return node


_LOCK = threading.RLock()  # (reentrant: a donating call may be traced inside another)


def exclusive(donating: bool) -> contextlib.AbstractContextManager:
    """Held from taking a call apart to handing over its donated slots, where it donates:
    no other thread flattens a slot's arrays in between (see the module docstring)."""
    return _LOCK if donating else contextlib.nullcontext()


_SLOT_FIELDS = tuple(field.name for field in dataclasses.fields(Memo))


def hand_over(node: Memo, new: Memo | Any) -> None:
    """Give `node`, whose arrays were donated, the arrays of the slot returned in their
    place: every object reaching it (a module the caller kept) reads the slot as the
    call left it. (A slot is an immutable pytree node to everything else; this is the
    one place memox sets its fields, and only on arrays it has just consumed.) A hit
    decided on the host donates its counters alone: `new` is then the counters' array,
    and the node keeps its entries, the very arrays the call read."""
    target = object.__getattribute__(node, "__dict__")  # (`eqx.Module`'s own is slower)
    if not isinstance(new, Memo):
        target["counts"] = new
        return
    given = object.__getattribute__(new, "__dict__")
    for name in _SLOT_FIELDS:
        target[name] = given[name]
