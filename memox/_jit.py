"""`memox.jit`: `memox.call` compiled, with only slots crossing the jit boundary.

A jitted function that returns the module it was given copies every array of it on
every call (XLA gives each output a fresh buffer). Inside `memox.call` nothing but slots
can change, so the compiled function returns only the slots, and the wrapper splices
them into the caller's module outside the compiled code: every other leaf of the
returned module is the caller's own array.

**Donation: nothing the caller holds loses its arrays.** The slots are donated, so that
a hit, whose table passes through unchanged, copies nothing and a miss writes its entry
in place. A donated array is deleted, so the rule is: a slot's arrays are donated only
where the slot (the `Memo` node in the module passed in) is the one object that holds
them, and after the call that node is given the returned slot's arrays. Every object that
reaches the module passed in (an early-stopping `best = model`, the caller's own
variable) therefore still holds readable arrays: the slot as the call left it (valid by
the key rule, so a later call on it hits where its parameters match), and its parameters
never crossed the boundary. Where anything else holds a slot's arrays too (a list of
leaves, a copy of the module made by a tree operation, the node of an older module given
the same arrays), the call donates a copy of them instead: one copy of the table. Who
holds an array is read from its reference count (as NumPy elides temporaries): exact in
CPython, calibrated once, and only ever wrong towards copying. In the threaded loop
(`out, model = step(model, x)`) the old module is gone by the next call, so every hit
copies nothing; a kept module costs one copy at the next call.

**Hits decided on the host.** A slot whose entries and inputs are the very arrays of the
previous call is known to hit before dispatch (`_prehash.Hits`): the call runs a program
that reads it with no check, its entries passed apart (read, not donated) and given back
as the caller's arrays.

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
module passed again with its slots empty (a caller that does not thread the returned
module) gets the slots the last call on that same object returned, by identity: no new
allocation, and no recomputation of what they hold.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any, Concatenate, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _errors, _prehash
from ._caches import Cache
from ._call import changed_slots, check_fn, check_module, run
from ._fingerprint import is_concrete_array
from ._lifecycle import ByIdentity, allocated
from ._sites import Path, child, replace_slots, slots
from ._slot import ENTRY_FIELDS, Memo, is_memo
from ._table import copied, entry_leaves
from ._typing import Fn, M, P, R


class _Static(eqx.Module):
    """Non-array outputs, carried in the output's tree structure."""

    value: Any = eqx.field(static=True)


def _ready(slot: Memo) -> bool:
    """Whether `slot` needs neither allocation nor revival (the common case, checked fast:
    an empty slot may not need allocation, and is left to the slow path to decide)."""
    return slot.allocated and not (is_concrete_array(slot.value) and slot.value.is_deleted())


_SENTINEL: Any = object()


@overload
def jit(
    *, donate: bool = True
) -> Callable[[Fn[Concatenate[M, P], R]], Callable[Concatenate[M, P], tuple[R, M]]]: ...
@overload
def jit(
    fn: Fn[Concatenate[M, P], R], /, *, donate: bool = True
) -> Callable[Concatenate[M, P], tuple[R, M]]: ...
def jit(fn: Fn[Concatenate[M, P], R] = _SENTINEL, /, *, donate: Any = True) -> Any:
    """Compile `memox.call(module, fn, ...)`, with `eqx.filter_jit` semantics.

    Use it as `memox.jit(fn)`, `memox.jit(fn, donate=False)`, or as a decorator:
    `@memox.jit`, `@memox.jit(donate=False)`.

    **Arguments:**

    - `fn`: the function to run, called as `fn(module, *args, **kwargs)`. Left out, the
      call returns a decorator taking it (`@memox.jit(donate=False)`).
    - `donate`: a bool, whether the module's slot buffers are donated to the returned
      module (`True`, the default). A hit then copies nothing, where without donation
      XLA copies each slot's table (the cached values) into a fresh output buffer on
      every call. (Not `eqx.filter_jit`'s strings: `memox.jit` donates only slots.)
      Nothing you hold loses its arrays: a slot is donated only where nothing else
      holds its arrays, and the module you passed in is then given the returned slots
      (it stays usable, serialisable, and hits where its parameters match); where
      something else holds them (a module you kept from an earlier step, a list of
      leaves), that call donates a copy.

    Arrays anywhere in `module` and the arguments are traced; everything else is static.

    **Hits decided on the host:** where a slot and the arrays its check reads are the
    very arrays of the previous call (a frozen part, a threaded `module`), the call
    runs a second program, compiled at the second call, that reads the slot's value with
    no check and no `lax.cond`; anything new is checked in-graph. At most 4 programs per
    signature. `wrapped.lower(module, *args, **kwargs)` gives the program a call would
    run now (JAX's `Lowered`).

    **When to call `memox.init`:** not for `memox.jit`. Before the first trace, the
    module's empty slots for methods without arguments are allocated, so a loop
    `out, model = step(model, x)` does not retrace (the hit program above aside). A
    slot of a cached method that takes arguments (a keyed table) is allocated at its
    first fill, which changes its leaves from markers to arrays: one retrace, unless
    `memox.init(module, fn, *args)` ran first. (Elsewhere, under `jax.jit`,
    `eqx.filter_jit` or as a `lax.scan` carry, a module needs `memox.init` first.)

    **Returns:**

    A function `wrapped(module, *args, **kwargs) -> (result, new_module)`. The arrays of
    `new_module` other than its slots are the caller's own (no copy crosses the
    boundary). Without `fn`, a decorator that returns it.

    !!! Example

        ```python
        use_b = memox.jit(lambda f: f.b())
        b, foo = use_b(foo)   # a hit when `foo.a` has not changed

        @memox.jit(donate=False)   # the slots passed in keep their buffers
        def scaled_b(f, x):
            return f.b() * x

        y, foo = scaled_b(foo, jnp.float32(2.0))
        ```
    """
    if not isinstance(donate, bool):
        raise TypeError(_errors.JIT_DONATE.format(got=repr(donate)))
    if fn is _SENTINEL:
        return functools.partial(jit, donate=donate)
    check_fn("jit", fn)
    # Which input arrays cached methods fingerprinted (learned from the traces), and
    # their fingerprints per call, computed outside (`_prehash.py`).
    inputs = _prehash.Inputs()
    # Which slots hit, known before a call (`_prehash.Hits`).
    decided = _prehash.Hits()

    def slots_only(
        static: _Signature,
        hits: tuple,
        arrays: list,
        slot_leaves: list,
        kept: list,
        table: Any,
        indices: list,
    ) -> Any:
        slot_leaves = _refilled(len(arrays), hits, slot_leaves, kept)
        module, args, kwargs = static.rebuild(arrays, slot_leaves)
        flat = [*arrays, *(x for leaves in slot_leaves for x in leaves)]
        with _prehash.scope(flat, table, hits=dict(zip(hits, indices))) as scope:
            result, module, frame = run(module, fn, args, kwargs)
            inputs.learned(scope.used)
            changed = changed_slots(module, frame)
            final = [changed.get(path, slot) for path, slot in slots(module).items()]
            held = scope.held(final)
        # With donation every allocated slot goes out (an unchanged one aliases its
        # input); without, only the changed ones: an unchanged slot stays the caller's.
        new_slots = {
            k: slot
            for k, (path, slot) in enumerate(zip(slots(module), final))
            if (path in changed or donate) and slot.allocated
        }
        # Entries a hit decided on the host passed through are not outputs (XLA would
        # copy them): the wrapper gives back the caller's arrays.
        kept_by_value = {id(leaves[0]): n for n, leaves in enumerate(kept)}
        kept_at = {k: kept_by_value.get(id(slot.value)) for k, slot in new_slots.items()}
        kept_at = {k: n for k, n in kept_at.items() if n is not None}
        for k in kept_at:
            new_slots[k] = _without_entries(new_slots[k])
        dynamic, static_out = eqx.partition(result, eqx.is_array)
        vouched = tuple((h, k) for h, k, _ in held)
        static_out = _Static((static_out, vouched, tuple(kept_at.items())))
        return dynamic, static_out, new_slots, [i for _, _, i in held]

    compiled = jax.jit(slots_only, static_argnums=(0, 1), donate_argnums=(3,) if donate else ())

    def prepared(module: Any, args: tuple, kwargs: dict, donating: bool) -> tuple:
        """A call taken apart: the split, the module it was given where its slots had to
        be allocated or revived, the hits decided on the host, the entries passed apart,
        and the arguments of the compiled function."""
        split = _Signature.split(module, args, kwargs, donating)
        if jtu.treedef_is_leaf(split.signature.module):
            check_module("jit", module)
        given = None
        if not split.ready:  # rare: allocate, or revive
            given, module = module, latest.get(module) or allocated(module)
            split = _Signature.split(module, args, kwargs, donating)
        arrays = split.arrays
        hits, indices = decided.decide(split.signature, split.flat())
        slot_leaves, kept = split.parted(hits)
        if donating:
            slot_leaves = split.donated(slot_leaves)
        table = inputs.table(arrays)
        call = (split.signature, hits, arrays, slot_leaves, kept, table, indices)
        return split, given, kept, call

    @functools.wraps(fn)
    def wrapped(module: M, /, *args: P.args, **kwargs: P.kwargs) -> tuple[R, M]:
        split, given, kept, call = prepared(module, args, kwargs, donate)
        try:
            dynamic, static_out, new_slots, held_indices = compiled(*call)
        except BaseException:  # (a failure after the donation: the nodes get empty slots)
            split.hand_over_empty()
            raise
        inputs.register(split.arrays)
        result, vouched, kept_at = static_out.value
        for k, n in kept_at:
            new_slots[k] = _with_entries(new_slots[k], kept[n])
        vouched = [
            (h, entry_leaves(new_slots[k]), i)
            for (h, k), i in zip(vouched, held_indices)
            if k in new_slots  # (a vouched slot was written, so it is returned)
        ]
        decided.learn(split.signature, vouched, split.flat())
        new_module = split.put(new_slots)
        split.hand_over(new_slots)
        if given is not None:
            latest.put(given, new_module)
        return eqx.combine(dynamic, result), new_module

    def lower(module: M, /, *args: P.args, **kwargs: P.kwargs) -> jax.stages.Lowered:
        """The program that `wrapped(module, *args, **kwargs)` would run now, lowered
        (as `jax.jit(...).lower`): with the hits it would decide on the host."""
        return compiled.lower(*prepared(module, args, kwargs, False)[3])

    wrapped.lower = lower  # pyright: ignore[reportAttributeAccessIssue]
    # A module passed again with its slots empty, as by a caller that does not thread
    # the returned module: the slots the last call on it returned, not a new allocation
    # (which also recomputes what they hold).
    latest = ByIdentity()
    return wrapped


# -- who holds a slot's arrays ------------------------------------------------------------


def _references(leaves: list, j: int) -> int:
    """`sys.getrefcount` of `leaves[j]`, counted the same way wherever it is called from
    (compared with `_HELD_ONCE` only, which this same function measured)."""
    x = leaves[j]
    return sys.getrefcount(x)


def _calibrated() -> int:
    """`_references` of an object held by one list and by one other object: a slot's
    array held by its `Memo` node and by the list of leaves flattened from it."""
    probe = object()
    node, leaves = [probe], [probe]
    del probe
    found = _references(leaves, 0)
    del node
    return found


_HELD_ONCE = _calibrated()


def _held_once(leaves: list, a: int, b: int) -> bool:
    """Whether the concrete arrays `leaves[a:b]` (one slot's) are each held by one object
    besides `leaves` (the node they were flattened from) and by nothing else."""
    if not is_concrete_array(leaves[a]):  # (a slot is concrete or traced as a whole)
        return False
    for j in range(a, b):
        if _references(leaves, j) != _HELD_ONCE:
            return False
    return True


def _concrete(leaves: list[Any]) -> bool:
    """Whether one slot's leaves (a slot is concrete or traced as a whole) are concrete."""
    return is_concrete_array(next(x for x in leaves if x is not None))


_SLOT_FIELDS = tuple(field.name for field in dataclasses.fields(Memo))


def _hand_over(node: Memo, new: Memo) -> None:
    """Give `node`, whose arrays were donated, the arrays of the slot returned in their
    place: every object reaching it (a module the caller kept) reads the slot as the
    call left it. (A slot is an immutable pytree node to everything else; this is the
    one place memox sets its fields, and only on arrays it has just consumed.)"""
    fields = object.__getattribute__(new, "__dict__")  # (`eqx.Module`'s own is slower)
    target = object.__getattribute__(node, "__dict__")
    for name in _SLOT_FIELDS:
        target[name] = fields[name]


def _without_entries(slot: Memo) -> Memo:
    """`slot` with its entries `None`: what leaves the compiled function for a slot whose
    hit was decided on the host (its entries are the caller's arrays, given back)."""
    return _replaced(slot, dict.fromkeys(ENTRY_FIELDS))


def _with_entries(slot: Memo, entries: list[Any]) -> Memo:
    """`slot` (from `_without_entries`) with `entries` (`entry_leaves` of the slot passed
    in) put back."""
    return _replaced(slot, dict(zip(ENTRY_FIELDS, entries)))


def _replaced(slot: Memo, fields: dict[str, Any]) -> Memo:
    """A copy of `slot` with `fields` replaced, its converters and checks not run again
    (as `jtu.tree_unflatten` makes a module)."""
    new = object.__new__(type(slot))
    target = object.__getattribute__(new, "__dict__")
    target.update(object.__getattribute__(slot, "__dict__"))
    target.update(fields)
    return new


def _starts(first: int, slot_leaves: list[list[Any]]) -> dict[int, int]:
    """The position of each slot's first leaf among a call's flat inputs (its arrays,
    then the slots' leaves), to the slot's index."""
    starts = {}
    for i, leaves in enumerate(slot_leaves):
        starts[first] = i
        first += len(leaves)
    return starts


def _refilled(n_arrays: int, hits: tuple, slot_leaves: list, kept: list) -> list:
    """The slots' leaves with the entries of the slots whose hits were decided on the host
    (passed apart, in `kept`) put back."""
    if not hits:
        return slot_leaves
    out = list(slot_leaves)
    starts = _starts(n_arrays, slot_leaves)
    for positions, entries in zip(hits, kept):
        i = starts[positions[0]]
        leaves = list(out[i])
        for p, x in zip(positions, entries):
            leaves[p - positions[0]] = x
        out[i] = leaves
    return out


_ARRAY = object()  # marks a leaf passed as an array
# What `eqx.is_array` accepts, inlined (called on every leaf at every call; pinned by
# `test_jit.py` against `eqx.is_array`).
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
_MEMO_TYPES = Cache("memo types", 4096)  # type -> whether it is a `Memo`


def _is_memo(x: Any) -> bool:
    """`is_memo`, with the answer kept per type (`isinstance` on an `eqx.Module` class
    goes through `ABCMeta`: called on every node of the module at every call)."""
    kind = type(x)
    found = _MEMO_TYPES.get(kind)
    if found is None:
        found = _MEMO_TYPES.put(kind, is_memo(x))
    return found


@dataclasses.dataclass(frozen=True)
class _SlotLeaf:
    """Marks leaf `j` of an allocated slot, passed in the `index`-th list of slot leaves
    (a slot object found at several paths, as in a shared submodule, is passed once: a
    buffer can be donated only once)."""

    index: int
    j: int


_SLOT_LEAVES = Cache("slot leaf markers", 1 << 16)  # (index, j) -> _SlotLeaf


def _slot_leaf(index: int, j: int) -> _SlotLeaf:
    """The marker, the same object at every call (compared by identity first when
    `jax.jit` looks its signature up)."""
    found = _SLOT_LEAVES.get((index, j))
    if found is None:
        found = _SLOT_LEAVES.put((index, j), _SlotLeaf(index, j))
    return found


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the slots are in a module of one tree structure, in flattening order: the
    range of leaves of each (`(-1, -1)` where it has none), and its path."""

    ranges: tuple[tuple[int, int], ...]
    paths: tuple[Path, ...]

    def node(self, module: Any, k: int) -> Any:
        """The `k`-th slot node of `module` (None where its path cannot be followed)."""
        node = module
        try:
            for entry in self.paths[k]:
                if isinstance(entry, jtu.GetAttrKey):  # a field (`eqx.Module`'s is slower)
                    node = object.__getattribute__(node, entry.name)
                else:
                    node = child(node, entry)
        except Exception:
            return None
        return node


_layouts = Cache("layouts", 1024)  # PyTreeDef -> _Layout | None


def _layout(treedef: Any) -> _Layout | None:
    """The layout of a module of structure `treedef` (computed once per structure, by
    rebuilding the module with integers for leaves; None where its nodes refuse that)."""
    if treedef in _layouts:
        return _layouts[treedef]
    found: _Layout | None
    try:
        tree = jtu.tree_unflatten(treedef, range(treedef.num_leaves))
        ranges, paths = [], []
        for path, x in jtu.tree_flatten_with_path(tree, is_leaf=is_memo)[0]:
            if is_memo(x):
                idx: list[int] = jtu.tree_leaves(x)
                ranges.append((idx[0], idx[-1] + 1) if idx else (-1, -1))
                paths.append(path)
        found = _Layout(tuple(ranges), tuple(paths))
    except Exception:  # a node that checks its leaves: the general path
        found = None
    return _layouts.put(treedef, found)


@dataclasses.dataclass
class _Split:
    """A call taken apart: the signature, the arrays, the slots' leaves (one list per
    slot), a function putting new slots (by index in flattening order) into the module,
    whether every slot is ready (needs neither allocation nor revival), and, with
    donation, the slots to hand over: per list of leaves, the `Memo` node that alone
    holds them (None where something else holds them too), and the index of its slot."""

    signature: _Signature
    arrays: list[Any]
    slot_leaves: list[list[Any]]
    put: Callable[[dict[int, Memo]], Any]
    ready: bool
    owners: list[Memo | None]
    first: list[int]

    def flat(self) -> list[Any]:
        """The call's input arrays in one list: the arrays, then the slots' leaves (the
        positions `_prehash.Hits` and the trace's `Scope` agree on)."""
        return [*self.arrays, *(x for leaves in self.slot_leaves for x in leaves)]

    def parted(self, hits: tuple) -> tuple[list[list[Any]], list[list[Any]]]:
        """The slots' leaves, with `None` for the entries of each slot whose hit was
        decided on the host, and those entries (passed apart: read, not donated)."""
        if not hits:
            return self.slot_leaves, []
        out = list(self.slot_leaves)
        starts = _starts(len(self.arrays), out)
        kept = []
        for positions in hits:
            i = starts[positions[0]]
            at = {p - positions[0] for p in positions}
            kept.append([x for j, x in enumerate(out[i]) if j in at])
            out[i] = [None if j in at else x for j, x in enumerate(out[i])]
        return out, kept

    def donated(self, slot_leaves: list[list[Any]]) -> list[list[Any]]:
        """`slot_leaves` to donate: a copy of those that something else holds (none in
        the threaded loop; traced ones are not donated: an outer trace's)."""
        if all(owner is not None for owner in self.owners):
            return slot_leaves
        return [
            leaves if owner is not None or not _concrete(leaves) else copied(leaves)
            for leaves, owner in zip(slot_leaves, self.owners)
        ]

    def hand_over(self, new_slots: dict[int, Memo]) -> None:
        """Give each donated slot node the slot returned in its place."""
        for owner, k in zip(self.owners, self.first):
            if owner is not None and k in new_slots:
                _hand_over(owner, new_slots[k])

    def hand_over_empty(self) -> None:
        """Where the call failed after consuming a donated slot: give its node an empty
        allocation of the same shapes (it recomputes; nothing the caller holds breaks)."""
        for owner, leaves in zip(self.owners, self.slot_leaves):
            if owner is not None and any(x.is_deleted() for x in leaves):
                _hand_over(owner, jtu.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), owner))


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
    def split(cls, module: Any, args: tuple, kwargs: dict, donate: bool) -> _Split:
        leaves, treedef = jtu.tree_flatten(module)
        layout = _layout(treedef)
        if layout is None:
            del leaves  # (it holds the slots' arrays: `_split_nested` counts who does)
            return cls._split_nested(module, args, kwargs, donate)
        # Before anything else holds them: which slots' arrays their node alone holds.
        alone = [donate and a >= 0 and _held_once(leaves, a, b) for a, b in layout.ranges]
        statics: list[Any] = leaves[:]
        in_slot = [False] * len(leaves)
        slot_leaves: list[list[Any]] = []
        owners: list[Memo | None] = []
        first: list[int] = []
        seen: dict[int, int] = {}
        ready = True
        for k, (a, b) in enumerate(layout.ranges):
            if a < 0 or not isinstance(leaves[a], ARRAY_TYPES):  # empty, or filtered out
                ready = False
                continue
            value = leaves[a]
            if is_concrete_array(value) and value.is_deleted():
                ready = False
            index = seen.setdefault(id(value), len(slot_leaves))
            if index == len(slot_leaves):
                slot_leaves.append(leaves[a:b])
                node = layout.node(module, k) if alone[k] else None
                owned = is_memo(node) and object.__getattribute__(node, "value") is value
                owners.append(node if owned else None)
                first.append(k)
            for j in range(b - a):
                statics[a + j] = _slot_leaf(index, j)
                in_slot[a + j] = True
        arrays: list[Any] = []
        for i, x in enumerate(leaves):
            if not in_slot[i] and isinstance(x, ARRAY_TYPES):
                arrays.append(x)
                statics[i] = _ARRAY
        arg_statics, arg_treedef = cls._arguments(args, kwargs, arrays)

        def put(new_slots: dict[int, Memo]) -> Any:
            new = {k: jtu.tree_leaves(slot) for k, slot in new_slots.items()}
            if any(len(x) != b - a for k, x in new.items() for a, b in [layout.ranges[k]]):
                # A slot the call allocated (an unused snapshot's marker became `None`):
                # the structure changed there.
                tree = jtu.tree_unflatten(treedef, leaves)
                return replace_slots(tree, {layout.paths[k]: s for k, s in new_slots.items()})
            for k, x in new.items():
                a, b = layout.ranges[k]
                leaves[a:b] = x
            return jtu.tree_unflatten(treedef, leaves)

        signature = cls(treedef, tuple(statics), arg_treedef, arg_statics)
        return _Split(signature, arrays, slot_leaves, put, ready, owners, first)

    @classmethod
    def _split_nested(cls, module: Any, args: tuple, kwargs: dict, donate: bool) -> _Split:
        """`split` for a module whose structure cannot be rebuilt from placeholders:
        slots found as nodes (slower: a Python test on every node)."""
        leaves, treedef = jtu.tree_flatten(module, is_leaf=_is_memo)
        arrays: list[Any] = []
        slot_leaves: list[list[Any]] = []
        owners: list[Memo | None] = []
        first: list[int] = []
        seen: dict[int, int] = {}
        statics, memos, ready = [], [], True
        for i, x in enumerate(leaves):
            if _is_memo(x):
                ready = ready and _ready(x)
                if not x.allocated:
                    statics.append(x)
                    memos.append(i)
                    continue
                if id(x) not in seen:
                    one_slot, slot_treedef = jtu.tree_flatten(x)
                    alone = donate and _held_once(one_slot, 0, len(one_slot))
                    seen[id(x)] = len(slot_leaves)
                    slot_leaves.append(one_slot)
                    owners.append(x if alone else None)
                    first.append(len(memos))
                statics.append(_Slot(jtu.tree_structure(x), seen[id(x)]))
                memos.append(i)
            elif isinstance(x, ARRAY_TYPES):
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
        return _Split(signature, arrays, slot_leaves, put, ready, owners, first)

    @staticmethod
    def _arguments(args: tuple, kwargs: dict, arrays: list[Any]) -> tuple[tuple, Any]:
        arg_leaves, arg_treedef = jtu.tree_flatten((args, kwargs))
        statics = []
        for x in arg_leaves:
            if isinstance(x, ARRAY_TYPES):
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
