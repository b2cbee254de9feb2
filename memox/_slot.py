"""`Memo`: the cache slot, a fixed-shape table of stored values.

A slot is an ordinary pytree node with four fields and one static field, `size` (the
number of entries `K`, 1 unless declared `Memo(size=K)`). Empty (`Memo()`), each field
holds the `EMPTY` marker, the integer 0 marked as such. Allocated, the fields are
fixed-shape arrays whatever the slot's state:

- per entry (leading axis `K`): `value`, the value's bits (see `_storage.py`); `key`,
  the 64-bit fingerprint it was computed from, all zeros where the entry holds nothing
  (no key is: `_fingerprint.combine`), so that whether an entry is valid is read from
  its key and costs no array of its own; `snapshot`, the dependencies' bytes where the
  policy keeps them (`Drift`; under every other policy `None`, no leaf: checkpointers
  refuse a zero-size array);
- `counts`, every counter in one `int32` array of `K + 1` rows: per entry its age (hits
  since it was stored) and when it was last used (least-recently-used eviction), then
  the slot's hits and misses. A hit moves counters only, so it writes one array
  (`memox.jit` returns one buffer per slot, where XLA runs each output as an operation
  of its own). Read them as `age`, `used`, `hits` and `misses`.

No leaf is an inexact array: slots are invisible to `eqx.filter(...,
eqx.is_inexact_array)`, to `eqx.filter_grad` and to every optax optimizer. A slot has no
metadata that depends on its contents (how to decode `value` is known to the cached
method), so allocating, filling, hitting and invalidating never change the tree
structure: a filter spec or an optimizer state made from a freshly constructed model
fits it for good (an empty field is a leaf where the allocated slot has an array, and
an unused `snapshot` is `None` in both once filtered), and an allocated slot is legal as
a `lax.scan` carry and never retraces.

The marker is an integer so that every checkpointer writes a model with empty slots, or
a `memox.strip`ped one, as it is and reads it back (orbax and Equinox rebuild a leaf as
`type(like)(value)`), and `eqx.filter_jit` treats it as static. Passed through `jax.jit`
or `lax.scan` it becomes a traced integer, which memox cannot allocate in place (a loop
carry would change type): `allocate` refuses it, naming `memox.init`. One rule says
whether a slot is allocated, for every path (`is_value_table`, read by `Memo.allocated`
and by the compiled wrappers' splits): while its `value` has the entries' axis. A 0-d
value is the marker in whatever container it came back (`jax.device_put`,
`jnp.asarray`, a checkpoint restored into `jax.eval_shape`'s target): an empty slot.

What is done to a slot's tables (allocation, lookup, store, invalidation) is in
`_table.py`; where the slots of a pytree are, in `_sites.py`.
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Int, UInt8, UInt32

from . import _errors
from ._storage import Spec, storage_struct


T = TypeVar("T")

# Validated by `Memo.__check_init__` with a message that says what to do; typed for
# static checkers only, so that a runtime type checker does not answer first.
if TYPE_CHECKING:
    Size: typing.TypeAlias = int
else:
    Size = Any


class _Empty(int):
    """The fields of an empty slot: the integer 0, marked.

    A leaf, where an allocated slot has its arrays: `eqx.filter(model, ...)` takes both
    out alike, so a filter spec or an optimizer state made from a freshly constructed
    model fits the model once allocated. An integer: every checkpointer writes it and
    reads it back (orbax and Equinox rebuild a leaf as `type(like)(value)`: the marker),
    and `eqx.filter_jit` treats it as static. Through `jax.jit` or `lax.scan` it becomes
    a traced 0-d integer, which `allocate` refuses with the fix."""

    _instance: _Empty | None = None

    def __new__(cls, _value: int = 0) -> _Empty:
        if cls._instance is None:
            cls._instance = super().__new__(cls, 0)
        return cls._instance

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _empty, ()

    def __repr__(self) -> str:
        return (
            "<empty memox.Memo slot: allocate it first with `module = memox.init(module)`, "
            "or `memox.init(module, fn, *args)` for a method that takes arguments>"
        )


_Empty.__module__ = "memox"
_Empty.__qualname__ = _Empty.__name__ = "EmptySlot"

EMPTY = _Empty()

# A field of a slot: `Leaf[X]` is the array `X` once the slot is allocated, the `EMPTY`
# marker before (or `None` where `eqx.filter` took the slot out), and is checked as
# exactly that at run time. Static checkers see `X | Any`: memox reads a slot's leaves
# only where `slot.allocated` holds, which they cannot narrow the leaves by.
if TYPE_CHECKING:
    Leaf: typing.TypeAlias = T | Any
else:

    class Leaf:
        def __class_getitem__(cls, array: Any) -> Any:
            return array | _Empty | None


def _empty() -> _Empty:
    return EMPTY


class Memo(eqx.Module, Generic[T]):
    """A cache slot. Declare one per cached method, as a field of an `eqx.Module`.

    `Memo[T]` annotates the field (`T` is the type of the cached value); `Memo()` is the
    empty slot, usable as the field's default. `Memo(size=K)` is a table of `K` entries,
    keyed by the method's arguments, with least-recently-used eviction. A slot is filled
    by `memox.call` or `memox.jit` when its cached method runs, allocated in advance by
    `memox.init`, invalidated by `memox.clear`, and read by `memox.stats`. Its contents
    are integer and boolean arrays only, so optimizers and `eqx.filter_grad` never see
    them. A field declared `Memo[T] | None` may hold `None`: that instance has no slot,
    and its cached method computes at every call, with no warning.

    !!! Example

        ```python
        class Foo(eqx.Module):
            a: jax.Array
            b_cache: memox.Memo[jax.Array] = memox.Memo()

            @memox.cached("b_cache")
            def b(self):
                return jnp.sum(self.a)
        ```
    """

    # Per entry (leading axis `size`):
    value: Leaf[Array] = EMPTY
    key: Leaf[UInt32[Array, "K 2"]] = EMPTY  # all zeros: no entry
    # Per entry (age, last use), then for the slot (hits, misses):
    counts: Leaf[Int[Array, "rows 2"]] = EMPTY
    snapshot: Leaf[UInt8[Array, "K bytes"]] = EMPTY
    size: Size = eqx.field(static=True, default=1)

    # Python's own attribute lookup: a slot's fields are read at every call (by JAX's
    # flatten of every module holding one, among others), and `eqx.Module`'s, which
    # wraps methods as pytrees for `jax.jit`, is a Python function per read. A slot's
    # methods are memox's own, never passed to a transformation.
    __getattribute__ = object.__getattribute__

    def __set_name__(self, owner: type, name: str) -> None:
        # A slot declared with a default (`b_cache: Memo[...] = Memo()`) becomes a field
        # whose default is set on every instance, even by a custom `__init__` that does
        # not assign it (Equinox sets a field with a converter after `__init__`; a plain
        # default would be missing from the instance and its pytree).
        if (
            isinstance(owner, type)
            and issubclass(owner, eqx.Module)
            and "__dataclass_fields__" not in owner.__dict__
            and name in annotations_of(owner)
        ):
            setattr(owner, name, eqx.field(default=self, converter=_as_slot))

    def __check_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(_errors.BAD_SIZE.format(size=self.size))

    @property
    def allocated(self) -> bool:
        """Whether the slot holds its tables (`False` when empty, or when filtered out):
        `is_value_table(self.value)`."""
        return is_value_table(self.value)

    @property
    def valid(self) -> Array:
        """Per entry, whether it holds a value: its key is not all zeros."""
        return jnp.any(self.key != 0, axis=-1)

    @property
    def age(self) -> Array:
        """Per entry, the hits since it was stored."""
        return self.counts[..., :-1, 0]

    @property
    def used(self) -> Array:
        """Per entry, the count of hits and misses when it was last used."""
        return self.counts[..., :-1, 1]

    @property
    def hits(self) -> Array:
        """The slot's hits."""
        return self.counts[..., -1, 0]

    @property
    def misses(self) -> Array:
        """The slot's misses."""
        return self.counts[..., -1, 1]

    @property
    def snapshot_bytes(self) -> int | None:
        """The bytes of the snapshot table's rows (None: no snapshot table)."""
        return self.snapshot.shape[1] if eqx.is_array(self.snapshot) else None

    def holds(self, spec: Spec, snapshot_bytes: int | None) -> bool:
        """Whether this slot is allocated for values of `spec` (and such snapshots; None:
        no snapshot table)."""
        if not self.allocated:
            return False
        shape, dtype = storage_struct(spec)
        return (self.value.shape, self.value.dtype, self.snapshot_bytes) == (
            (self.size, *shape),
            dtype,
            snapshot_bytes,
        )


# The constructor to call is `Memo()` or `Memo(size=K)`: memox fills the other fields.
# `help(memox.Memo)` and the API reference show that signature.
setattr(
    Memo.__init__,
    "__signature__",
    inspect.Signature(
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("size", inspect.Parameter.KEYWORD_ONLY, default=1, annotation=int),
        ]
    ),
)


def is_value_table(value: Any) -> bool:
    """Whether `value`, a slot's `value` field (its first leaf), is an allocated slot's
    table: entries along a leading axis. The one test of allocation. Not the `EMPTY`
    marker, as declared or as the 0-d array it comes back as (from `jax.device_put`,
    `jnp.asarray`, `jax.eval_shape`, a checkpoint; concrete or traced), nor `None`."""
    return getattr(value, "ndim", 0) > 0


def _as_slot(x: T) -> T:
    """The converter of a slot field: the value as given (see `Memo.__set_name__`)."""
    return x


def annotations_of(cls: type) -> dict[str, Any]:
    """The annotations `cls` itself declares (Python 3.14's lazy annotations too:
    unresolvable names come back as forward references)."""
    if sys.version_info >= (3, 14):
        import annotationlib

        return dict(annotationlib.get_annotations(cls, format=annotationlib.Format.FORWARDREF))
    return dict(cls.__dict__.get("__annotations__", {}))


def is_memo_annotation(annotation: Any) -> bool:
    """Whether a field annotation declares a slot: `Memo`, `Memo[...]`, or either or
    `None` (`Memo[...] | None`, `Optional[Memo[...]]`), as a string too (the same answer
    with and without `from __future__ import annotations`)."""
    members = _union_members(annotation)
    kinds = [_is_memo_type(m) for m in members]
    return any(kinds) and all(kind or _is_none(m) for kind, m in zip(kinds, members))


def admits_none(annotation: Any) -> bool:
    """Whether a slot's annotation lets the field hold `None` (`Memo[...] | None`): that
    instance has no slot, by design."""
    return any(map(_is_none, _union_members(annotation)))


def _union_members(annotation: Any) -> list[Any]:
    """The members of a union annotation (`A | B`, `Optional[A]`, `Union[A, B]`, as
    objects or as a string), else `[annotation]`."""
    name = getattr(annotation, "__forward_arg__", None)
    if isinstance(name, str):
        annotation = name
    if not isinstance(annotation, str):
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            # (a member may itself be a forward reference: Python 3.14's lazy annotations)
            return [m for arg in typing.get_args(annotation) for m in _union_members(arg)]
        return [annotation]
    text = annotation.strip()
    members = _top_level(text, "|")
    if len(members) > 1:
        return [m for member in members for m in _union_members(member)]
    head, _, rest = text.partition("[")
    head = head.strip().split(".")[-1]
    if head in ("Optional", "Union") and rest.endswith("]"):
        inner = _top_level(rest[:-1], ",")
        return [*inner, "None"] if head == "Optional" else inner
    return [text]


def _is_memo_type(member: Any) -> bool:
    if isinstance(member, str):
        return member.partition("[")[0].strip().split(".")[-1] == "Memo"
    return member is Memo or typing.get_origin(member) is Memo


def _is_none(member: Any) -> bool:
    return member is None or member is type(None) or (isinstance(member, str) and member == "None")


def _top_level(text: str, sep: str) -> list[str]:
    """`text` split at each `sep` outside brackets, each part stripped."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


# The fields that hold entries, which a hit leaves as they were (`snapshot`, `None` where
# unused, last); the rest, `counts`, holds the counters.
ENTRY_FIELDS = ("value", "key", "snapshot")
FIELDS = ("value", "key", "counts", "snapshot")


def is_memo(x: object) -> bool:
    """Whether `x` is a `memox.Memo` slot: the `is_leaf` to stop a tree walk at slots.

    !!! Example

        ```python
        assert memox.internal.is_memo(foo.b_cache) and not memox.internal.is_memo(foo.a)
        ```
    """
    return isinstance(x, Memo)


def fields_of(slot: Memo) -> dict[str, Any]:
    """A slot's fields by name, read directly: Equinox reads each through
    `Module.__getattribute__`, and the compiled wrappers read a slot's at every call."""
    return object.__getattribute__(slot, "__dict__")


def replaced(slot: Memo, fields: dict[str, Any]) -> Memo:
    """A copy of `slot` with `fields` replaced, its converters and checks not run again
    (as `jtu.tree_unflatten` makes a module; `dataclasses.replace` runs Equinox's
    `__init__`): memox's own changes to a slot's arrays."""
    new = object.__new__(type(slot))
    target = object.__getattribute__(new, "__dict__")
    target.update(fields_of(slot))
    target.update(fields)
    return new


def leaves_of(slot: Memo) -> list[Any]:
    """`jtu.tree_leaves(slot)` of a slot whose fields are leaves or `None` (as every slot
    a compiled wrapper returns), without Equinox's flatten."""
    if type(slot) is not Memo:
        return jtu.tree_leaves(slot)
    fields = fields_of(slot)
    return [x for f in FIELDS if (x := fields[f]) is not None]


def is_empty(x: Any) -> bool:
    """Whether `x` is a slot still to allocate: its fields the marker, as declared or in
    whatever container they came back (not a filter's image of a slot, whose fields are
    `None`)."""
    return isinstance(x, Memo) and x.value is not None and not x.allocated
