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

The wrapper flattens its arguments once and calls `jax.jit` directly, with the arrays
as traced arguments and everything else (the tree structures, static fields and
non-array leaves) as one hashable static argument: the semantics of `eqx.filter_jit`,
without its second partition of the same trees on every call.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from ._call import Fn, allocate_plain_slots, changed_slots, check_fn, check_module, revive, run
from ._fingerprint import is_concrete_array, known
from ._slot import Memo, is_memo, slots


M = TypeVar("M")


class _Static(eqx.Module):
    """Non-array outputs, carried in the output's tree structure."""

    value: Any = eqx.field(static=True)


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

    def slots_only(
        static: _Signature, arrays: list, slot_leaves: list, fingerprints: tuple
    ) -> Any:
        module, args, kwargs = static.rebuild(arrays, slot_leaves)
        table, valid = fingerprints
        prehashed = {id(x): (table[i], valid[i]) for i, x in enumerate(arrays)}
        result, module, frame = run(module, fn, args, kwargs, prehashed=prehashed)
        dependencies.update(i for i, x in enumerate(arrays) if id(x) in frame.fingerprinted)
        changed = changed_slots(module, frame)
        # With donation every allocated slot goes out (an unchanged one aliases its
        # input); without, only the changed ones: an unchanged slot stays the caller's.
        new_slots = {
            i: changed.get(path, slot)
            for i, (path, slot) in enumerate(slots(module).items())
            if (path in changed or donate) and changed.get(path, slot).allocated
        }
        dynamic, static_out = eqx.partition(result, eqx.is_array)
        return dynamic, _Static(static_out), new_slots

    compiled = jax.jit(slots_only, static_argnums=0, donate_argnums=(2,) if donate else ())

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
        if jtu.treedef_is_leaf(treedef):
            check_module("jit", module)
        if not all(_ready(x) for x in leaves if is_memo(x)):  # rare: allocate, or revive
            module = allocate_plain_slots(revive(module))
            leaves, treedef = jtu.tree_flatten(module, is_leaf=is_memo)
        static, arrays, slot_leaves = _Signature.split(leaves, treedef, args, kwargs)
        dynamic, static_out, new_slots = compiled(
            static, arrays, slot_leaves, fingerprints(arrays)
        )
        memos = [i for i, x in enumerate(leaves) if is_memo(x)]
        for k, slot in new_slots.items():
            leaves[memos[k]] = slot
        return eqx.combine(dynamic, static_out.value), jtu.tree_unflatten(treedef, leaves)

    return wrapped


_ARRAY = object()  # marks a leaf passed as an array


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Marks an allocated slot, passed as its leaves: the `index`-th list of slot leaves
    (a slot object found at several paths, as in a shared submodule, is passed once: a
    buffer can be donated only once)."""

    treedef: Any
    index: int


@dataclasses.dataclass(frozen=True)
class _Signature:
    """What a call is compiled for (the static argument of `jax.jit`, hashable): the
    tree structures of the module and of the arguments, and every leaf that is not an
    array. The arrays travel separately: the module's then the arguments', and the
    allocated slots' leaves, one list per slot."""

    module: Any  # treedef of the module, slots as leaves
    module_leaves: tuple[Any, ...]  # the leaf where static, else `_ARRAY` or a `_Slot`
    arguments: Any  # treedef of `(args, kwargs)`
    argument_leaves: tuple[Any, ...]  # the leaf where static; `_ARRAY`

    @classmethod
    def split(
        cls, leaves: list[Any], treedef: Any, args: tuple, kwargs: dict
    ) -> tuple[_Signature, list[Any], list[list[Any]]]:
        arg_leaves, arg_treedef = jtu.tree_flatten((args, kwargs))
        arrays: list[Any] = []
        slot_leaves: list[list[Any]] = []
        seen: dict[int, int] = {}
        module_leaves = []
        for x in leaves:
            if is_memo(x) and x.allocated:
                one_slot, slot_treedef = jtu.tree_flatten(x)
                if id(x) not in seen:
                    seen[id(x)] = len(slot_leaves)
                    slot_leaves.append(one_slot)
                module_leaves.append(_Slot(slot_treedef, seen[id(x)]))
            elif eqx.is_array(x):
                arrays.append(x)
                module_leaves.append(_ARRAY)
            else:
                module_leaves.append(x)
        argument_leaves = []
        for x in arg_leaves:
            if eqx.is_array(x):
                arrays.append(x)
                argument_leaves.append(_ARRAY)
            else:
                argument_leaves.append(x)
        signature = cls(treedef, tuple(module_leaves), arg_treedef, tuple(argument_leaves))
        return signature, arrays, slot_leaves

    def rebuild(self, arrays: list[Any], slot_leaves: list[list[Any]]) -> tuple[Any, tuple, dict]:
        arrays_ = iter(arrays)
        rebuilt: dict[int, Any] = {}
        leaves = []
        for x in self.module_leaves:
            if x is _ARRAY:
                leaves.append(next(arrays_))
            elif isinstance(x, _Slot):
                if x.index not in rebuilt:
                    rebuilt[x.index] = jtu.tree_unflatten(x.treedef, slot_leaves[x.index])
                leaves.append(rebuilt[x.index])
            else:
                leaves.append(x)
        arg_leaves = [next(arrays_) if x is _ARRAY else x for x in self.argument_leaves]
        args, kwargs = jtu.tree_unflatten(self.arguments, arg_leaves)
        return jtu.tree_unflatten(self.module, leaves), args, kwargs
