"""Hits decided on the host: a compiled wrapper that knows, before it dispatches a
call, that a slot's check will hit, runs a program that takes the slot's value as it is,
with no check (`Hits`).

Inside the trace, `Claims` (held by `_prehash.Scope`, the trace's context) records the
cached calls the host may decide and what each left; after the call, `Hits.learn`
records the slots it can vouch for, and `Hits.decide` finds them in the next call.
Shared by `memox.jit` and `memox.filter_jit`."""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.tree_util as jtu

from . import _jax_internals
from ._fingerprint import across_processes
from ._jax_internals import is_concrete_array
from ._key import StaticKey, same
from ._slot import Memo
from ._storage import Spec
from ._table import entry_leaves, read_entry


class _Record(NamedTuple):
    """A fact about immutable objects, so true for every thread: the slot whose entries
    are the arrays at the input positions `held.entries` holds, in entry `index`, the
    value for the arrays at `held.reads`, in a call of static signature `signature`
    under JAX's configuration `context` (see `Hits`); `value` reads that value once,
    when a call first decides the hit. `arrays` pairs each of those positions (the
    entries', then the reads') with the array seen there, held weakly."""

    signature: Any
    context: Any
    held: Held
    arrays: tuple[tuple[int, weakref.ref], ...]
    index: Any  # on the device
    value: _Value
    variants: set  # the hit sets compiled for `signature` (shared by its records)

    def holds(self, inputs: Sequence[Any]) -> bool:
        """Whether `inputs` hold this record's arrays, the entries not deleted (donated
        elsewhere: the call revives the slot, and warns)."""
        n = len(inputs)
        for i, ref in self.arrays:
            if i >= n or ref() is not inputs[i]:
                return False
        for i in self.held.entries:
            if inputs[i].is_deleted():
                return False
        return True


class _Value:
    """The value that entry `index` of a value table holds, decoded on the first `get`
    and kept: what a program of a decided hit takes in place of the table (no copy of
    the bits into the value's type on every call). The table is held weakly (a slot is
    donated only where nothing else holds its arrays); `get` is called once a call has
    passed it, so it is alive. A value donated since (`memox.filter_jit(donate="all")`
    donates every input) is decoded again. Threads reading at once decode the same
    immutable arrays, each to a value equal to the other's (the value and its leaves
    are replaced as one pair)."""

    def __init__(self, table: Any, index: Any, spec: Spec, value: Any = None):
        self._table, self._index, self._spec = weakref.ref(table), index, spec
        self._known = None if value is None else self._knowing(value)

    def _knowing(self, value: Any) -> tuple[Any, list[Any], Decided]:
        return value, jtu.tree_leaves(value), Decided(self._index, value)

    def get(self) -> Decided:
        """The entry's index and value, as a program of a decided hit takes them."""
        known = self._known  # (one read: another thread may replace it)
        if known is None or any(map(_IS_DELETED, known[1])):
            table = self._table()
            assert table is not None  # (a call passed it)
            known = self._known = self._knowing(read_entry(table, self._index, self._spec))
        return known[2]


_IS_DELETED = operator.methodcaller("is_deleted")


# At most this many programs per signature specialised on hits decided on the host (the
# program with none decided is one of them): a loop reaches one or two (the first call,
# then the steady state; one more after a slowly changing part moves).
MAX_VARIANTS = 4


class Hits:
    """Hits a compiled wrapper decides on the host, before it dispatches a call.

    After a call whose trace claimed a slot (`Claims`, through `_prehash.Scope`: every call on
    it made directly in the wrapped function, deciding from inputs of the wrapper alone,
    the slot it left reaching the outputs), the slot it returned holds the value for the
    arrays the decision read, whatever the in-graph check decided: a miss stored it, a
    hit found it. So where the next call gets that very slot (its entry arrays, by
    identity) and those very arrays (immutable, by identity), in a call that `jax.jit`
    would key alike (the same signature, under the same JAX configuration: the trace
    context, x64, the PRNG flags, ...), its check is a hit, known before dispatch. The
    wrapper then dispatches a program specialised on that: the slot's value is read from
    the entry recorded, with no fingerprint, lookup or branch (`_memo.py`), and taken as
    an input in its own type (decoded from the table once per record, `_Value`: the
    program then reads no bits, as a hand-hoisted step takes the value as it is); what a
    hit leaves unchanged (its entries: `entry_leaves`) passes through (not
    donated, not copied: the caller's arrays are given back), so the next call finds
    them again, and so does the index of the entry (not returned: an output would copy
    it). The program writes only the counters a hit moves. Anything else (a new batch,
    an updated parameter, a slot loaded from disk, a `memox.clear`) is a new object and
    is checked in-graph.

    The hit set is a static argument of the compiled function: at most `MAX_VARIANTS`
    programs per signature (past that, calls with a new set run the program with none
    decided). Across processes nothing is decided on the host (`across_processes`)."""

    def __init__(self) -> None:
        # The records, and the hit set of all of them (the loop's steady state: one object,
        # its hash computed once), replaced as one pair.
        self._records: tuple[tuple[_Record, ...], HitSet] = ((), HitSet())
        self._variants: dict[Any, set] = {}

    def decide(self, signature: Any, inputs: Sequence[Any]) -> tuple[tuple, list[Any]]:
        """The hits known for a call of `signature` on `inputs` (each slot's `Held`, in
        the order of its entries' positions; a static argument), and for each one the
        index of its entry and the value that entry holds (device arrays: `Decided`)."""
        records, every = self._records  # one snapshot (another thread may replace it whole)
        if not records:
            return (), []
        found, compared, alike = [], None, False
        context = _jax_internals.jit_context()
        for record in records:
            if record.signature is not compared:
                compared = record.signature
                alike = same((compared, record.context), (signature, context))
            if alike and record.holds(inputs):
                found.append(record)
        if not found:
            return (), []
        hits = every if len(found) == len(records) else HitSet(r.held for r in found)
        variants = records[0].variants
        if hits not in variants:
            if len(variants) >= MAX_VARIANTS - 1 or across_processes(inputs):
                return (), []
            variants.add(hits)
        return hits, [record.value.get() for record in found]

    def learn(
        self,
        signature: Any,
        held: Sequence[tuple[Held, Any, Any]],
        inputs: Sequence[Any],
        decided: tuple[tuple, list[Any]],
        entries_of: Callable[[Any], Sequence[Any]] = tuple,
    ) -> None:
        """After a call of `signature` on `inputs`, with the hits `decided` before it (as
        `decide` gave them): the slots it vouched for, each with what `entries_of` reads
        the entry arrays of the slot it returned from (by default, those arrays), and the
        index of the entry (`None`: the index of the hit decided, passed in, whose value
        is then known already)."""
        old, _ = self._records
        if len(held) == len(old) and all(index is None for _, _, index in held):
            # Every slot vouched for is a hit decided before the call (so on a record),
            # its entries passed through: the records would be made again as they are.
            return
        if not held:  # (nothing to record: no signature to hash on this call's path)
            self._records = ((), HitSet())
            return
        given = dict(zip(*decided))
        if old and same(old[0].signature, signature):
            variants = old[0].variants
        else:
            variants = self._variants.get(signature)
            if variants is None:
                if len(self._variants) >= 256:
                    self._variants.clear()
                variants = self._variants[signature] = set()
        records, context = [], _jax_internals.jit_context()
        for h, slot, index in sorted(held, key=lambda item: item[0].entries):
            entries = entries_of(slot)
            known = given.get(h) if index is None else None
            index = known.index if known is not None else index
            reads = [inputs[i] for i in h.reads]
            if not all(map(is_concrete_array, [*entries, *reads, index])):
                continue
            # (`known`: the table and index of a decided hit, whose value is read already)
            value = _Value(entries[0], index, h.spec, None if known is None else known.value)
            pairs = (*zip(h.entries, entries), *zip(h.reads, reads))
            arrays = tuple((i, weakref.ref(x)) for i, x in pairs)
            records.append(_Record(signature, context, h, arrays, index, value, variants))
        self._records = (tuple(records), HitSet(r.held for r in records))


class HitSet(tuple):
    """The hits decided for a call (each slot's `Held`, in the order of its entries'
    positions): a tuple whose hash is computed once, as `jax.jit` hashes it, a static
    argument, at every call. (No hit decided is the plain `()`: `jax.jit` keys a static
    argument by its type too, and the program with none decided is one program.)"""

    def __hash__(self) -> int:
        found = self.__dict__.get("_hash")
        if found is None:
            found = self.__dict__["_hash"] = tuple.__hash__(self)
        return found


class Decided(NamedTuple):
    """A hit decided on the host, as the compiled function takes it: the index of the
    entry read (for the counters a hit moves) and the value it holds."""

    index: Any
    value: Any


class Claims:
    """The cached calls one trace claimed (`_prehash.Scope.claim`), and the hits its
    wrapper decided on the host (`hits`: per slot, by its record's `Held`, the input
    tracers of its `Decided`)."""

    def __init__(self, hits: dict[Held, Decided]):
        self._hits = {h.entries: (h, decided) for h, decided in hits.items()}
        # Per slot claimed (its entries' positions): what each claimed call held, and the
        # slot and entry index the last one left.
        self._calls: dict[tuple[int, ...], list[Held]] = {}
        self.left: dict[tuple[int, ...], tuple[Memo, Any]] = {}

    def claim(
        self, entries: tuple[int, ...], reads: tuple[int, ...], spec: Spec, key: StaticKey
    ) -> Claim:
        """A call on the slot whose entries are inputs `entries`, deciding from `reads`,
        for a value of `spec`, under static key `key`. It reads the hit the host decided
        only where that hit's record was made under an equal `Held` (`_key.same`: the
        same static key, the same positions read)."""
        held = Held(entries, reads, spec, key)
        self._calls.setdefault(entries, []).append(held)
        found = self._hits.get(entries)
        decided = found[1] if found is not None and same(found[0], held) else None
        return Claim(self, entries, decided)

    def held(self, out: Sequence[Memo], keeps_indices: bool) -> list[tuple[Held, int, Any]]:
        """The claimed slots the host can vouch for after this call: every call on the
        slot was claimed with the same reads, and the slot the last one left is in `out`
        (the slots leaving the call) with the same entry arrays (nothing wrote it after).
        Per slot: what the host records, its place in `out`, and the index of the entry
        holding the value (a traced output of the wrapper; `None` where it is the index
        of a hit the host decided and the wrapper `keeps_indices` (does not donate them):
        an output would copy it)."""

        def ids(slot: Memo) -> tuple[int, ...]:  # (a slot written is a new object)
            return tuple(map(id, entry_leaves(slot)))

        where = {ids(slot): k for k, slot in enumerate(out) if slot.allocated}
        found = []
        for entries, calls in self._calls.items():
            left = self.left.get(entries)
            if left is None or len(set(calls)) != 1 or ids(left[0]) not in where:
                continue
            index, decided = left[1], self._hits.get(entries)
            if keeps_indices and decided is not None and index is decided[1].index:
                index = None
            found.append((calls[0], where[ids(left[0])], index))
        return found


class Claim:
    """A cached call the host can decide (`_prehash.Scope.claim`). `decided`: where the
    host decided a hit, the traced index of the entry and the value it holds, else None."""

    def __init__(self, claims: Claims, entries: tuple[int, ...], decided: Decided | None):
        self._claims, self._entries, self.decided = claims, entries, decided

    def left(self, slot: Memo, index: Any) -> None:
        """The call left `slot`, whose entry `index` holds its value."""
        self._claims.left[self._entries] = (slot, index)


@dataclasses.dataclass(frozen=True)
class Held:
    """A slot that holds, after a call, the value for what its decision read: the input
    positions of the slot's entry leaves and of what the decision reads, the type of the
    value (how to decode it), and the static key of the call (`_key.py`: the method,
    every array's type, every non-array part). With the arrays at `reads` by identity,
    it is the key of the call as the host sees it. A static argument of the program of
    a decided hit: a record's `Held` is part of `jax.jit`'s cache key, so the trace that
    compares it with its own calls' (`Claims.claim`) decides once per program."""

    entries: tuple[int, ...]
    reads: tuple[int, ...]
    spec: Spec
    key: StaticKey

    @functools.cached_property
    def within(self) -> tuple[int, ...]:
        """The positions of the entries among the slot's leaves (the value, its first
        leaf, at 0)."""
        return tuple(p - self.entries[0] for p in self.entries)

    def __hash__(self) -> int:
        # Hashed once: `jax.jit` hashes the hit set at every call.
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.entries, self.reads, self.spec, self.key))
            object.__setattr__(self, "_hash", found)
        return found
