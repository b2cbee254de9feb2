"""The accounting: every evaluation of a cached method inside memox ends as a hit, a
store that reaches what the call returns, or an `UncachedWarning` that names the fix.

Each `memox.call` keeps a ledger, an entry of the thread's per-call state stack
(`_context.py`) just above the call's frame. An evaluation of a cached method is
recorded in the innermost open ledger as one of:

- **memoised** (`_memo.py`): its slot was found. The store is written to the call's
  frame, which becomes the module the call returns, so it reaches the caller by
  construction when it runs at the frame's own trace level. Run at a deeper level
  (a `memox.call` nested inside a loop body, a branch, a vector field...), it reaches
  the caller only through the outputs of what encloses it;
- **uncached**: it computed without its slot (not reachable from the call, no call at
  all under a memox wrapper, or under a batched predicate where both branches run).

When a call ends, its ledger is settled in one place for every placement at once:

1. Uncached evaluations recorded while Python ran are reported.
2. Where the call runs inside a trace (`memox.jit`, `memox.filter_jit`, your own
   `jax.jit`), the program staged during the call is read, jaxprs of inner
   transformations included, even those JAX reused from its caches without running
   any Python: an uncached evaluation is staged under a `jax.named_scope` marker
   (`memox_uncached.<method>`), and is reported if the program holds it.
3. A store made by a `memox.call` nested in this one (directly in `fn`, or deep inside
   a loop body, a branch or a vector field that `fn` opens) carries a marker on the key
   it writes (`memox_store_<n>`): where the value was read but the marker is not in the
   program that computes this call's results (JAX's dead-code elimination, which sees
   through loops, branches and calls), the store was dropped (the module the nested
   call returned was not passed on) and is reported.

In an eager call (nothing is staged), (1) is all there is.

A marker is found by the structure of an equation's name stack, never by its rendered
name: a transformation that re-stages an equation (`vmap`, `jvp`, `transpose`,
`checkpoint`, one JAX adds later) puts an entry of its own on the stack and leaves the
scopes as they were, where the rendering reads `vmap(memox_read_3)`.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend

from . import _context, _errors, _jax_internals


UNCACHED_SCOPE = "memox_uncached."
_STORE_SCOPE = "memox_store_"
_READ_SCOPE = "memox_read_"
_names = itertools.count()


class Ledger:
    """The evaluations of one `memox.call` (those of calls nested in it included)."""

    def __init__(self, trace: Any):
        self.trace = trace
        self.staged_from = _jax_internals.staged_count(trace)
        self.uncached: dict[str, str] = {}  # method -> the message that says why
        self.deep: dict[str, tuple[str, str]] = {}  # store number -> (method, slot)
        self.stores: dict[str, str] = {}  # method -> slot, of the memoised evaluations

    def settle(self, outputs: list[Any]) -> None:
        """Report what did not reach the caller (`outputs`: the call's results and the
        leaves of the module it returns)."""
        if _jax_internals.inside_loop_body(self.trace) == "while_cond":
            # A `while_loop` condition returns its predicate only: nothing stored in it
            # can leave it, whatever `fn` does with the module.
            for method, slot in self.stores.items():
                self.uncached.setdefault(method, _errors.STORE_DROPPED.replace("{slot}", slot))
        if self.staged_from is not None:
            staged = _jax_internals.staged_since(self.trace, self.staged_from)
            for scope in _jax_internals.scope_names(staged):
                if scope.startswith(UNCACHED_SCOPE):
                    method = scope[len(UNCACHED_SCOPE) :]
                    self.uncached.setdefault(method, _errors.UNCACHED_STAGED)
            if self.deep:
                self._settle_deep(outputs)
        for method, message in self.uncached.items():
            warnings.warn(message.format(method=method), _errors.UncachedWarning, stacklevel=4)

    def _settle_deep(self, outputs: list[Any]) -> None:
        live = set(
            _jax_internals.scope_names(
                _jax_internals.live_equations(self.trace, outputs), live=True
            )
        )
        for number, (method, slot) in self.deep.items():
            if _READ_SCOPE + number in live and _STORE_SCOPE + number not in live:
                self.uncached.setdefault(method, _errors.STORE_DROPPED.replace("{slot}", slot))


def current() -> Ledger | None:
    """The ledger of the innermost `memox.call` open on this thread, if any."""
    found = _context.innermost(Ledger)
    return found[0] if found else None


@contextlib.contextmanager
def opened(trace: Any) -> Iterator[Ledger]:
    """A ledger for one call, open while it runs (the caller settles it)."""
    with _context.active(Ledger(trace)) as ledger:
        yield ledger


def record_uncached(method: str, message: str) -> None:
    """Record, in the open ledger if any, that `method` computed without its slot."""
    ledger = current()
    if ledger is not None:
        ledger.uncached.setdefault(method, message)


def uncached_scope(method: str) -> Any:
    """The marker under which an uncached evaluation of `method` is staged."""
    return jax.named_scope(UNCACHED_SCOPE + method)


def store(method: str, slot: str) -> tuple[Any, Any] | None:
    """Markers for a memoised evaluation of `method` on `slot` in the innermost call,
    where that call is nested in another whose program memox can read (a traced one):
    `(read, store)` scopes, the enclosing call checks that the store reaches its
    outputs wherever the value is read. Else `None` (nothing to check: the store reaches
    the module the innermost call returns by construction)."""
    ledgers = _context.innermost(Ledger, 2)
    if ledgers:
        ledgers[0].stores[method] = slot
    if len(ledgers) < 2 or ledgers[1].staged_from is None:
        return None
    number = str(next(_names))
    ledgers[1].deep[number] = (method, slot)
    return jax.named_scope(_READ_SCOPE + number), jax.named_scope(_STORE_SCOPE + number)
