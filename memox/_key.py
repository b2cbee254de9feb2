"""The cache key: exactly what a stored value may be reused for.

**The rule.** A stored value is reused only when everything the method's output can
depend on is the same as when it was computed:

1. the *abstract type* of every array the method receives: each array of the module
   (`self` and its submodules, whether the method reads it or not) and each array
   argument: shape, dtype, weak type, and sharding where it is part of the type
   (`Explicit` mesh axes, `shard_map`'s varying axes);
2. the *values* (bits) of the arrays the method reads, and of its array arguments:
   a fingerprint (`_fingerprint.py`). Policies (`Exact`, `Drift`, `Manual`) relax this
   part only, for the module's arrays;
3. the *non-array parts*: the method, the module's tree structure with its static
   fields, its non-array leaves (activation functions, flags, ...), and the method's
   non-array arguments and their structure, compared by equality (`==` and `hash`, with
   the type: the semantics `jax.jit` gives static arguments), never by `repr`.

(1) and (3) are known when the method is traced: together they are the *static key*,
which also selects the method's plan, and whose 64-bit digest salts the fingerprint of
(2). This module computes it, in one place.

**Equality, and across processes.** Each non-array part is encoded canonically
(`_Encoder`): plain values (None, bool, int, float, complex, str, bytes; tuples, lists,
dicts and sets of them; NumPy arrays and scalars, dtypes, enum members,
`functools.partial` of such parts), functions and classes importable under their
qualified name, and stateless objects of such classes encode to the same bytes in every
process: a slot restored from a checkpoint in another process still hits. Anything else
(a lambda, a closure, a dataclass instance, an object compared by identity or by its own
`__eq__`) is interned in this process's table by equality and encoded by its entry
number; the digest of a key holding any such part is also salted with a per-process
nonce, so a slot restored in another process never hits on a part it cannot prove
equal: it recomputes. A part that is neither hashable nor a plain value cannot be
compared safely and is refused (`jax.jit` refuses it too).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import itertools
import os
import struct
import sys
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.tree_util as jtu
import numpy as np

from . import _errors, _jax_internals


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


# -- (1) the abstract type of an array -------------------------------------------------


def signature(x: Any) -> tuple[Any, ...]:
    """The abstract type of array `x` as the key sees it: shape, dtype, weak type,
    sharding where it is part of the type (`Explicit` mesh axes) and `shard_map`'s
    varying axes. Hashable, equal for arrays of the same type."""
    aval = jax.typeof(x)
    weak = bool(getattr(aval, "weak_type", False))
    sharding = explicit_sharding(aval)
    placed = None if sharding is None else _sharding_parts(sharding)
    return (tuple(aval.shape), str(aval.dtype), weak, placed, varying(aval))


def _sharding_parts(sharding: Any) -> tuple[Any, ...]:
    """A `NamedSharding` as plain values: mesh axes, sizes and types, and the spec."""
    mesh = sharding.mesh
    spec = tuple(e if e is None or isinstance(e, str) else tuple(e) for e in sharding.spec)
    types = tuple(str(t) for t in mesh.axis_types)
    return tuple(mesh.axis_names), tuple(mesh.axis_sizes), types, spec


def explicit_sharding(aval: Any) -> Any:
    """The sharding of `aval` where its mesh has `Explicit` axes (part of the type
    there), else `None` (placement only: XLA propagates it, the value is the same)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return None
    return sharding


def varying(aval: Any) -> tuple[str, ...]:
    """The `shard_map` mesh axes `aval` varies over (empty outside `shard_map`), sorted."""
    return tuple(sorted(map(str, _jax_internals.varying_axes(aval))))


# -- (3) non-array parts, by equality --------------------------------------------------


class _Local:
    """This process's table of non-array parts without a canonical encoding, by
    equality: equal parts get the same entry number, distinct ones distinct numbers.

    Entries keep their parts alive (an entry number is never reused). The table is
    bounded: when full it starts afresh with new numbers, which only costs misses."""

    _MAX = 1 << 16

    def __init__(self) -> None:
        self._entries: dict[Any, int] = {}
        self._numbers = itertools.count()

    def number(self, part: Any) -> int:
        key = (type(part), part)
        found = self._entries.get(key)
        if found is None:
            if len(self._entries) >= self._MAX:
                self._entries.clear()
            found = self._entries[key] = next(self._numbers)
        return found


_LOCAL = _Local()
_NONCE = os.urandom(16)


class _Encoder:
    """The canonical bytes of one static key; `local` says whether some part was
    encoded by this process's table (then the digest is salted with the nonce)."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.local = False

    def tag(self, tag: bytes, payload: bytes = b"") -> None:
        self.out.append(tag + struct.pack("<Q", len(payload)) + payload)

    def encode(self, x: Any) -> None:
        kind = type(x)
        plain = _plain_repr(x)
        if plain is not None:  # the common case, in one step
            self.tag(b"r", plain.encode("utf-8", "surrogatepass"))
        elif x is None or kind is bool:
            self.tag(b"c", repr(x).encode())
        elif kind is int:
            self.tag(b"i", str(x).encode())
        elif kind is float:
            self.tag(b"f", struct.pack("<d", x))
        elif kind is complex:
            self.tag(b"z", struct.pack("<dd", x.real, x.imag))
        elif kind is str:
            self.tag(b"s", x.encode("utf-8", "surrogatepass"))
        elif kind is bytes:
            self.tag(b"b", x)
        elif kind in (tuple, list):
            self.sequence(b"t" if kind is tuple else b"l", x)
        elif kind is dict:
            self.unordered(b"d", [(k, v) for k, v in x.items()])
        elif kind in (set, frozenset):
            self.unordered(b"S", list(x))
        elif isinstance(x, jtu.PyTreeDef):
            self.treedef(x)
        elif isinstance(x, (np.ndarray, np.generic)) or _is_concrete_jax_array(x):
            self.array(np.asarray(x))
        elif isinstance(x, np.dtype):
            self.tag(b"D", str(x).encode())
        else:
            self.other(x)

    def sequence(self, tag: bytes, xs: Sequence[Any]) -> None:
        self.tag(tag, struct.pack("<Q", len(xs)))
        for x in xs:
            self.encode(x)

    def unordered(self, tag: bytes, xs: list[Any]) -> None:
        """A dict's items or a set's elements, in an order that does not depend on
        insertion (by their own encodings)."""
        encoded = []
        for x in xs:
            sub = _Encoder()
            sub.encode(x)
            self.local |= sub.local
            encoded.append(b"".join(sub.out))
        self.tag(tag, struct.pack("<Q", len(encoded)))
        self.out.extend(sorted(encoded))

    def treedef(self, treedef: Any) -> None:
        data = treedef.node_data()
        if data is None:
            self.tag(b"*")
            return
        node_type, aux = data
        children = treedef.children()
        self.tag(b"T", struct.pack("<Q", len(children)))
        self.encode(node_type)
        self.encode(aux)
        for child in children:
            self.treedef(child)

    def array(self, x: np.ndarray) -> None:
        if x.dtype.hasobject:
            self.other(x)
            return
        header = f"{x.dtype.str}{x.shape}".encode()
        self.tag(b"A", header + np.ascontiguousarray(x).tobytes())

    def other(self, x: Any) -> None:
        name = importable_name(x)
        if name is not None:
            self.tag(b"n", name.encode())
        elif isinstance(x, enum.Enum):
            self.encode(type(x))
            self.tag(b"e", x.name.encode())
        elif isinstance(x, functools.partial):
            self.tag(b"p")
            self.encode(x.func)
            self.encode(x.args)
            self.encode(x.keywords)
        elif _stateless(x):
            self.encode(type(x))
            self.tag(b"o")
        else:
            self.local_part(x)

    def local_part(self, x: Any) -> None:
        try:
            number = _LOCAL.number(x)
        except TypeError:
            raise TypeError(_errors.UNHASHABLE_STATIC.format(type=type(x).__qualname__)) from None
        self.local = True
        self.tag(b"L", struct.pack("<Q", number))


_SCALARS = (type(None), bool, int, float, complex, str)


def _plain_repr(x: Any) -> str | None:
    """`repr(x)` where it is canonical (exact and type-distinguishing): for None, bools,
    ints, floats, complex numbers and strings, and tuples of them. Else `None`."""
    kind = type(x)
    if kind in _SCALARS:
        return repr(x)
    if kind is tuple and all(type(e) in _SCALARS or _plain_repr(e) is not None for e in x):
        return repr(x)
    return None


def _is_concrete_jax_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def importable_name(x: Any) -> str | None:
    """`module:qualname` where importing it gives `x` itself (a module-level function,
    class or `jax.custom_jvp`-wrapped function), else `None` (a lambda, a closure, a
    class defined in a function, an instance)."""
    if not isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType)) and not (
        callable(x) and hasattr(x, "__wrapped__")
    ):
        return None
    module, qualname = getattr(x, "__module__", None), getattr(x, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    found: Any = sys.modules.get(module)
    if found is None:
        try:
            found = importlib.import_module(module)
        except Exception:
            return None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return f"{module}:{qualname}" if found is x else None


def _stateless(x: Any) -> bool:
    """An instance with no state of its own and identity equality, of a class importable
    by name (a sentinel such as Equinox's `MISSING`): all such instances behave alike."""
    cls = type(x)
    return (
        cls.__eq__ is object.__eq__
        and not getattr(x, "__dict__", None)
        and not getattr(cls, "__slots__", ())
        and importable_name(cls) is not None
    )


@dataclasses.dataclass(frozen=True)
class StaticKey:
    """The static part of a cache key (see the module docstring): hashable and equal
    exactly when two calls have the same non-array parts and array types. `digest` is
    its 64-bit salt, stable across processes unless `local`."""

    encoded: bytes
    local: bool

    @functools.cached_property
    def digest(self) -> tuple[int, int]:
        text = self.encoded + (_NONCE if self.local else b"")
        digest = hashlib.blake2b(text, digest_size=8).digest()
        return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def static_key(*parts: Any) -> StaticKey:
    """The static key of `parts` (treedefs, non-array leaves, array signatures, the
    method and its policy), by equality as the module docstring states."""
    encoder = _Encoder()
    encoder.sequence(b"K", parts)
    return StaticKey(b"".join(encoder.out), encoder.local)
