"""Tokens of non-array parts: by content, exact, canonical where provable.

The static key (`_key.py`) takes each non-array part (the method and its policy, tree
structures with their static fields, non-array leaves and arguments) by its *token*: a
value made of `None`, `bool`, `int`, `str`, `bytes`, tuples and frozensets, equal for
two parts exactly when memox may treat them as the same, by one rule in every process.
A part is keyed by its content first; a name is never its identity where it can be
rebound (a variable set in a loop at the top of a script, a function redefined when a
notebook cell runs again):

- plain values by type and value: floats and complex numbers by their bits (`-0.0` is
  not `0.0`, NaN payloads differ), `True` is not `1`; tuples, lists and sets element by
  element, dicts pair by pair in their order (iterating one shows it); NumPy and JAX
  arrays and scalars by their class, dtype, shape, weak type and bytes; dtypes;
- dataclass instances and NamedTuples field by field, with their type; enum members;
  `functools.partial`s by their type, function, arguments and keywords in order; a
  `functools.cache`d function by its function; type variables by name, bound and
  variance; unions (`int | None`) by their members; memox's own objects (a cached
  method) by the parts they name (`__memox_token_parts__`); a `jax.Device` by platform
  and id; JAX's and memox's own objects and `typing`'s aliases (a `Mesh`, a
  `NamedSharding`, `Memo[Array]`) by their pickle reduction, where rebuilding from it
  gives the object back (proven on each encoding: no list of their fields to go stale);
- the user's functions and classes (any code not installed: `__main__`, a script, a
  package installed for editing), at module level too, by their *code*: a function by
  its module and qualified name, its code object (bytecode, constants, names, nested
  code objects; no line numbers), its defaults, the tokens of what its closure cells
  hold and of the module globals it reads (by the names its code refers to); a class
  by its module, qualified name, metaclass, bases and the tokens of its own attributes
  (its methods by code). A cycle (a recursive function, a method using `super()`,
  functions that call each other) is a back-reference, and the walk emits each object
  of a cycle once. A digest of the bytes, computed once per function or class object;
- installed code (built into Python, the standard library, site-packages, memox): its
  functions and classes by their importable name, and an object bound in the module
  that defines its class (a sentinel such as `dataclasses.MISSING`) by that name. Such
  code is not edited while it runs and is the same in every process of a program; a
  name is given to one object per process, never to a second. (Walking it by content
  would read its module state, locks and registries, and cost a walk of the library.)
- anything else through this process's table (`_Local`): an object of a class with its
  own `__eq__` by equality with its type (the semantics `jax.jit` gives static
  arguments; unhashable: refused as a static part, as `jax.jit` refuses it, and by
  identity where code reads it, as a global `Counter`), any other object (an
  `operator.itemgetter(0)`, a NumPy `Generator`, a function closing over an array) by
  identity. Never by a guess that two distinct objects behave alike, never by `repr`.

**Why code equality is sound.** Two functions with the same code, defaults, closure
contents and values of the globals they read, defined in the same module, compute the
same thing: equal code is as safe a reason to reuse a value as identity (what
`jax.jit` keys a static function on), and unlike identity it is the same in every
process and every run, so a slot restored from a checkpoint hits only where the
function reads the same values (a module constant changed between runs: a miss). What
is kept out: line numbers and file names (they change no result), and a global,
closure cell or class attribute rebound after the first encoding in the same process
(identity does not see it either). A function whose globals are not a module's (made
by `exec`), or that closes over or reads an array or an object numbered by this
process, is taken by identity.

**One answer in every process.** Canonical tokens serialise to the same bytes in every
process (`serialise`: the bytes of the static key), so a slot restored from a checkpoint
in another process still hits, and the processes of one multi-process program
(`jax.distributed`) compute the same key bits, the same hit, the same branch (and the
same collectives in it). A part numbered by this process's table has no such bytes: in
a single process its key is salted with a per-process nonce (`_key.py`; a slot restored
elsewhere recomputes, never hits on a part it cannot prove equal), and under several
processes (`jax.process_count() > 1`) it is refused, with a message naming it and what
to do (`NOT_CANONICAL`).

The per-call fast path (`_plan.py`) looks keys up by the tree structures (compared by
`PyTreeDef.__eq__`) together with the tokens of the nodes' data (`node_token`), the
tokens of the non-array leaves and the array types: as exact as the key itself.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import hashlib
import importlib
import itertools
import os
import site
import struct
import sys
import sysconfig
import types
import typing
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from . import _errors, _jax_internals
from ._caches import Cache


if TYPE_CHECKING:
    import jax.core  # imported by `jax` at run time; checkers see it only where imported


# -- the token of a non-array part -----------------------------------------------------


class _Local:
    """This process's table of non-array parts that have no canonical token: parts of a
    class with its own `__eq__` by equality (with their type: `jax.jit`'s semantics for
    static arguments), any other object by identity. Equal parts get the same entry
    number, distinct ones distinct numbers.

    Entries keep their parts alive (an entry number is never reused, nor an id while its
    object is in the table). The table is bounded: when full it starts afresh with new
    numbers, which only costs misses."""

    def __init__(self) -> None:
        self._entries = Cache("numbered parts", 1 << 16)  # key -> (number, part)
        self._numbers = itertools.count()

    def number(self, part: Any, by_identity: bool) -> int:
        key = ("id", id(part)) if by_identity else (type(part), part)
        found = self._entries.get(key)
        if found is None:
            found = self._entries.put(key, (next(self._numbers), part))
        return found[0]


_LOCAL = _Local()


def token(x: Any) -> Any:
    """The token of non-array part `x`: a hashable value, equal for two parts exactly
    when memox treats them as the same (see the module docstring), made of `None`,
    `bool`, `int`, `str`, `bytes`, tuples and frozensets. A part numbered by this
    process's table appears as `(_LOCAL_TAG, n)`."""
    return _Tokens().of(x)


_LOCAL_TAG = "\x00local"


class _Tokens:
    """One token computation, a depth-first walk of the part. An object met again while
    it is open (a recursive closure, a class whose methods close over it) is a
    back-reference, by how many levels up it is open, so a cycle is encoded, not
    numbered. An object that refers to one still open is emitted once while that cycle
    is open: met again (functions that read each other), it is a reference to its
    emission, by how many such emissions back, so a cycle of many functions costs one
    walk. An object that refers to nothing open outside itself has a token of its own,
    the same wherever it is met (remembered for functions and classes). `_where` says
    where in the part the encoding is (for messages)."""

    def __init__(self) -> None:
        self._open: dict[int, int] = {}  # id -> depth, of the objects being encoded
        self._reach = sys.maxsize  # the lowest depth a back-reference reached
        self._emitted: dict[int, list[Any]] = {}  # id -> [object, position, reach]
        self._emissions: list[int] = []  # ids, in the order they were emitted
        self._where: list[str] = []
        self._in_code = 0  # > 0 inside a function or class

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
        depth = self._open.get(id(x))
        if depth is not None:  # a cycle
            self._reach = min(self._reach, depth)
            return ("^", len(self._open) - depth)
        emitted = self._emitted.get(id(x))
        if emitted is not None and emitted[0] is x:  # in a cycle still open: emitted
            self._reach = min(self._reach, emitted[2])
            return ("^^", len(self._emissions) - emitted[1])
        coded = kind is types.FunctionType or kind is types.CodeType or isinstance(x, type)
        if coded:  # (remembered as met alone: valid where none of its cycle is open)
            found = _CODED.get(id(x))
            if found is not None and found[0] is x and found[2].isdisjoint(self._open):
                return found[1]
        depth, first = len(self._open), len(self._emissions)
        self._open[id(x)] = depth
        outer, self._reach = self._reach, sys.maxsize
        try:
            out = self._compound(x, kind)
        finally:
            del self._open[id(x)]
            reach, self._reach = self._reach, min(outer, self._reach)
        inner = self._emissions[first:]
        if reach >= depth:  # no reference to an object outside `x`: its own token
            for key in inner:
                del self._emitted[key]
            del self._emissions[first:]
            if coded:  # (holds `x`: its id is not reused while remembered)
                _CODED.put(id(x), (x, out, frozenset(inner)))
        else:  # what was emitted inside `x` is, once `x` closes, referred to through it
            for key in inner:
                self._emitted[key][2] = min(self._emitted[key][2], reach)
            self._emitted[id(x)] = [x, len(self._emissions), reach]
            self._emissions.append(id(x))
        return out

    def _compound(self, x: Any, kind: type) -> Any:
        if kind is tuple or kind is list:
            return ("t" if kind is tuple else "l", tuple(map(self.of, x)))
        if kind is dict or kind is types.MappingProxyType:  # in order: iterating shows it
            pairs = tuple((self.of(k), self.of(v)) for k, v in x.items())
            return ("d" if kind is dict else "dp", pairs)
        if kind is set or kind is frozenset:
            return ("S" if kind is set else "F", frozenset(map(self.of, x)))
        if isinstance(x, jtu.PyTreeDef):
            return self.treedef(x)
        if isinstance(x, jax.Array):
            if isinstance(x, jax.core.Tracer) or self._in_code or not x.is_fully_addressable:
                return self.local(x, by_identity=True)
        if isinstance(x, (np.ndarray, np.generic, jax.Array)):  # by its full type and bits
            a, weak = np.asarray(x), bool(getattr(x, "weak_type", False))
            typed = (self.of(kind), a.dtype.str, a.shape, weak)
            if not a.dtype.hasobject:
                return ("A", *typed, np.ascontiguousarray(a).tobytes())
            return ("AO", *typed, tuple(map(self.of, a.flat)))  # (a mesh's devices)
        if isinstance(x, np.dtype):
            return ("D", str(x))
        return self._content(x, kind)

    def _content(self, x: Any, kind: type) -> Any:
        name = installed_name(x) if _is_code(x) else None
        if name is not None:
            return ("n", name)
        if kind is types.FunctionType:
            return self.function(x)
        if kind is types.CodeType:
            return self.code(x)
        if isinstance(x, type):
            return self.cls(x)
        if kind is types.UnionType:  # `int | None`, as annotations hold it
            return ("U", self.of(x.__args__))
        if kind in _TYPE_VARIABLES:  # (matched only against the parameters it is given)
            parts = (x.__module__, x.__name__, x.__bound__, getattr(x, "__constraints__", ()))
            variance = (x.__covariant__, x.__contravariant__)
            return ("tv", self.of(kind), self.of(parts), self.of(variance))
        parts = getattr(kind, "__memox_token_parts__", None)
        if parts is not None:  # memox's own objects (a cached method)
            return ("P", self.of(kind), self.of(parts(x)))
        if isinstance(x, enum.Enum):
            return ("e", self.of(kind), x.name)
        if isinstance(x, functools.partial):
            parts = (x.func, x.args, x.keywords, vars(x))  # (keywords in their order)
            return ("p", self.of(kind), *map(self.of, parts))
        if kind is _LruCached:  # (`functools.cache`) computes what the function does
            return ("lru", self.of(x.__wrapped__), self.of(x.cache_parameters()))
        if isinstance(x, tuple) and hasattr(kind, "_fields"):  # a NamedTuple
            return ("N", self.of(kind), tuple(map(self.of, x)))
        if dataclasses.is_dataclass(x):
            fields = tuple((f.name, self.of(getattr(x, f.name))) for f in dataclasses.fields(x))
            return ("C", self.of(kind), fields)
        return self._machinery(x, kind)

    def _machinery(self, x: Any, kind: type) -> Any:
        if isinstance(x, jax.Device):  # one object per device in a process; ids are global
            return ("G", x.platform, x.id)
        if kind is types.ModuleType and sys.modules.get(x.__name__) is x:
            return ("M", x.__name__)
        if kind in _BY_SLOTS:  # a class's machinery: all its state in its slots
            return (
                "s",
                self.of(kind),
                tuple(self.of(getattr(x, s, _ABSENT)) for s in _BY_SLOTS[kind]),
            )
        if kind is _AbcRegistry:
            return ("R", self.of(x.classes))
        if kind is types.BuiltinMethodType and isinstance(x.__self__, type | types.ModuleType):
            return ("bm", self.of(x.__self__), x.__name__)  # (`object.__new__`)
        if kind is staticmethod or kind is classmethod:
            return ("sm" if kind is staticmethod else "cm", self.of(x.__func__))
        if kind is property:
            return ("pr", self.of((x.fget, x.fset, x.fdel, x.__doc__)))
        if kind in _DESCRIPTORS:  # a slot, or a method of a class written in C
            return ("md", self.of(kind), self.of(x.__objclass__), x.__name__)
        if kind.__module__.partition(".")[0] in _REBUILT_BY_PICKLE:
            rebuilt = self.reduced(x, kind)
            if rebuilt is not None:
                return rebuilt
        name = installed_name(x)  # (a sentinel of installed code)
        if name is not None:
            return ("n", name)
        return self.local(x, by_identity=kind.__eq__ is object.__eq__)

    def reduced(self, x: Any, kind: type) -> Any:
        """`x` by its pickle reduction `(f, args)`, where that holds no state and rebuilds
        `x`: `f(*args)` is `x` (an interned class: a `Mesh`) or equals it by its class's
        own `__eq__` (a `PartitionSpec`, a `NamedSharding`). Canonical by construction:
        equal tokens rebuild equal objects, in any process. Else `None`."""
        try:
            reduction = x.__reduce_ex__(4)
            if isinstance(reduction, str) or any(p is not None for p in reduction[2:]):
                return None
            f, args = reduction[:2]
            rebuilt = f(*args)
            same = rebuilt is x or (
                kind.__eq__ is not object.__eq__ and type(rebuilt) is kind and bool(rebuilt == x)
            )
        except Exception:  # no reduction, or one that does not rebuild here
            return None
        return ("r", self.of(f), self.of(args)) if same else None

    def function(self, f: types.FunctionType) -> Any:
        """A function of the user's code (at module level too, a lambda, a closure), by
        its code (the module docstring)."""
        module = sys.modules.get(f.__globals__.get("__name__", None) or "")
        if module is None or f.__globals__ is not vars(module):
            return self.local(f, by_identity=True)  # (globals of no module: `exec`)
        self._in_code += 1
        try:
            return self.sealed(f, self._function(f))
        finally:
            self._in_code -= 1

    def _function(self, f: types.FunctionType) -> Any:
        cells = []
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            self._where.append(f"closure variable `{name}` of `{f.__qualname__}`")
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a variable assigned later)
                contents = _EMPTY_CELL
            try:
                cells.append(self.of(contents))
            finally:
                self._where.pop()
        read = []  # the module globals it reads: their values, not only their names
        for name in sorted(_names_read(f.__code__)):
            if name in f.__globals__:
                self._where.append(f"global `{name}` read by `{f.__qualname__}`")
                try:
                    read.append((name, self.of(f.__globals__[name])))
                finally:
                    self._where.pop()
        self._where.append(f"defaults of `{f.__qualname__}`")
        try:
            parts = (f.__defaults__, f.__kwdefaults__, f.__dict__ or None)
            rest = (self.of(f.__code__), tuple(cells), tuple(read), self.of(parts))
        finally:
            self._where.pop()
        return ("fn", f.__module__, f.__qualname__, f.__globals__["__name__"], *rest)

    def code(self, c: types.CodeType) -> Any:
        """A code object, by its bytecode and what it names (no line numbers, no file)."""
        parts = (c.co_name, c.co_qualname, c.co_argcount, c.co_posonlyargcount)
        parts += (c.co_kwonlyargcount, c.co_flags, c.co_code, c.co_consts, c.co_names)
        parts += (c.co_varnames, c.co_freevars, c.co_cellvars)
        return self.sealed(c, ("co", self.of(parts)))

    def cls(self, c: type) -> Any:
        """A class of the user's code (at module level too, or defined in a function), by
        its module, qualified name, metaclass, bases and own attributes (the module
        docstring)."""
        self._in_code += 1
        try:
            return self.sealed(c, self._cls(c))
        finally:
            self._in_code -= 1

    def _cls(self, c: type) -> Any:
        attributes = []
        for name, value in sorted(vars(c).items()):
            if name in _DERIVED:
                continue
            if name == "_abc_impl" and isinstance(c, abc.ABCMeta):
                value = _AbcRegistry(c)  # (the rest is caches)
            self._where.append(f"attribute `{name}` of class `{c.__qualname__}`")
            try:
                attributes.append((name, self.of(value)))
            finally:
                self._where.pop()
        parts = (c.__module__, c.__qualname__, self.of(type(c)), self.of(c.__bases__))
        return ("K", *parts, tuple(attributes))

    def sealed(self, x: Any, tok: Any) -> Any:
        """A function's, code object's or class's token as the SHA-256 digest of its
        canonical bytes (small wherever it is met: code that code reads is not copied
        into each reader's token), or `x` by identity where `tok` holds a part this
        process numbered."""
        out: list[bytes] = []
        if serialise(tok, out):
            return self.local(x, by_identity=True)
        return ("c", hashlib.sha256(b"".join(out)).digest())

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
                if not self._in_code:
                    raise TypeError(
                        _errors.UNHASHABLE_STATIC.format(type=type(x).__qualname__)
                    ) from None
                by_identity = True  # read by code (a global `Counter`): as `jax.jit` does
        processes = _jax_internals.process_count()
        if processes > 1:
            raise ValueError(
                _errors.NOT_CANONICAL.format(processes=processes, **self.why(x, by_identity))
            )
        return (_LOCAL_TAG, _LOCAL.number(x, by_identity))

    def why(self, x: Any, by_identity: bool) -> dict[str, str]:
        """What `x` is and where (for `NOT_CANONICAL`), and why it has no canonical token."""
        kind = type(x)
        what = f"`{kind.__module__}.{kind.__qualname__}` object `{_short(x)}`"
        if self._where:
            what += " (" + ", in ".join(reversed(self._where)) + ")"
        if isinstance(x, jax.Array):
            why = "an array in a static part (a closure, a static field) is compared by identity"
        elif isinstance(x, types.FunctionType):
            why = "its globals are no module's (made by `exec`?): compared by identity"
        elif by_identity:
            why = "its class has no `__eq__`: compared by identity, a relation of one process"
        else:
            why = "it is compared by its class's `__eq__`, a relation each process numbers alone"
        return {"what": what, "why": why}


def _short(x: Any) -> str:
    try:
        text = repr(x)
    except Exception:
        text = object.__repr__(x)
    return text if len(text) <= 60 else text[:57] + "..."


# Modules whose classes are keyed by their pickle reduction (`_Tokens.reduced`): JAX's,
# memox's own and `typing`'s aliases, whose reductions rebuild an object without side
# effects (memox calls them on every call that reads such a part).
_REBUILT_BY_PICKLE = frozenset({"jax", "jaxlib", "memox", "typing", "types"})
# Class attributes that follow from the others (instance dictionaries and weak references
# of a class without `__slots__`, `copyreg`'s cache of slot names, set by pickling) or
# that name the class (in its token already).
_DERIVED = frozenset({"__dict__", "__weakref__", "__slotnames__", "__module__", "__qualname__"})
_LruCached = type(functools.cache(len))
_TYPE_VARIABLES = frozenset({typing.TypeVar, typing.ParamSpec})
_DESCRIPTORS = frozenset(
    {
        types.MemberDescriptorType,
        types.GetSetDescriptorType,
        types.WrapperDescriptorType,
        types.MethodDescriptorType,
        types.ClassMethodDescriptorType,
    }
)
_BY_SLOTS: dict[type, tuple[str, ...]] = {
    dataclasses.Field: dataclasses.Field.__slots__,
    type(getattr(dataclasses.make_dataclass("_", []), "__dataclass_params__")): type(
        getattr(dataclasses.make_dataclass("_", []), "__dataclass_params__")
    ).__slots__,
}


class _AbcRegistry:
    """An ABC's registered virtual subclasses (`ABC.register`), the one part of its
    `_abc_impl` that is not a cache."""

    def __init__(self, c: abc.ABCMeta) -> None:
        registry = abc._get_dump(c)[0]  # pyright: ignore[reportAttributeAccessIssue]
        self.classes = frozenset(filter(None, (ref() for ref in registry)))


_CODED = Cache("tokens of code", 4096)  # id -> (function or class, token, ids in its cycle)


_NAMES = Cache("installed names", 4096)  # id -> (object, name or None)


def installed_name(x: Any) -> str | None:
    """The name that installed code (`installed`) binds `x` to, where that is an identity
    (`_claim`), else `None`. A function, class or wrapped callable (a `jax.custom_jvp`)
    by `module:qualname` where importing that gives `x` itself; any other object by
    `module:name` where it is bound in the module that defines its class (a sentinel:
    `dataclasses.MISSING`). Remembered per object."""
    found = _NAMES.get(id(x))
    if found is not None and found[0] is x:
        return found[1]
    name = _installed_name(x) if _is_code(x) else _sentinel_name(x)
    _NAMES.put(id(x), (x, name))  # (holds `x`: its id is not reused while remembered)
    return name


def _is_code(x: Any) -> bool:
    return isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType)) or (
        callable(x) and hasattr(x, "__wrapped__")
    )


def _installed_name(x: Any) -> str | None:
    module, qualname = getattr(x, "__module__", None), getattr(x, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    if isinstance(x, type) and not x.__flags__ & _HEAP_TYPE:  # (`NoneType`: not bound)
        return _claim(f"{module}:{qualname}", x)  # a static C type, fixed while it runs
    where: Any = sys.modules.get(module)
    if where is None:
        try:
            where = importlib.import_module(module)
        except Exception:
            return None
    if not installed(where):
        return None
    found = where
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is x:
        return _claim(f"{module}:{qualname}", x)
    return _bound_name(where, x)  # (`jax.Array`, whose qualified name is `jaxlib._jax.Array`)


def _sentinel_name(x: Any) -> str | None:
    module = sys.modules.get(getattr(type(x), "__module__", None) or "")
    if module is None or not installed(module):
        return None
    return _bound_name(module, x)


def _bound_name(module: types.ModuleType, x: Any) -> str | None:
    for name, value in list(vars(module).items()):
        if value is x:
            return _claim(f"{module.__name__}:{name}", x)
    return None


_HEAP_TYPE = 1 << 9  # `Py_TPFLAGS_HEAPTYPE`: a class made at run time, not a static C type
_CLAIMS: dict[str, Any] = {}  # name -> the one object it names in this process (state)


def _claim(name: str, x: Any) -> str | None:
    """`name` where it names `x` and no other object in this process, ever (a name that
    once named another object is no identity: `None`). Never cleared: installed code
    binds a bounded number of names."""
    return name if _CLAIMS.setdefault(name, x) is x else None


_INSTALLED: dict[str, bool] = {}  # module name -> whether installed (state of the files)
_INSTALLED_ROOTS = tuple(
    os.path.join(os.path.realpath(root), "")
    for root in {
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
        *site.getsitepackages(),
        site.getusersitepackages(),
    }
)


def installed(module: types.ModuleType) -> bool:
    """Whether `module` is installed code: built into Python or a file of the standard
    library or of site-packages. Not `__main__`, not a file of the user's (a script, a
    notebook, a package installed in editable mode): code that is edited and run again."""
    name = module.__name__
    found = _INSTALLED.get(name)
    if found is None:
        file = getattr(module, "__file__", None)
        if name == "__main__":
            found = False
        elif name.partition(".")[0] == __name__.partition(".")[0]:
            found = True  # memox's own, installed for editing too: not the user's code
        elif file is None:
            origin = getattr(getattr(module, "__spec__", None), "origin", None)
            found = name in sys.builtin_module_names or origin == "frozen"
        else:
            found = os.path.realpath(file).startswith(_INSTALLED_ROOTS)
        _INSTALLED[name] = found
    return found


def _names_read(code: types.CodeType) -> set[str]:
    """The global (and attribute) names `code` and the code nested in it refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


_EMPTY_CELL = "\x00empty"  # a closure cell not yet assigned


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
        rule = _NODE_RULES.put(kind, _node_rule(x))
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
_NODE_RULES = Cache("node rules", 4096)  # type -> how to token its node data


# -- the canonical bytes of a token ----------------------------------------------------


def serialise(tok: Any, out: list[bytes]) -> bool:
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
            local |= serialise(x, out)
        return local
    assert kind is frozenset, kind
    local, items = False, []
    for x in tok:
        sub: list[bytes] = []
        local |= serialise(x, sub)
        items.append(b"".join(sub))
    out.append(b"{" + struct.pack("<Q", len(items)))
    out.extend(sorted(items))
    return local
