"""The live state of a `memox.call`: which slots exist and what they hold right now.

`memox.call` opens a `Frame` over its module and makes it current (on the thread's one
per-call state stack, below). A cached method that runs while a frame is current looks
its slot up in that frame, reads the slot's latest state from the frame's store and
writes the updated state back. When `fn` returns, the store is written into a copy of
the module.

Lookup is by identity, and robust to the module being taken apart and rebuilt inside
`fn` (`eqx.tree_at`, `eqx.partition`/`eqx.combine`, `eqx.filter_grad`): an allocated
slot is found by its `key` array object, which every such rebuild passes through
untouched; an empty slot is found by the object that owns it. A slot not found is not
threaded through this call, and its method simply computes (correct, never cached).

memox opens frames of its own while it traces the miss branch of a cached method that
calls other cached methods: the inner slots are then threaded through that branch.

While `memox.scan` traces its loop body, `Pins` names the slots of the carry that the
body reads as loop constants (see `_scan.py`): a cached method on such a slot reads it
without a branch and leaves its entries untouched.

A frame is live on its own thread only. A cached method run where its thread has no
frame, on a module whose slot a frame on another thread holds right now (a worker
thread or a host callback that `fn` started), is found through the process-wide list of
the threads' stacks (`elsewhere`), and warns; a thread's own calls never look there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

import jax.numpy as jnp
import jax.tree_util as jtu

from . import _jax_internals
from ._errors import INNER_TRANSFORM
from ._fingerprint import array_fingerprint, known
from ._jax_internals import is_concrete_array
from ._sites import Path, SlotSite, path_name, replace_slots, slot_sites, slots
from ._slot import ENTRY_FIELDS, Memo
from ._storage import Spec
from ._table import entry, holding, passed_on


class Frame:
    """The slots of one pytree (at root path `prefix`) and their current states.

    **Lookup cannot misroute.** A slot is found where it is: by the object that owns it
    (each owner at one path, `separated`), or, for a module rebuilt inside `fn`
    (`eqx.tree_at`, `eqx.partition`/`eqx.combine`, `eqx.filter_grad` keep a slot's
    arrays), by its `key` array, which belongs to exactly one path of the frame: a
    `memox.call` gives every path its own slot arrays before `fn` runs (`separated`),
    and every write makes new ones. A slot found by neither is not this call's."""

    def __init__(
        self,
        tree: Any,
        prefix: Path = (),
        *,
        method: str | None = None,
        discover: bool = False,
        sites: list[SlotSite] | None = None,
    ):
        self.trace = _jax_internals.current()
        # The cached method whose miss branch this frame belongs to (None for a call's own).
        self.method = method
        # Set by `memox.init`: cached methods allocate their slots and compute, no more.
        self.discover = discover
        self.store: dict[Path, Memo] = {}
        self._by_key: dict[int, Path] = {}
        self._by_owner: dict[int, Path] = {}
        # Objects whose ids are indexed stay alive as long as the frame, so that no id
        # is reused by another object while the frame can still be asked about it.
        self._alive: list[Any] = []
        for site in slot_sites(tree) if sites is None else sites:
            path = prefix + site.path
            self.store[path] = site.slot
            self.index(path, site.slot)
            if site.field is not None:
                self._by_owner[id(site.owner)] = path[:-1]
                self._alive.append(site.owner)
        # The slots the frame was opened with, by path (what a call then changed).
        self.given = dict(self.store)

    def index(self, path: Path, slot: Memo) -> None:
        """Find `slot` at `path` (by its key array: `find`)."""
        if slot.allocated:
            self._by_key[id(slot.key)] = path
            self._alive.append(slot.key)

    def find(self, owner: Any, field: str) -> Path | None:
        """The path of `owner.<field>` if that slot is threaded through this frame."""
        prefix = self._by_owner.get(id(owner))
        if prefix is not None:
            return (*prefix, jtu.GetAttrKey(field))
        slot = getattr(owner, field, None)
        if isinstance(slot, Memo) and slot.allocated:
            path = self._by_key.get(id(slot.key))
            if path is not None and path[-1].name == field:
                return path
        return None

    def write(self, path: Path, slot: Memo, method: str) -> None:
        """Store `slot` as the state of `path`, refusing tracers of an inner transform.

        A value that a transformation merely passed through (unbatched under `vmap`, with
        a zero tangent under `jvp`) is lowered to the level it really belongs to first.
        """
        slot = jtu.tree_map(_jax_internals.lowered, slot)
        for x in jtu.tree_leaves(slot):
            if not _jax_internals.visible_at(x, self.trace):
                raise ValueError(INNER_TRANSFORM.format(method=method, slot=path_name(path)))
        self.store[path] = slot
        self.index(path, slot)

    def fingerprint(self, x: Any) -> Any:
        """The fingerprint of array `x`: by identity if it has a value (hashed once per
        array object); for an input of a `memox.jit` or `memox.filter_jit` being traced,
        the one computed outside where valid (a `Precomputed` entry of the stack: the trace
        scope of a compiled wrapper, `_prehash.Scope`); else hashed in-graph."""
        if is_concrete_array(x):
            return known(x)
        for scope in innermost(Precomputed, n=-1):
            pre = scope.lookup(x)
            if pre is not None:
                return pre
        return array_fingerprint(x)


def separated(tree: Any, sites: list[SlotSite] | None = None) -> tuple[Any, list[SlotSite]]:
    """`tree` where no two paths share a slot's arrays or an owning module object, and
    its slot sites. Two paths share them when a module was built from another one
    (`eqx.tree_at(lambda m: m.w, template, w)` keeps the template's slot) or one module
    object sits at two paths; each such path after the first gets its own copy of the
    slot's `key` array (what lookup goes by; a few words), and rebuilding the tree gives
    every path its own owner object. Otherwise `tree` itself. `sites`: `tree`'s slot
    sites, where known."""
    sites = list(slot_sites(tree)) if sites is None else sites
    seen_keys: set[int] = set()
    seen_owners: set[int] = set()
    copies: dict[Path, Memo] = {}
    shared_owner = False
    for site in sites:
        if site.field is not None:
            shared_owner |= id(site.owner) in seen_owners
            seen_owners.add(id(site.owner))
        if site.slot.allocated:
            if id(site.slot.key) in seen_keys:
                copies[site.path] = dataclasses.replace(site.slot, key=jnp.copy(site.slot.key))
            seen_keys.add(id(site.slot.key))
    if not copies and not shared_owner:
        return tree, sites
    tree = replace_slots(tree, copies, rebuild=True)
    return tree, list(slot_sites(tree))


class Pins:
    """The slots of a `memox.scan` carry (by path) that the loop reads as loop constants,
    and the cached calls on them while one trace of the body runs (see `_scan.py`).

    Each trace of the body has its own, in one of three modes:

    - `"probe"`: a cached call on a pinned slot is claimed and reads the table abstractly
      (entry 0: the probe is traced for shapes and verdicts only).
    - `"first"`: the first step, outside the loop, computes as `lax.scan`'s first step
      (nothing is claimed, unless an enclosing `memox.scan` loop claims it) and records,
      per pinned slot, the value its first call returned and the entry that now holds
      it (`reads`): what every later step reads.
    - `"loop"`: a claimed call returns the value recorded in the first step, a value of
      the enclosing trace that the loop body closes over: a loop constant by
      construction, whatever JAX's partial evaluation hoists. It touches the recorded
      entry, so hit counters and ages advance as in `lax.scan`.

    A pin holds when, over the whole body, every call on the slot ran directly in the
    body (so in every step: not in a branch, a loop or a nested transformation), under
    a policy that decides from what the method reads alone (no `max_age`), with the
    same keyed inputs each time, and with everything it reads loop-invariant: a carry
    leaf the body passes through unchanged, or a value from outside the loop. The
    slot's entries must come out of the body as the very arrays that went in. Then the
    value the method returned in the first step is the value of every later step.
    """

    def __init__(
        self,
        carry: Any,
        allowed: frozenset[Path],
        outer: Any,
        mode: str = "probe",
        *,
        reads: dict[Path, tuple[Any, Any]] | None = None,
        enclosing: Pins | None = None,
    ):
        self.trace = _jax_internals.current()
        self.outer = outer
        self.mode = mode
        self.slots = {
            path: slot for path, slot in slots(carry).items() if path in allowed and slot.allocated
        }
        # A key array at two paths (a slot shared by two modules) is pinned at neither.
        by_key: dict[int, Path | None] = {}
        for path, slot in self.slots.items():
            by_key[id(slot.key)] = None if id(slot.key) in by_key else path
        self._by_key = {k: p for k, p in by_key.items() if p is not None}
        self.carry = jtu.tree_leaves(carry)
        self.calls: dict[Path, list[tuple[list[Any], list[Any]]]] = {}
        # Per pinned slot: the value the first step read and the index of its entry.
        self.reads: dict[Path, tuple[Any, Any]] = dict(reads or {})
        self.enclosing = enclosing
        self._unread: set[Path] = set()  # claimed in the loop, but not read in the first step

    def _path(self, slot: Memo) -> Path | None:
        return self._by_key.get(id(slot.key)) if slot.allocated else None

    def claim(self, slot: Memo, max_age: int | None, reads: list[Any], keyed: list[Any]) -> bool:
        """Whether a cached call on `slot` reads it as a loop constant (and record it).
        If so, the call's value and slot are `read(slot, spec)`."""
        if self.mode == "first":
            return self.enclosing is not None and self.enclosing.claim(slot, max_age, reads, keyed)
        path = self._path(slot)
        if path is None or max_age is not None or _jax_internals.current() is not self.trace:
            return False
        self.calls.setdefault(path, []).append((reads, keyed))
        return True

    def read(self, slot: Memo, spec: Spec) -> tuple[Any, Memo]:
        """The value of a claimed call on `slot` (holding values of `spec`), and the slot
        after it: entries passed on as the very arrays that came in, counters touched."""
        value, index = self._read(slot, spec)
        return value, passed_on(slot, index)

    def _read(self, slot: Memo, spec: Spec) -> tuple[Any, Any]:
        path = self._path(slot)
        if self.mode == "first":  # claimed by the enclosing loop: record what it read
            assert self.enclosing is not None
            value, index = self.enclosing._read(slot, spec)
            self._record(path, value, index)
            return value, index
        if self.mode == "loop":
            assert path is not None  # (claimed)
            if path in self.reads:
                return self.reads[path]
            self._unread.add(path)  # the pin fails; read something of the right type
        index = jnp.zeros((), jnp.int32)
        return entry(slot, index, spec), index

    def filled(self, slot: Memo, new: Memo, key: Any, value: Any) -> None:
        """Told of a cached call on `slot` that was not claimed: it returned `value` and
        left `new`, where the entry holding `key` holds it. In the first step, the first
        such call on a pinned slot is what the loop will read."""
        if self.mode != "first":
            return
        if self.enclosing is not None:
            self.enclosing.filled(slot, new, key, value)
        path = self._path(slot)
        if path is not None and path not in self.reads:
            self._record(path, value, holding(new, key))

    def _record(self, path: Path | None, value: Any, index: Any) -> None:
        # Only a call made directly in the body runs in every step.
        if path is not None and _jax_internals.current() is self.trace:
            self.reads.setdefault(path, (value, index))

    def holding(self, carry_out: Any) -> tuple[frozenset[Path], frozenset[Path]]:
        """The pins that held in a body returning `carry_out`, and those that did not.

        Forgets the traced values it recorded (they must not outlive the trace)."""
        out = jtu.tree_leaves(carry_out)
        passed = {id(a) for a, b in zip(self.carry, out) if a is b}
        slots_out = slots(carry_out)

        def invariant(x: Any) -> bool:
            return id(x) in passed or _jax_internals.visible_at(x, self.outer)

        def holds(path: Path, calls: list[tuple[list[Any], list[Any]]]) -> bool:
            slot, after = self.slots[path], slots_out.get(path)
            same_keys = all(
                len(k) == len(calls[0][1]) and all(map(operator.is_, k, calls[0][1]))
                for _, k in calls
            )
            return (
                path not in self._unread
                and isinstance(after, Memo)
                and all(getattr(slot, f) is getattr(after, f) for f in ENTRY_FIELDS)
                and same_keys
                and all(invariant(x) for reads, _ in calls for x in reads)
            )

        verdicts = {path: holds(path, calls) for path, calls in self.calls.items()}
        self.calls.clear()
        self.carry = []
        self.reads = {}
        held = frozenset(p for p, ok in verdicts.items() if ok)
        return held, frozenset(verdicts) - held


class Plain:
    """Current while memox traces or differentiates a method on its own: nested cached
    methods compute without touching any slot. Records whether any was reached."""

    def __init__(self) -> None:
        self.nested = False


# -- the per-call state stack ----------------------------------------------------------
#
# One stack per thread holds every piece of per-call state, innermost last: the frames
# of calls and of nested methods' miss branches, `Plain`s, `memox.scan`'s pins, the
# ledgers of calls (`_ledger.py`) and the trace scopes of compiled wrappers
# (`_prehash.Scope`). Each thread's stack is also listed process-wide
# (weakly), so that a cached method run on a thread with no frame can tell whether its
# slot is live in a call running on another thread right now (`elsewhere`).


class Precomputed:
    """An entry of the stack that knows fingerprints computed outside the trace (a
    compiled wrapper's trace scope, `_prehash.Scope`): `lookup(x)` gives the fingerprint
    of tracer `x`, or None."""

    def lookup(self, x: Any) -> Any | None:
        raise NotImplementedError


class _Stack(list):
    """One thread's per-call state, innermost last."""

    __slots__ = ("__weakref__",)


_local = threading.local()
_lock = threading.Lock()  # around the replacement of `_stacks`
# Every thread's stack, weakly (a thread's goes when the thread ends). Replaced, never
# changed in place, so it is read without the lock.
_stacks: tuple[weakref.ref[_Stack], ...] = ()


def _stack() -> _Stack:
    stack = getattr(_local, "stack", None)
    if stack is None:
        global _stacks
        stack = _local.stack = _Stack()
        with _lock:
            _stacks = (*(r for r in _stacks if r() is not None), weakref.ref(stack))
    return stack


def top() -> Frame | Plain | None:
    """The innermost frame (or `Plain`) on this thread, if any."""
    for item in reversed(getattr(_local, "stack", ())):
        if isinstance(item, (Frame, Plain)):
            return item
    return None


_E = TypeVar("_E")


def innermost(kind: type[_E], n: int = 1) -> list[_E]:
    """The `n` innermost entries of type `kind` on this thread (all of them where `n` is
    negative), innermost first."""
    found: list[_E] = []
    for item in reversed(getattr(_local, "stack", ())):
        if isinstance(item, kind):
            found.append(item)
            if len(found) == n:
                break
    return found


@contextlib.contextmanager
def active(entry: _E) -> Iterator[_E]:
    """Make `entry` (a frame, a `Plain`, a ledger) the innermost of its kind on this
    thread while the block runs."""
    stack = _stack()
    stack.append(entry)
    try:
        yield entry
    finally:
        popped = stack.pop()
        assert popped is entry


def pins() -> Pins | None:
    """The pins of the `memox.scan` body being traced right now, if any."""
    found = innermost(Pins)
    return found[0] if found else None


def pinning(new: Pins) -> contextlib.AbstractContextManager[Pins]:
    """`new` current while the block runs (the body of a `memox.scan` being traced)."""
    return active(new)


def elsewhere(owner: Any, field: str) -> bool:
    """Whether `owner.<field>` is a slot threaded through a frame active right now on
    another thread (a cached method run on a worker thread or in a host callback that
    `fn` started, where this thread has no frame)."""
    mine = getattr(_local, "stack", None)
    for ref in _stacks:
        stack = ref()
        if stack is None or stack is mine or not stack:
            continue
        for item in tuple(stack):  # (a copy: that thread may push or pop meanwhile)
            if isinstance(item, Frame) and item.find(owner, field) is not None:
                return True
    return False
