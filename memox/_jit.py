"""`memox.jit`: `memox.call` compiled, with only slots crossing the jit boundary.

A jitted function that returns the module it was given copies every array of it on
every call (XLA gives each output a fresh buffer). Inside `memox.call` nothing but slots
can change, so the compiled function returns only the slots, and the wrapper splices
them into the caller's module outside the compiled code: every other leaf of the
returned module is the caller's own array.

The slots themselves are donated: their buffers are reused for the returned slots, so a
hit, whose table passes through unchanged, copies nothing, and a miss writes its entry in
place. The caller's old module loses its slot arrays (a later call on it recomputes; see
`revive`), never its parameters.

Dependencies that are the caller's arrays are fingerprinted outside the compiled code,
once per array object (`_fingerprint.known`), and passed in: a hit on an unchanged
dependency costs O(1), not a pass over its bytes (and no collective for a sharded one).
Which inputs are dependencies is learned from the first trace.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from ._call import Fn, allocate_plain_slots, changed_slots, check_fn, check_module, revive, run
from ._fingerprint import is_concrete_array, known
from ._slot import Memo, is_memo, replace_slots


M = TypeVar("M")


def _split(module: Any) -> tuple[Any, Any]:
    return eqx.partition(module, is_memo, is_leaf=is_memo)


def _arrays(tree: Any) -> list[Any]:
    return [x for x in jtu.tree_leaves(tree) if eqx.is_array(x)]


def _only(leaves: list[Any], keep: list[int]) -> list[Any]:
    kept = set(keep)
    return [x if i in kept else None for i, x in enumerate(leaves)]


def _ready(slot: Memo) -> bool:
    """Whether `slot` needs neither allocation nor revival (the common case, checked fast:
    an empty slot may not need allocation, and is left to the slow path to decide)."""
    return slot.allocated and not (is_concrete_array(slot.value) and slot.value.is_deleted())


def jit(fn: Fn, /, *, donate: bool = True) -> Callable[..., tuple[Any, Any]]:
    """Compile `memox.call(module, fn, ...)`, with `eqx.filter_jit` semantics.

    **Arguments:**

    - `fn`: the function to run, called as `fn(module, *args, **kwargs)`.
    - `donate`: whether the module's slot buffers are donated to the returned module
      (the default). A hit then copies nothing, where without donation XLA copies each
      slot's table (the cached values) into a fresh output buffer on every call. The
      module you passed in keeps its parameters but loses its slot arrays: keep using
      the returned one (`out, model = step(model, x)`); a call on the old module
      recomputes and warns, and other code reading its slots finds deleted arrays.

    Arrays anywhere in `module` and the arguments are traced; everything else is static.
    Before the first trace, the module's slots for methods without arguments are
    allocated, so a loop `out, model = step(model, x)` traces once.

    **Returns:**

    A function `wrapped(module, *args, **kwargs) -> (result, new_module)`. The arrays of
    `new_module` other than its slots are the caller's own (no copy crosses the
    boundary).

    !!! Example

        ```python
        use_b = memox.jit(lambda f: f.b())
        b, foo = use_b(foo)   # compiled once; a hit when `foo.a` has not changed
        ```
    """
    check_fn("jit", fn)
    # Positions (among the input arrays) of the dependencies cached methods fingerprinted,
    # and the array seen last at each: only an array seen twice is fingerprinted outside.
    dependencies: set[int] = set()
    last_seen: dict[int, weakref.ref] = {}

    def slots_only(inputs: Any, slots: Any) -> tuple[Any, Any]:
        rest, args, kwargs, (fingerprints, valid) = inputs
        module = eqx.combine(slots, rest, is_leaf=is_memo)
        arrays = _arrays((rest, args, kwargs))
        prehashed = {id(x): (fingerprints[i], valid[i]) for i, x in enumerate(arrays)}
        result, module, frame = run(module, fn, args, kwargs, prehashed=prehashed)
        dependencies.update(i for i, x in enumerate(arrays) if id(x) in frame.fingerprinted)
        changed = changed_slots(module, frame)
        new_slots, _ = _split(replace_slots(module, changed))
        if not donate:
            # Only changed slots go out: an unchanged one stays the caller's own (no copy).
            # With donation every slot goes out, unchanged ones aliasing their input.
            fresh = {id(s) for s in changed.values()}
            new_slots = jtu.tree_map(
                lambda s: s if id(s) in fresh else None, new_slots, is_leaf=is_memo
            )
        return result, new_slots

    compiled = eqx.filter_jit(slots_only, donate="all-except-first" if donate else "none")

    def fingerprints(arrays: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        table = np.zeros((len(arrays), 2), np.uint32)
        valid = np.zeros((len(arrays),), np.bool_)
        for i in dependencies:
            if i >= len(arrays) or not is_concrete_array(arrays[i]):
                continue
            x = arrays[i]
            seen = last_seen.get(i)
            if seen is not None and seen() is x:
                table[i], valid[i] = known.host(x), True
            else:
                last_seen[i] = weakref.ref(x)
        return table, valid

    @functools.wraps(fn)
    def wrapped(module: M, /, *args: Any, **kwargs: Any) -> tuple[Any, M]:
        leaves, treedef = jtu.tree_flatten(module, is_leaf=is_memo)
        memos = [i for i, x in enumerate(leaves) if is_memo(x)]
        if jtu.treedef_is_leaf(treedef):
            check_module("jit", module)
        if not all(_ready(leaves[i]) for i in memos):  # rare: allocate, or revive
            module = allocate_plain_slots(revive(module))
            leaves, treedef = jtu.tree_flatten(module, is_leaf=is_memo)
            memos = [i for i, x in enumerate(leaves) if is_memo(x)]
        rest = list(leaves)
        for i in memos:
            rest[i] = None
        arrays = [x for x in rest if eqx.is_array(x)] + _arrays((args, kwargs))
        inputs = (jtu.tree_unflatten(treedef, rest), args, kwargs, fingerprints(arrays))
        result, new_slots = compiled(inputs, jtu.tree_unflatten(treedef, _only(leaves, memos)))
        out = treedef.flatten_up_to(new_slots)  # None where a slot did not come back
        for i in memos:
            rest[i] = leaves[i] if out[i] is None else out[i]
        return result, jtu.tree_unflatten(treedef, rest)

    return wrapped
