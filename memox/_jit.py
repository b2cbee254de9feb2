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
once per array object (`_fingerprint.known`), and passed in (`_prehash.py`, shared
with `memox.filter_jit`): a hit on an unchanged dependency costs O(1), not a pass over
its bytes (and no collective for a sharded one). Which inputs are dependencies is
learned from the first trace.

The wrapper flattens its arguments once (without a Python test per node: where the
slots' leaves lie is worked out once per tree structure) and calls `jax.jit` directly,
with the arrays as traced arguments and everything else (the tree structures, static
fields and non-array leaves) as one hashable static argument: the semantics of
`eqx.filter_jit`, without its second partition of the same trees on every call. A
module passed again with its slots empty or donated (a caller that does not thread the
returned module) gets the slots the last call on that same object returned, by
identity: no new allocation, and no recomputation of what they hold.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any, Concatenate

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from . import _prehash
from ._call import allocate_plain_slots, changed_slots, check_fn, check_module, revive, run
from ._fingerprint import is_concrete_array
from ._slot import Memo, is_memo, slots
from ._typing import Fn, M, P, R


class _Static(eqx.Module):
    """Non-array outputs, carried in the output's tree structure."""

    value: Any = eqx.field(static=True)


def _ready(slot: Memo) -> bool:
    """Whether `slot` needs neither allocation nor revival (the common case, checked fast:
    an empty slot may not need allocation, and is left to the slow path to decide)."""
    return slot.allocated and not (is_concrete_array(slot.value) and slot.value.is_deleted())


def jit(
    fn: Fn[Concatenate[M, P], R], /, *, donate: bool = True
) -> Callable[Concatenate[M, P], tuple[R, M]]:
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
    # Which input arrays cached methods fingerprinted (learned from the traces), and
    # their fingerprints per call, computed outside (`_prehash.py`).
    inputs = _prehash.Inputs()

    def slots_only(static: _Signature, arrays: list, slot_leaves: list, table: Any) -> Any:
        module, args, kwargs = static.rebuild(arrays, slot_leaves)
        with _prehash.scope(arrays, table) as scope:
            result, module, frame = run(module, fn, args, kwargs)
        inputs.learned(scope.used)
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

    @functools.wraps(fn)
    def wrapped(module: M, /, *args: P.args, **kwargs: P.kwargs) -> tuple[R, M]:
        static, arrays, slot_leaves, put, ready = _Signature.split(module, args, kwargs)
        if jtu.treedef_is_leaf(static.module):
            check_module("jit", module)
        given = None
        if not ready:  # rare: allocate, or revive
            given, module = module, latest.get(module) or allocate_plain_slots(revive(module))
            static, arrays, slot_leaves, put, _ = _Signature.split(module, args, kwargs)
        dynamic, static_out, new_slots = compiled(
            static, arrays, slot_leaves, inputs.table(arrays)
        )
        inputs.register(arrays)
        new_module = put(new_slots)
        if given is not None:
            latest.put(given, new_module)
        return eqx.combine(dynamic, static_out.value), new_module

    # A module passed again with its slots empty (or donated), as by a caller that does
    # not thread the returned module: the slots the last call on it returned, not a new
    # allocation (which also recomputes what they hold).
    latest = _ByIdentity()
    return wrapped


class _ByIdentity:
    """Modules by identity, held weakly: the one given last for each, while its slots
    are usable (none donated since; a slot still empty, such as one keyed by arguments,
    is as allocation would leave it)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

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


_allocated = _ByIdentity()


def allocated_once(tree: Any) -> Any:
    """`tree` with its empty slots allocated (`memox.init`), the same allocation for the
    same object while its slots are usable: for `memox.filter_jit`, whose compiled
    function returns the caller's own trees, which it cannot map back to `tree`."""
    found = _allocated.get(tree)
    if found is None:
        found = allocate_plain_slots(revive(tree))
        _allocated.put(tree, found)
    return found


_ARRAY = object()  # marks a leaf passed as an array
try:  # `eqx.is_array`, inlined (called on every leaf at every call)
    from equinox._filters import _ARRAY_TYPES
except ImportError:  # pragma: no cover
    _ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
_MEMO_TYPES: dict[type, bool] = {}


def _is_memo(x: Any) -> bool:
    """`is_memo`, with the answer kept per type (`isinstance` on an `eqx.Module` class
    goes through `ABCMeta`: called on every node of the module at every call)."""
    kind = type(x)
    found = _MEMO_TYPES.get(kind)
    if found is None:
        found = _MEMO_TYPES[kind] = is_memo(x)
    return found


@dataclasses.dataclass(frozen=True)
class _SlotLeaf:
    """Marks leaf `j` of an allocated slot, passed in the `index`-th list of slot leaves
    (a slot object found at several paths, as in a shared submodule, is passed once: a
    buffer can be donated only once)."""

    index: int
    j: int


_SLOT_LEAVES: dict[tuple[int, int], _SlotLeaf] = {}


def _slot_leaf(index: int, j: int) -> _SlotLeaf:
    """The marker, the same object at every call (compared by identity first when
    `jax.jit` looks its signature up)."""
    found = _SLOT_LEAVES.get((index, j))
    if found is None:
        found = _SLOT_LEAVES[index, j] = _SlotLeaf(index, j)
    return found


_layouts: dict[Any, tuple[tuple[int, int], ...] | None] = {}


def _layout(treedef: Any) -> tuple[tuple[int, int], ...] | None:
    """Where the slots' leaves are among the leaves of a module of structure `treedef`:
    a range per slot, in flattening order (computed once per structure, by rebuilding
    the module with integers for leaves; None where its nodes refuse that)."""
    if treedef in _layouts:
        return _layouts[treedef]
    found: tuple[tuple[int, int], ...] | None
    try:
        tree = jtu.tree_unflatten(treedef, range(treedef.num_leaves))
        ranges = []
        for x in jtu.tree_leaves(tree, is_leaf=is_memo):
            if is_memo(x):
                idx: list[int] = jtu.tree_leaves(x)
                ranges.append((idx[0], idx[-1] + 1) if idx else (-1, -1))
        found = tuple(ranges)
    except Exception:  # a node that checks its leaves: the general path
        found = None
    if len(_layouts) > 1024:
        _layouts.clear()
    _layouts[treedef] = found
    return found


@dataclasses.dataclass(frozen=True)
class _Signature:
    """What a call is compiled for (the static argument of `jax.jit`, hashable): the
    tree structures of the module and of the arguments, and every leaf that is not an
    array. The arrays travel separately: the module's then the arguments', and the
    allocated slots' leaves, one list per slot."""

    module: Any  # treedef of the module
    module_leaves: tuple[Any, ...]  # the leaf where static, else `_ARRAY` or a `_SlotLeaf`
    arguments: Any  # treedef of `(args, kwargs)`
    argument_leaves: tuple[Any, ...]  # the leaf where static; `_ARRAY`

    @classmethod
    def split(
        cls, module: Any, args: tuple, kwargs: dict
    ) -> tuple[_Signature, list[Any], list[list[Any]], Any, bool]:
        """The signature, the arrays, the slots' leaves (one list per slot), a function
        putting new slots (by index in flattening order) into the module, and whether
        every slot is ready (needs neither allocation nor revival)."""
        leaves, treedef = jtu.tree_flatten(module)
        ranges = _layout(treedef)
        if ranges is None:
            return cls._split_nested(module, args, kwargs)
        statics: list[Any] = leaves[:]
        in_slot = [False] * len(leaves)
        slot_leaves: list[list[Any]] = []
        seen: dict[int, int] = {}
        ready = True
        for a, b in ranges:
            if a < 0 or not isinstance(leaves[a], _ARRAY_TYPES):  # empty, or filtered out
                ready = False
                continue
            value = leaves[a]
            if is_concrete_array(value) and value.is_deleted():
                ready = False
            index = seen.setdefault(id(value), len(slot_leaves))
            if index == len(slot_leaves):
                slot_leaves.append(leaves[a:b])
            for j in range(b - a):
                statics[a + j] = _slot_leaf(index, j)
                in_slot[a + j] = True
        arrays: list[Any] = []
        for i, x in enumerate(leaves):
            if not in_slot[i] and isinstance(x, _ARRAY_TYPES):
                arrays.append(x)
                statics[i] = _ARRAY
        arg_statics, arg_treedef = cls._arguments(args, kwargs, arrays)

        def put(new_slots: dict[int, Memo]) -> Any:
            for k, slot in new_slots.items():
                a, b = ranges[k]
                leaves[a:b] = jtu.tree_leaves(slot)
            return jtu.tree_unflatten(treedef, leaves)

        signature = cls(treedef, tuple(statics), arg_treedef, arg_statics)
        return signature, arrays, slot_leaves, put, ready

    @classmethod
    def _split_nested(
        cls, module: Any, args: tuple, kwargs: dict
    ) -> tuple[_Signature, list[Any], list[list[Any]], Any, bool]:
        """`split` for a module whose structure cannot be rebuilt from placeholders:
        slots found as nodes (slower: a Python test on every node)."""
        leaves, treedef = jtu.tree_flatten(module, is_leaf=_is_memo)
        arrays: list[Any] = []
        slot_leaves: list[list[Any]] = []
        seen: dict[int, int] = {}
        statics, memos, ready = [], [], True
        for i, x in enumerate(leaves):
            if _is_memo(x):
                memos.append(i)
                ready = ready and _ready(x)
                if not x.allocated:
                    statics.append(x)
                    continue
                one_slot, slot_treedef = jtu.tree_flatten(x)
                if id(x) not in seen:
                    seen[id(x)] = len(slot_leaves)
                    slot_leaves.append(one_slot)
                statics.append(_Slot(slot_treedef, seen[id(x)]))
            elif isinstance(x, _ARRAY_TYPES):
                arrays.append(x)
                statics.append(_ARRAY)
            else:
                statics.append(x)
        arg_statics, arg_treedef = cls._arguments(args, kwargs, arrays)

        def put(new_slots: dict[int, Memo]) -> Any:
            for k, slot in new_slots.items():
                leaves[memos[k]] = slot
            return jtu.tree_unflatten(treedef, leaves)

        signature = cls(treedef, tuple(statics), arg_treedef, arg_statics)
        return signature, arrays, slot_leaves, put, ready

    @staticmethod
    def _arguments(args: tuple, kwargs: dict, arrays: list[Any]) -> tuple[tuple, Any]:
        arg_leaves, arg_treedef = jtu.tree_flatten((args, kwargs))
        statics = []
        for x in arg_leaves:
            if isinstance(x, _ARRAY_TYPES):
                arrays.append(x)
                statics.append(_ARRAY)
            else:
                statics.append(x)
        return tuple(statics), arg_treedef

    def rebuild(self, arrays: list[Any], slot_leaves: list[list[Any]]) -> tuple[Any, tuple, dict]:
        arrays_ = iter(arrays)
        rebuilt: dict[int, Any] = {}
        leaves = []
        for x in self.module_leaves:
            if x is _ARRAY:
                leaves.append(next(arrays_))
            elif isinstance(x, _SlotLeaf):
                leaves.append(slot_leaves[x.index][x.j])
            elif isinstance(x, _Slot):
                if x.index not in rebuilt:
                    rebuilt[x.index] = jtu.tree_unflatten(x.treedef, slot_leaves[x.index])
                leaves.append(rebuilt[x.index])
            else:
                leaves.append(x)
        arg_leaves = [next(arrays_) if x is _ARRAY else x for x in self.argument_leaves]
        args, kwargs = jtu.tree_unflatten(self.arguments, arg_leaves)
        return jtu.tree_unflatten(self.module, leaves), args, kwargs


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Marks an allocated slot, passed as its leaves: the `index`-th list of slot leaves
    (for `_Signature._split_nested`)."""

    treedef: Any
    index: int
