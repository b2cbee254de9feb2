"""The cache key: exactly what a stored value may be reused for.

**The rule: what `jax.jit` keys on, plus the values read.** A stored value is reused
only when everything the method's output can depend on is the same as when it was
computed:

1. the *trace context*: the JAX configuration `jax.jit` puts in its own cache key
   (`jax_enable_x64`, the PRNG flags, default matmul precision, dtype promotion, the
   mesh and axis environment, ...: `_jax_internals.trace_context`, read from JAX, not a
   list of memox's own);
2. the *abstract type* of every array the method receives: each array of the module
   (`self` and its submodules, whether the method reads it or not) and each array
   argument: shape, dtype, weak type, and sharding where it is part of the type
   (`Explicit` mesh axes, `shard_map`'s varying axes);
3. the *non-array parts*: the method and its policy, the module's tree structure with
   its static fields, its non-array leaves (activation functions, flags, ...), and the
   method's non-array arguments and their structure, by their *token* (below);
4. the *values* (bits) of the arrays the method reads, and of its array arguments: a
   fingerprint (`_fingerprint.py`). Policies (`Exact`, `Drift`, `Manual`) relax this
   part only, for the module's arrays.

(1)-(3) are known when the method is traced: together they are the *static key*, which
also selects the method's plan, and whose 64-bit digest salts the fingerprint of (4).
This module computes it, in one place.

**Tokens: exact, canonical where provable.** A non-array part's token is a value made
of `None`, `bool`, `int`, `str`, `bytes`, tuples and frozensets, equal for two parts
exactly when memox may treat them as the same:

- plain values by type and value: floats and complex numbers by their bits (`-0.0` is
  not `0.0`, NaN payloads differ), `True` is not `1`; tuples, lists, dicts and sets
  element by element; NumPy arrays and scalars by dtype, shape and bytes; dtypes;
- dataclass instances and NamedTuples field by field, with their type; enum members;
  `functools.partial`s by function and arguments;
- functions and classes importable under their qualified name, and objects bound to a
  name in the module that defines their class (a sentinel), by that name;
- anything else through this process's table (`_Local`): an object of a class with its
  own `__eq__` by equality with its type (the semantics `jax.jit` gives static
  arguments; unhashable: refused, as `jax.jit` refuses it), any other object (a lambda,
  a closure, `operator.itemgetter(0)`, a `jax.Device`, a NumPy `Generator`) by
  identity. Never by a guess that two distinct objects behave alike, never by `repr`.

Canonical tokens serialise to the same bytes in every process: a slot restored from a
checkpoint in another process still hits. The digest of a key holding a part numbered
by this process's table is also salted with a per-process nonce, so a slot restored
elsewhere never hits on a part it cannot prove equal: it recomputes.

The per-call fast path (`_plan.py`) looks keys up by the tree structures (compared by
`PyTreeDef.__eq__`) together with the tokens of the nodes' data (`node_token`), the
tokens of the non-array leaves and the array types: as exact as the key itself.
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
from typing import TYPE_CHECKING, Any

import equinox as eqx
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


# -- (3) non-array parts: an exact, canonical token ------------------------------------


class _Local:
    """This process's table of non-array parts that have no canonical token: parts of a
    class with its own `__eq__` by equality (with their type: `jax.jit`'s semantics for
    static arguments), any other object by identity. Equal parts get the same entry
    number, distinct ones distinct numbers.

    Entries keep their parts alive (an entry number is never reused, nor an id while its
    object is in the table). The table is bounded: when full it starts afresh with new
    numbers, which only costs misses."""

    _MAX = 1 << 16

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[int, Any]] = {}
        self._numbers = itertools.count()

    def number(self, part: Any, by_identity: bool) -> int:
        key = ("id", id(part)) if by_identity else (type(part), part)
        found = self._entries.get(key)
        if found is None:
            if len(self._entries) >= self._MAX:
                self._entries.clear()
            found = self._entries[key] = (next(self._numbers), part)
        return found[0]


_LOCAL = _Local()
_NONCE = os.urandom(16)


def token(x: Any) -> Any:
    """The token of non-array part `x`: a hashable value, equal for two parts exactly
    when memox treats them as the same (see the module docstring), made of `None`,
    `bool`, `int`, `str`, `bytes`, tuples and frozensets. A part numbered by this
    process's table appears as `(_LOCAL_TAG, n)`."""
    return _Tokens().of(x)


_LOCAL_TAG = "\x00local"


class _Tokens:
    """One token computation (it tracks the objects being encoded, so that a cycle
    through them is numbered by identity instead of recursing for ever)."""

    def __init__(self) -> None:
        self._open: set[int] = set()

    def of(self, x: Any) -> Any:
        kind = type(x)
        if x is None or kind is str:
            return x
        if kind is bool:
            return ("b", x)
        if kind is int:
            return ("i", x)
        if kind is float:
            return ("f", struct.pack("<d", x))  # bits: -0.0 and NaN payloads kept
        if kind is complex:
            return ("z", struct.pack("<dd", x.real, x.imag))
        if kind is bytes:
            return ("y", x)
        if id(x) in self._open:  # a cycle
            return self.local(x, by_identity=True)
        self._open.add(id(x))
        try:
            return self._compound(x, kind)
        finally:
            self._open.discard(id(x))

    def _compound(self, x: Any, kind: type) -> Any:
        if kind is tuple or kind is list:
            return ("t" if kind is tuple else "l", tuple(map(self.of, x)))
        if kind is dict:
            return ("d", frozenset((self.of(k), self.of(v)) for k, v in x.items()))
        if kind is set or kind is frozenset:
            return ("S" if kind is set else "F", frozenset(map(self.of, x)))
        if isinstance(x, jtu.PyTreeDef):
            return self.treedef(x)
        if isinstance(x, (np.ndarray, np.generic)) or _is_concrete_jax_array(x):
            x = np.asarray(x)
            if not x.dtype.hasobject:
                return ("A", x.dtype.str, x.shape, np.ascontiguousarray(x).tobytes())
        if isinstance(x, np.dtype):
            return ("D", str(x))
        name = importable_name(x)
        if name is not None:
            return ("n", name)
        if isinstance(x, enum.Enum):
            return ("e", self.of(type(x)), x.name)
        if isinstance(x, functools.partial):
            return ("p", self.of(x.func), self.of(x.args), self.of(x.keywords))
        if isinstance(x, tuple) and hasattr(kind, "_fields"):  # a NamedTuple
            return ("N", self.of(kind), tuple(map(self.of, x)))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = tuple((f.name, self.of(getattr(x, f.name))) for f in dataclasses.fields(x))
            return ("C", self.of(kind), fields)
        return self.local(x, by_identity=kind.__eq__ is object.__eq__)

    def treedef(self, treedef: Any) -> Any:
        data = treedef.node_data()
        if data is None:
            return ("T*",)
        node_type, aux = data
        children = tuple(map(self.treedef, treedef.children()))
        return ("T", self.of(node_type), self.of(aux), children)

    def local(self, x: Any, by_identity: bool) -> Any:
        if not by_identity:
            try:
                hash(x)
            except TypeError:
                raise TypeError(
                    _errors.UNHASHABLE_STATIC.format(type=type(x).__qualname__)
                ) from None
        return (_LOCAL_TAG, _LOCAL.number(x, by_identity))


def _is_concrete_jax_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


_NAMES: dict[int, tuple[Any, str | None]] = {}


def importable_name(x: Any) -> str | None:
    """`module:qualname` where importing it gives `x` itself (a module-level function,
    class or `jax.custom_jvp`-wrapped function), else `None` (a lambda, a closure, a
    class defined in a function, an instance). Remembered per object."""
    found = _NAMES.get(id(x))
    if found is not None and found[0] is x:
        return found[1]
    name = _importable_name(x)
    if len(_NAMES) >= 4096:
        _NAMES.clear()
    _NAMES[id(x)] = (x, name)  # (holds `x`: its id is not reused while remembered)
    return name


def _importable_name(x: Any) -> str | None:
    if not isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType)) and not (
        callable(x) and hasattr(x, "__wrapped__")
    ):
        return _global_name(x)
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


def _global_name(x: Any) -> str | None:
    """`module:name` where `x` is bound to `name` in the module that defines its class (a
    sentinel such as Equinox's `MISSING`): named, as a module-level function is."""
    module = sys.modules.get(getattr(type(x), "__module__", None) or "")
    if module is None or isinstance(x, (str, bytes, int, float, complex, tuple)):
        return None
    for name, value in list(vars(module).items()):
        if value is x:
            return f"{module.__name__}:{name}"
    return None


# -- the node tokens of a flattening: what `PyTreeDef.__eq__` compares loosely ---------


def node_token(x: Any) -> Any:
    """For a pytree node `x`, the token of the data its tree structure holds beyond its
    type and children (an `eqx.Module`'s static fields, a dict's keys, a custom node's
    auxiliary data), or `None` where it holds none. `PyTreeDef.__eq__` compares that data
    with `==` (`(1,) == (True,)`, `0.0 == -0.0`); a tree structure together with the
    tokens of its nodes is as exact as the token of the tree structure itself."""
    kind = type(x)
    rule = _NODE_RULES.get(kind)
    if rule is None:
        rule = _NODE_RULES[kind] = _node_rule(x)
    return None if rule is _NO_DATA else rule(x)


def _NO_DATA(x: Any) -> Any:
    return None


def _node_rule(x: Any) -> Any:
    kind = type(x)
    if kind in (list, tuple, type(None)) or (isinstance(x, tuple) and hasattr(kind, "_fields")):
        return _NO_DATA  # (a NamedTuple's class is compared by identity)
    if kind is dict:
        return lambda d: token(tuple(d))
    if isinstance(x, eqx.Module):
        names = tuple(f.name for f in dataclasses.fields(x) if f.metadata.get("static", False))
        if not names:
            return _NO_DATA
        return lambda m: token(tuple(getattr(m, n, _ABSENT) for n in names))
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) or jtu.treedef_is_leaf(
        jtu.tree_structure(x)
    ):
        return _NO_DATA  # a leaf

    def custom(node: Any) -> Any:
        data = jtu.tree_structure(node, is_leaf=lambda y: y is not node).node_data()
        return token(None if data is None else data[1])

    return custom


_ABSENT = "\x00absent"  # a static field an `__init__` left unset (Equinox's `MISSING`)
_NODE_RULES: dict[type, Any] = {}


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


def static_key(*tokens: Any) -> StaticKey:
    """The static key made of `tokens` (of the method and its policy, the trace context,
    tree structures, non-array leaves and array signatures), as the module docstring
    states."""
    out: list[bytes] = []
    local = _serialise(tokens, out)
    return StaticKey(b"".join(out), local)


def _serialise(tok: Any, out: list[bytes]) -> bool:
    """Append the canonical bytes of token `tok` to `out` (a frozenset's elements in the
    order of their own bytes, not of this process's hashes); whether it holds a part
    numbered by this process's table."""
    kind = type(tok)
    if tok is None:
        out.append(b"0")
        return False
    if kind is str:
        payload = tok.encode("utf-8", "surrogatepass")
        out.append(b"s" + struct.pack("<Q", len(payload)) + payload)
        return False
    if kind is bytes:
        out.append(b"y" + struct.pack("<Q", len(tok)) + tok)
        return False
    if kind is bool or kind is int:
        payload = repr(tok).encode()
        out.append(b"i" + struct.pack("<Q", len(payload)) + payload)
        return False
    if kind is tuple:
        local = len(tok) == 2 and tok[0] == _LOCAL_TAG and type(tok[1]) is int
        out.append(b"(" + struct.pack("<Q", len(tok)))
        for x in tok:
            local |= _serialise(x, out)
        return local
    assert kind is frozenset, kind
    local, items = False, []
    for x in tok:
        sub: list[bytes] = []
        local |= _serialise(x, sub)
        items.append(b"".join(sub))
    out.append(b"{" + struct.pack("<Q", len(items)))
    out.extend(sorted(items))
    return local
