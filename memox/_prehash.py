"""Fingerprints computed outside a compiled function, for the checks inside it.

Inside a trace a dependency is a tracer, and checking a cached value means hashing the
dependency's bytes in-graph on every call. When the tracer is an *input* of the compiled
function and the caller passed the same concrete array as last time, that work is
wasted: a `jax.Array` is immutable, so its fingerprint is the one computed for that
object before (`_fingerprint.known`, by identity). `memox.jit` and `memox.filter_jit`
therefore compute, per call and outside the compiled code, the fingerprints of the input
arrays that cached methods fingerprinted in an earlier trace (their dependencies and
keyed arguments), and pass them in as one small table, with a flag per row saying
whether the row holds a fingerprint for this call's array.

This module is that mechanism, in one place for both wrappers:

- outside, `Inputs` learns which input positions are dependencies and builds the
  table for a call (`Inputs.table`): a row is valid only for the very object seen at
  that position in the previous call (an array that changes every call, such as a new
  batch, is left to the in-graph hash: hashing it outside would wait for it);
- inside, `scope(inputs, table)` makes the table current for the trace (an entry of the
  per-call stack, `_context.py`): `Frame.fingerprint` asks its `lookup(x)`, which for an
  input tracer returns `lax.cond(valid, row, hash)`: the in-graph hash stays in the
  program, and runs only when the row is not valid. A donated, new or mutated input is a
  new object: its row is not valid, and it is hashed. Never stale.

The trace's `Scope` also carries the other thing a wrapper knows outside its program,
the hits it decided on the host (`_decided.py`): `claim(...)` is how a cached call
inside the trace reaches them.

**Several processes.** Whatever reaches a compiled program must be the same in every
process. A program over the devices of several processes (an input array that is not
fully addressable) gets a table with no valid row, the same zeros in every process: a
row's validity comes from this process's own history (the object seen at the previous
call), which nothing makes equal across processes, and a process that skipped the hash
while another ran it would skip the collective inside it. Every dependency is hashed
in-graph there (one fused pass, and one all-reduce of two words per sharded array). A
program over this process's devices alone keeps its table.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from . import _context, _jax_internals
from ._decided import Claim, Claims, Decided, Held
from ._fingerprint import across_processes, array_fingerprint, known
from ._jax_internals import is_concrete_array
from ._key import StaticKey
from ._slot import Memo
from ._storage import Spec
from ._table import entry_leaves


class _Valid(NamedTuple):
    """A table with every row valid, and what it was computed for: published by one
    assignment, never changed (so a thread reads all of it or none)."""

    dependencies: frozenset[int]  # the positions it has rows for
    n: int  # the number of input arrays
    rows: tuple[tuple[int, weakref.ref], ...]  # position -> the array its row is for
    table: Any  # on the device


class Inputs:
    """What a compiled wrapper knows about its input arrays, across calls (outside any
    trace): which positions cached methods fingerprinted, and the object last seen at
    each of them.

    **Threads.** One wrapper may be called by several threads at once. Every row a table
    marks valid is the fingerprint of the very object the row was checked against, by
    construction: a table is built from local references only (each array checked is
    the one whose fingerprint fills its row), and the reusable table (`_valid`) is an
    immutable snapshot of the references it was checked against, replaced whole. The
    shared `_last` (which object was seen where) only decides which rows are worth
    filling: a thread that reads another's entry there fills fewer rows, never a wrong
    one. `dependencies` is a frozenset, replaced whole under a lock (a trace may learn
    while another thread iterates over it). No lock on a call's path."""

    def __init__(self) -> None:
        self.dependencies: frozenset[int] = frozenset()
        self._last: dict[int, weakref.ref] = {}
        self._new = False  # dependencies learned by a trace, not yet registered
        # The last table with every row valid, on the device: a call on the same arrays
        # reuses it (no host work, no transfer).
        self._valid: _Valid | None = None
        self._lock = threading.Lock()  # around `learned`'s read-modify-write

    def table(self, arrays: Sequence[Any]) -> Any:
        """The table for a call on `arrays` (`uint32`, `(len(arrays), 3)`: the
        fingerprint, then 1 where valid). Registers the arrays seen."""
        dependencies = self.dependencies  # one snapshot for this call
        valid = self._valid
        if valid is not None:
            for_dependencies, n, checked, ready = valid  # unpacked: every call's fast path
            # (`memox.filter_jit` donates the table with its first argument)
            if for_dependencies is dependencies and n == len(arrays) and not ready.is_deleted():
                if all(ref() is arrays[i] for i, ref in checked):
                    return ready
        table = np.zeros((len(arrays), 3), np.uint32)
        if across_processes(arrays):
            return table  # no valid row: the same table in every process
        last, rows = self._last, []
        for i in dependencies:
            if i >= len(arrays):
                continue
            x = arrays[i]
            seen = last.get(i)
            fingerprint = None
            if seen is not None and seen() is x and not x.is_deleted():
                fingerprint = known.host(x)
            if fingerprint is not None:
                table[i, :2] = fingerprint
                table[i, 2] = 1
                rows.append((i, seen))  # the reference checked, not `last[i]` again
            elif is_concrete_array(x):
                last[i] = weakref.ref(x)
        # (with no dependency, the table of no valid row: reused too, not sent anew)
        if len(rows) == sum(i < len(arrays) for i in dependencies):
            with jax.ensure_compile_time_eval():  # a concrete array, even under a trace
                valid = _Valid(dependencies, len(arrays), tuple(rows), jax.device_put(table))
            self._valid = valid
            return valid.table
        return table

    def learned(self, used: set[int]) -> None:
        """Called inside a trace: the positions its checks fingerprinted."""
        if used <= self.dependencies:
            return
        with self._lock:
            self.dependencies = self.dependencies | used
            self._new = True

    def register(self, arrays: Sequence[Any]) -> None:
        """After a call: dependencies learned by its trace start being tracked now, so
        that the next call on the same arrays already has their fingerprints."""
        if not self._new:
            return
        self._new = False
        for i in self.dependencies:
            if i < len(arrays) and is_concrete_array(arrays[i]) and i not in self._last:
                self._last[i] = weakref.ref(arrays[i])


# The compiled wrappers hash inputs smaller than this in-graph, without a `lax.cond`: on
# XLA:CPU a conditional whose untaken branch holds a reduction costs ~5-10 us per
# execution, about what hashing 256 KiB costs (s10: 1.23x -> 1.19x hand-hoisted), and
# XLA compiles each conditional apart (s12, 100 slots of 4x4 weights: `memox.jit`'s
# first call 9.4 s -> 7.0 s).
PREHASH_MIN_BYTES = 1 << 18


class Scope(_context.Precomputed):
    """The context of one trace of a compiled wrapper: the table, by the ids of its input
    tracers, and the cached calls the host may decide (`_decided.Claims`, with `hits`:
    per slot, by its `Held`, the input tracers of the index of the entry to read and of
    the value it holds).

    Holds the input tracers while the trace runs (so that no id is reused), and drops
    them when it ends."""

    def __init__(
        self,
        inputs: Sequence[Any],
        table: Any,
        min_bytes: int = 0,
        hits: dict[Held, Decided] | None = None,
    ):
        self.trace = _jax_internals.current()
        self._min_bytes = min_bytes
        self._inputs = list(inputs)
        self._index = {id(x): i for i, x in enumerate(self._inputs)}
        self._table = table
        self._rows = 0 if table is None else table.shape[0]
        self.used: set[int] = set()  # positions whose tracer a check fingerprinted
        self._claims = Claims(dict(hits or {}))

    def lookup(self, x: Any) -> Any | None:
        i = self._index.get(id(x))
        if i is None or i >= self._rows or x.size * x.dtype.itemsize < self._min_bytes:
            return None
        self.used.add(i)
        assert self._table is not None  # (not closed)
        row = self._table[i]
        return lax.cond(row[2] != 0, lambda _: row[:2], array_fingerprint, x)

    def _positions(self, xs: Sequence[Any]) -> tuple[int, ...] | None:
        found = tuple(self._index.get(id(x), -1) for x in xs)
        return None if -1 in found else found

    def claim(
        self, slot: Memo, max_age: int | None, reads: Sequence[Any], spec: Spec, key: StaticKey
    ) -> Claim | None:
        """A cached call on `slot`, whose reuse decision reads `reads`, where the host can
        decide it: made directly in the wrapped function (not in a branch, a loop, `vmap`
        or a staged transformation; inside `jax.grad` and its kin, with what it reads
        not differentiated), under a policy without `max_age`, on a slot whose entries
        and on values whose arrays are all inputs of the wrapper, for a value of `spec`,
        under static key `key`.
        Then the call's `Claim`: the entry's index and value where the host decided a
        hit, else None (the call checks in-graph and tells the claim what it left)."""
        if max_age is not None or not slot.allocated:
            return None
        if not _jax_internals.differentiating_in(_jax_internals.current(), self.trace):
            return None
        entries = self._positions(entry_leaves(slot))
        positions = self._positions(reads)
        if entries is None or positions is None:
            return None
        return self._claims.claim(entries, positions, spec, key)

    def held(self, out: Sequence[Memo], keeps_indices: bool) -> list[tuple[Held, int, Any]]:
        """`Claims.held`: the claimed slots the host can vouch for after this call."""
        return self._claims.held(out, keeps_indices)

    def close(self) -> None:
        self._inputs, self._index, self._table = [], {}, None
        self._claims = Claims({})


@contextlib.contextmanager
def scope(
    inputs: Sequence[Any],
    table: Any,
    min_bytes: int = 0,
    hits: dict[Held, Decided] | None = None,
) -> Iterator[Scope]:
    """Make `table` (rows for the first inputs of `inputs`, the tracers of a compiled
    function's input arrays) and `hits` current while the function is traced; inputs
    of fewer than `min_bytes` bytes are left to the in-graph hash."""
    with _context.active(Scope(inputs, table, min_bytes, hits)) as current:
        try:
            yield current
        finally:
            current.close()


def claim(
    slot: Memo, max_age: int | None, reads: Sequence[Any], spec: Spec, key: StaticKey
) -> Claim | None:
    """`Scope.claim` in the innermost compiled wrapper being traced, if any."""
    scopes = _context.innermost(Scope)
    return scopes[0].claim(slot, max_age, reads, spec, key) if scopes else None


def tracing() -> bool:
    """Whether a compiled wrapper (`memox.jit`, `memox.filter_jit`) is being traced."""
    return bool(_context.innermost(Scope))
