"""`memox.filter_jit`: `eqx.filter_jit`, where unchanged inputs are not hashed again.

The standard Equinox loop calls `memox.call` inside its own `eqx.filter_jit` step. There
every check of a cached value hashes its dependencies in-graph, on every call: the
frozen backbone of a fine-tuned model and the training inputs, although neither
changed. `memox.filter_jit` is `eqx.filter_jit` (it calls it: same arguments, same
results, same tree structures, same donation, the same cache of compiled programs) with
three additions:

1. **Fingerprints outside, once per array.** The input arrays that the cached methods
   inside fingerprinted in an earlier trace are fingerprinted outside the compiled
   code, by identity (`_fingerprint.known`: once per array object), and passed in as a
   small table; a check inside finds them (`_prehash.py`) and skips the in-graph hash,
   which stays behind a `lax.cond` for any input that is not the object seen at the
   previous call. A new, donated or updated array is a new object: it is hashed.
   Inputs under 256 KiB are hashed in-graph (on XLA:CPU the `lax.cond` costs about
   what hashing them does).
2. **Hits decided on the host.** A slot whose entries and the inputs its check reads
   are the very arrays of the previous call hits, known before dispatch
   (`_decided.Hits`): the call runs a program (compiled at the second call) that reads
   the value with no check and no `lax.cond`, also where `memox.call` runs inside the
   loss under `jax.grad`.
3. **No copy of a cache table that passes through.** A slot's array that the call
   returns unchanged (the entries of a hit) is not an output of the compiled function
   (XLA would copy the table into a fresh buffer on every call): the caller's own array
   is put back in its place, so (2) finds it again. The caller's own arrays passed
   through come back as copies, as from `eqx.filter_jit`; where a check reads one,
   the copy is known as its original (`_copies`: the same values, both immutable), so
   (1) and (2) apply to it at the next call.

**Programs are shared as Equinox shares them**: per function object for a Python
function, else per name (`_programs`, as `equinox._compile_utils.compile_cache`), with
one donation. Wrapping the same function again reuses the compiled programs, and with
them what the host learned from their traces and calls (`_Program`: which inputs the
checks read, the hits it can decide), which is therefore per program, not per wrapper.

**Never deletes what `eqx.filter_jit` would not, through its own donation.** A slot's
array given back in place of a copy (3) is also held by the tree it came from, so a
`memox.filter_jit` call that donates it donates a copy of it instead (the copy
`eqx.filter_jit` would have made at the first call). These arrays are known by
identity, held weakly (`_handed_back`). Deleted elsewhere (another function's donation),
the slot is recomputed at the next call (`_lifecycle.allocated_once` revives it).

Empty slots in the arguments are allocated before the first trace (as `memox.init`
does), so that a step does not retrace even when the model was not initialised; the `Memo`
nodes of an optimizer state made from `eqx.filter(model, ...)` (leaves `None`) mirror
the model's slots and are left as they are (`_lifecycle.allocated`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _decided, _errors, _prehash
from ._caches import register
from ._jax_internals import is_concrete_array
from ._lifecycle import allocated_once
from ._partition import ARRAY, hashable_combine, hashable_partition
from ._sites import holds_empty
from ._slot import Memo, is_memo
from ._table import copied, entry_leaves
from ._typing import P, R


Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")
_SENTINEL: Any = object()


@dataclasses.dataclass(frozen=True)
class _Input:
    """Stands, in the compiled function's outputs, for its `index`-th input array, a
    slot's array passed through unchanged: the caller's array is put back in its place."""

    index: int


def _is_input(x: Any) -> bool:
    return isinstance(x, _Input)


@overload
def filter_jit(
    *, donate: Literal["all", "all-except-first", "warn", "warn-except-first", "none"] = "none"
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
@overload
def filter_jit(
    fun: Callable[P, R],
    /,
    *,
    donate: Literal["all", "all-except-first", "warn", "warn-except-first", "none"] = "none",
) -> Callable[P, R]: ...
def filter_jit(fun: Any = _SENTINEL, /, *, donate: Any = "none") -> Any:
    """`eqx.filter_jit`, with the fingerprints of unchanged inputs computed once.

    A drop-in replacement: swap `eqx.filter_jit` for `memox.filter_jit` on a step that
    calls `memox.call`, and nothing else changes (arguments, results, tree structures,
    donation, retracing rules, compiled programs shared by every wrapper of the same
    function, `.lower(...).compile()`), except that a cached method whose dependencies
    are inputs of the step that did not change (a frozen part of the model, the training
    data) no longer hashes them in-graph at every call: their fingerprints are computed
    outside, once per array object, and passed in. Where a slot and what its check reads
    are the arrays of the previous call (or copies the step returned of them), the hit
    is decided before dispatch, and a second program (compiled at the second call; at
    most 4 per signature) reads the value with no check.

    **Arguments:**

    - `fun`: the function to compile, as for `eqx.filter_jit`.
    - `donate`: as for `eqx.filter_jit`: `"all"`, `"all-except-first"`, `"warn"`,
      `"warn-except-first"` or `"none"` (the default).

    **Returns:**

    The compiled function, called as `fun` is. `step.lower(*args, **kwargs)` lowers the
    program a call on those arguments would run now (`.as_text()`, `.lowered`), and
    `.compile(compiler_options=...)` compiles it ahead of time: the compiled object is
    called as `fun` is and returns what `fun` returns. Its program is fixed: where the
    host does not decide the hits it was lowered for, the call runs the program that
    checks in-graph (compiled at the first such call).

    **When to call `memox.init`:** not for `memox.filter_jit`. Before the first trace,
    the empty slots for methods without arguments in the arguments are allocated (an
    optimizer state's mirrors of them, from `opt.init(eqx.filter(model, ...))`, are
    left alone), so the ordinary loop `model, opt_state = step(model, opt_state)` with
    `memox.call` inside the loss does not retrace on a model never initialised. A slot of a
    cached method that takes arguments (a keyed table) is allocated at its first fill:
    one retrace, unless `memox.init(model, fn, *args)` ran first. (With `eqx.filter_jit`
    in its place, call `memox.init(model)` first: it retraces once at the first fill
    otherwise.)

    **Outputs and donation** are `eqx.filter_jit`'s for your arrays: one that the step
    returns unchanged comes back as a new array, never as the one you passed, so
    donating it later deletes nothing you hold. memox keeps the array you passed alive
    while such a copy is in use, where a cached method's check reads it, so that the
    copy is known to hold the same values (one more copy of those arrays in memory).
    memox's own cache arrays (a slot's entries and counters) that the step returns
    unchanged come back as the arrays you passed, not copied: copying a cache table at
    every call would cost what caching saves. A `memox.filter_jit` call that donates one
    donates a copy of it; donated elsewhere (`eqx.filter_jit(..., donate="all")`,
    `jax.jit`'s `donate_argnums`), it is deleted in both trees, and the slot is
    recomputed where the older tree is used again (with a warning).

    !!! Example

        ```python
        @memox.filter_jit                        # was: @eqx.filter_jit
        def step(foo, x):
            b, foo = memox.call(foo, Foo.b)      # foo.a: hashed outside, once
            return b * x, foo

        y, foo = step(foo, jnp.float32(2.0))
        y, foo = step(foo, jnp.float32(3.0))     # a hit, decided before dispatch
        ```
    """
    if fun is _SENTINEL:
        return functools.partial(filter_jit, donate=donate)
    if donate not in _DONATE:
        eqx.filter_jit(fun, donate=donate)  # raises Equinox's own error
    return _FilterJit.make(fun, donate)


class _Program:
    """What every wrapper of one function with one donation shares, as they share the
    function `eqx.filter_jit` compiles (`traced`, and so its programs): what the host
    knows of its calls, written by its traces (`_prehash.Inputs`) and after its calls
    (`_decided.Hits`; `tracked`: the input positions whose arrays a check reads).
    Each is safe for threads (immutable snapshots, replaced whole)."""

    def __init__(self, names: tuple[str, str], donate: Donate):
        self.inputs = _prehash.Inputs()
        self.hits = _decided.Hits()
        self.tracked: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self.donate_first, self.donate_rest = donate in ("all", "warn"), donate != "none"
        traced = self._traced

        def program(head: tuple, rest: list, call: _Call, hits: tuple) -> Any:
            return traced(head, rest, call, hits)

        # Named after the user's function, as Equinox names its programs.
        program.__name__, program.__qualname__ = names
        # The table travels with the first argument: donated with it, and only then.
        self.compiled: Any = eqx.filter_jit(program, donate=donate)

    def _track(self, positions: frozenset[int]) -> None:
        if not positions <= self.tracked:
            with self._lock:
                self.tracked = self.tracked | positions

    def _traced(self, head: tuple, rest: list, call: _Call, hits: tuple) -> Any:
        first, table, decided = head
        arrays = call.merge(first, rest)
        fn, args, kwargs = call.rebuild(arrays)
        hits_ = dict(zip(hits, decided))
        with _prehash.scope(arrays, table, _prehash.PREHASH_MIN_BYTES, hits_) as scope:
            out = fn(*args, **kwargs)
            self.inputs.learned(scope.used)
            slots_out, in_slot = _slots_in(out)
            held = scope.held(slots_out, keeps_indices=not self.donate_first)
        # The positions whose arrays the host must know again at the next call: those
        # the checks fingerprinted, and those a decided hit reads.
        tracked = frozenset(scope.used).union(*(h.reads for h, _, _ in held))
        self._track(tracked)
        donated = call.donated(self.donate_first, self.donate_rest)
        index = {id(x): i for i, x in enumerate(arrays) if not donated[i]}
        leaves, treedef = jtu.tree_flatten(out)
        dynamic, static, copies = [], [], []
        for j, x in enumerate(leaves):
            if not eqx.is_array(x):
                static.append(x)
                continue
            i = index.get(id(x))
            if i is not None and in_slot[j]:
                # A slot's array passed through: given back outside (the caller's), not
                # an output of the compiled function, which would copy it.
                static.append(_Input(i))
                continue
            if i is not None and i in tracked:
                copies.append((j, i))  # an input of the caller's, copied: known as it
            dynamic.append(x)
            static.append(ARRAY)
        # Where each slot the host can vouch for leaves the call (`_decided.Hits`):
        # the positions of its entry arrays among the output's leaves.
        at = {id(x): j for j, x in enumerate(leaves)}
        vouched = tuple(
            (h, tuple(at[id(x)] for x in entry_leaves(slots_out[k]))) for h, k, _ in held
        )
        out_static = _Out(treedef, tuple(static), vouched, tuple(copies))
        # A donated table is returned (unchanged) so that XLA reuses its buffer and
        # `donate="warn"` warns about the caller's arrays only.
        donated_table = (table, decided) if self.donate_first else None
        return dynamic, out_static, donated_table, [i for _, _, i in held]


# The programs, as Equinox keys its own (`equinox._compile_utils.compile_cache`): by the
# function object for a Python function (held weakly), under `_programs` itself for any
# other callable; then by the function's names and the donation.
_programs: weakref.WeakKeyDictionary[Any, dict[tuple, _Program]] = weakref.WeakKeyDictionary()
_programs_lock = threading.Lock()
register("filter_jit programs", _programs)


def _program(fun: Callable, donate: Donate) -> _Program:
    key = fun if type(fun) is types.FunctionType else _program
    names = _names(fun)
    with _programs_lock:
        found = _programs.get(key)
        if found is None:
            found = _programs[key] = {}
        program = found.get((names, donate))
        if program is None:
            program = found[names, donate] = _Program(names, donate)
    return program


def _names(fun: Any) -> tuple[str, str]:
    """`fun`'s name and qualified name (of what it wraps), as Equinox's `get_fn_names`."""
    while True:
        if hasattr(fun, "__wrapped__"):
            fun = fun.__wrapped__
        elif isinstance(fun, functools.partial):
            fun = fun.func
        else:
            break
    try:
        return fun.__name__, fun.__qualname__
    except AttributeError:
        return type(fun).__name__, type(fun).__qualname__


class _Prepared(NamedTuple):
    """A call taken apart: its signature, its input arrays as given, as the host knows
    them (`_copies`) and as passed (copies of the donated ones given back earlier), and
    the compiled function's arguments, with the hits decided on the host."""

    call: _Call
    given: list
    host: list
    arrays: list
    compiled_args: tuple  # ((first, table, decided), rest, call, hits)

    def without_hits(self) -> _Prepared:
        (first, table, _), rest, call, _ = self.compiled_args
        return self._replace(compiled_args=((first, table, []), rest, call, ()))


class _FilterJit(eqx.Module):
    """The compiled function. A Module, like `eqx.filter_jit`'s: arrays in `fun` are
    traced, and as a method it receives its instance as its first argument.

    It calls `eqx.filter_jit` (so Equinox's own handling of donation, runtime errors
    and warnings applies) on flat lists of arrays and one hashable description of
    everything else, flattened once here: Equinox and `jax.jit` then have nothing left
    to take apart."""

    fun: Callable  # may hold arrays: traced
    _program: _Program = eqx.field(static=True, repr=False)
    _binding: _Binding = eqx.field(static=True, repr=False)
    _donate: Donate = eqx.field(static=True, repr=False)

    @classmethod
    def make(cls, fun: Callable, donate: Donate) -> Any:
        wrapper = cls(fun, _program(fun, donate), _Binding.of(fun), donate)
        return eqx.module_update_wrapper(wrapper)

    @property
    def __wrapped__(self) -> Callable:
        return self.fun

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return _called(self, args, kwargs, _run)

    def lower(self, /, *args: Any, **kwargs: Any) -> Lowered:
        """The program that a call on these arguments would run now (with the hits it
        would decide on the host), lowered: `Lowered`, as `eqx.filter_jit(...).lower`
        gives (`.as_text()`, `.compile()`, JAX's own as `.lowered`)."""
        prepared = _prepared(self, args, kwargs)
        lowered = self._program.compiled.lower(*prepared.compiled_args)
        return Lowered(self, prepared.call, prepared.compiled_args[3], lowered)

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


@dataclasses.dataclass(frozen=True)
class _Binding:
    """Binds a call's arguments to `fun`'s parameters, as `inspect.Signature.bind` does
    and as Equinox binds them before keying its programs. Positional arguments alone, as
    many as the signature takes positionally and no fewer than it requires, bind to
    themselves: that call skips `bind`, which costs microseconds."""

    signature: inspect.Signature
    fewest: int | float  # positional arguments required; infinite where one is keyword-only
    most: int | float  # positional arguments taken; infinite with `*args`

    @classmethod
    def of(cls, fun: Callable) -> _Binding:
        signature = inspect.signature(fun)
        fewest: int | float = 0
        most: int | float = 0
        for p in signature.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                most += 1
                fewest += p.default is p.empty
            elif p.kind is p.VAR_POSITIONAL:
                most = float("inf")
            elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
                fewest = float("inf")
        return cls(signature, fewest, most)

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not kwargs and self.fewest <= len(args) <= self.most:
            return args, kwargs
        bound = self.signature.bind(*args, **kwargs)
        return bound.args, bound.kwargs


# The steps of a call are functions, not methods: a method of an `eqx.Module` is bound
# anew at each access (as Equinox's `_call` avoids).


def _called(wrapper: _FilterJit, args: tuple, kwargs: dict, run: Callable) -> Any:
    """A call of `wrapper` on `args` and `kwargs`, its compiled function called by `run`
    (which takes the `_Prepared` call and returns it, as it ran, and the outputs)."""
    try:
        prepared, outputs = run(wrapper, _prepared(wrapper, args, kwargs))
    except (RuntimeError, ValueError) as e:
        # An array deleted before the call, which JAX refuses at dispatch (not an error
        # of the program: those are subclasses): a slot's array donated elsewhere (it
        # was given back in place of a copy), the slot then revived (recomputed, with a
        # warning). A deleted array of the caller's fails again.
        if type(e) not in (RuntimeError, ValueError) or not _deleted_inputs(args, kwargs):
            raise
        prepared, outputs = run(wrapper, _prepared(wrapper, args, kwargs, revive=True))
    return _finished(wrapper, prepared, outputs)


def _run(wrapper: _FilterJit, prepared: _Prepared) -> tuple[_Prepared, Any]:
    return prepared, wrapper._program.compiled(*prepared.compiled_args)


def _prepared(wrapper: _FilterJit, args: tuple, kwargs: dict, revive: bool = False) -> _Prepared:
    fun, donate, program = wrapper.fun, wrapper._donate, wrapper._program
    args, kwargs = wrapper._binding.bind(args, kwargs)
    call, given = _Call.split(fun, args, kwargs, donate)
    if call.empty_slots or revive:  # rare: allocate empty slots first (once per object)
        args = tuple(map(allocated_once, args))
        kwargs = {k: allocated_once(v) for k, v in kwargs.items()}
        call, given = _Call.split(fun, args, kwargs, donate)
    host = _originals(given, program.tracked)
    hits, decided = program.hits.decide(call, host)
    arrays = given
    if donate != "none" and _handed_back:
        arrays = _unshared(given, call.donated(donate in ("all", "warn"), True))
    table = program.inputs.table(host)
    first, rest = call.groups(arrays)
    return _Prepared(call, given, host, arrays, ((first, table, decided), rest, call, hits))


def _finished(wrapper: _FilterJit, prepared: _Prepared, outputs: Any) -> Any:
    """The caller's results from the compiled function's `outputs`; what the host learns
    from them."""
    dynamic, out, _, held_indices = outputs
    call, _, host, arrays, ((_, _, decided), _, _, hits) = prepared
    program = wrapper._program
    program.inputs.register(host)
    dynamic_ = iter(dynamic)
    leaves = [
        next(dynamic_) if x is ARRAY else _hand_back(arrays[x.index]) if _is_input(x) else x
        for x in out.leaves
    ]
    for j, i in out.copies:
        _remember(leaves[j], host[i])
    vouched = [
        (h, [leaves[j] for j in where], i) for (h, where), i in zip(out.vouched, held_indices)
    ]
    program.hits.learn(call, vouched, host, (hits, decided))
    return jtu.tree_unflatten(out.treedef, leaves)


class Lowered:
    """A `memox.filter_jit` call lowered (`wrapped.lower(*args, **kwargs)`), as Equinox's
    `Lowered`: `compile()` gives the program compiled, called as the wrapped function."""

    def __init__(self, wrapper: _FilterJit, call: _Call, hits: tuple, lowered: Any):
        self._wrapper, self._call, self._hits, self._lowered = wrapper, call, hits, lowered

    @property
    def lowered(self) -> jax.stages.Lowered:
        """JAX's `Lowered`, of the flat function memox compiles."""
        return self._lowered.lowered

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def compile(self, /, compiler_options: dict[str, str | bool] | None = None) -> Compiled:
        compiled = self._lowered.compile(compiler_options=compiler_options)
        return Compiled(self._wrapper, self._call, self._hits, compiled, compiler_options)

    def __getattr__(self, name: str) -> Any:  # JAX's others: `cost_analysis`, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.lowered, name)


class Compiled:
    """A `memox.filter_jit` call compiled ahead of time: called as the wrapped function,
    it returns what the wrapped function returns, through the wrapper's own steps (the
    caller's arrays taken apart, the fingerprints passed in, the slots given back).

    Its program is fixed. One lowered with hits decided on the host runs where the host
    decides those hits again; any other call runs the program with none decided (the
    in-graph check), compiled once, at the first such call."""

    def __init__(self, wrapper: _FilterJit, call: _Call, hits: tuple, compiled: Any, options: Any):
        self._wrapper, self._call, self._hits, self._compiled = wrapper, call, hits, compiled
        self._options = options
        self._checked: Any = compiled if not hits else None  # the program with none decided

    @property
    def compiled(self) -> jax.stages.Compiled:
        """JAX's `Compiled`, of the flat function memox compiles."""
        return self._compiled.compiled

    def as_text(self, *args: Any, **kwargs: Any) -> str | None:
        return self.compiled.as_text(*args, **kwargs)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return _called(self._wrapper, args, kwargs, self._run)

    def _run(self, wrapper: _FilterJit, prepared: _Prepared) -> tuple[_Prepared, Any]:
        if prepared.call != self._call:
            raise TypeError(_errors.FILTER_JIT_COMPILED_CALL.format(name=_names(wrapper.fun)[0]))
        if prepared.compiled_args[3] == self._hits:
            program = self._compiled
        else:
            prepared = prepared.without_hits()
            program = self._checked
            if program is None:
                lowered = wrapper._program.compiled.lower(*prepared.compiled_args)
                program = self._checked = lowered.compile(compiler_options=self._options)
        return prepared, program(*prepared.compiled_args)

    def __getattr__(self, name: str) -> Any:  # JAX's others: `memory_analysis`, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.compiled, name)


@dataclasses.dataclass(frozen=True)
class _Call:
    """What a call is compiled for (hashable: a static argument): the tree structure of
    `(fun, args, kwargs)`, every leaf that is not an array, and where the arrays of the
    first argument are (donated on their own under `donate="*-except-first"`)."""

    treedef: Any
    leaves: tuple[Any, ...]  # the leaf where static, else `ARRAY`
    first: tuple[int, int]  # arrays [start, stop) of the first argument
    n_arrays: int
    empty_slots: bool = dataclasses.field(compare=False)

    def __hash__(self) -> int:
        # Hashed once: `jax.jit` hashes it at every call (a static argument).
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.treedef, self.leaves, self.first, self.n_arrays))
            object.__setattr__(self, "_hash", found)
        return found

    @classmethod
    def split(cls, fun: Any, args: tuple, kwargs: dict, donate: str) -> tuple[_Call, list]:
        leaves, treedef = jtu.tree_flatten((fun, args, kwargs))
        arrays: list[Any] = []
        statics = hashable_partition(leaves, arrays)
        empty = holds_empty((fun, args, kwargs), leaves, treedef)
        first = (0, 0)
        if donate.endswith("except-first") and args:
            start = sum(map(eqx.is_array, jtu.tree_leaves(fun)))
            first = (start, start + sum(map(eqx.is_array, jtu.tree_leaves(args[0]))))
        return cls(treedef, statics, first, len(arrays), empty), arrays

    def groups(self, arrays: list) -> tuple[list, list]:
        """The arrays of the first argument (where donated apart), and the others."""
        a, b = self.first
        return arrays[a:b], arrays[:a] + arrays[b:]

    def merge(self, first: list, rest: list) -> list:
        a, b = self.first
        return rest[:a] + first + rest[a:]

    def donated(self, donate_first: bool, donate_rest: bool) -> list[bool]:
        a, b = self.first
        flags = [donate_rest] * self.n_arrays
        if donate_first != donate_rest:
            flags[a:b] = [donate_first] * (b - a)
        return flags

    def rebuild(self, arrays: list) -> tuple[Any, tuple, dict]:
        return jtu.tree_unflatten(self.treedef, hashable_combine(self.leaves, iter(arrays)))


@dataclasses.dataclass(frozen=True)
class _Out:
    """The compiled function's outputs other than its arrays: one leaf that is not an
    array, which Equinox returns as it is (static; not a pytree node, so nothing to
    flatten at each call). `vouched`: the slots whose state after the call the host
    records (`_decided.Hits`), with the positions of their entries among the output's
    leaves; `copies`: (output leaf, input) where an output is a copy of an input a check
    reads."""

    treedef: Any
    leaves: tuple[Any, ...]
    vouched: tuple[tuple[_decided.Held, tuple[int, ...]], ...]
    copies: tuple[tuple[int, int], ...]


def _slots_in(tree: Any) -> tuple[list[Memo], list[bool]]:
    """The slots in `tree` (the step's output; walked once per trace), and for each of
    its leaves whether it is a slot's."""
    slots, in_slot = [], []
    for x in jtu.tree_leaves(tree, is_leaf=is_memo):
        if is_memo(x):
            slots.append(x)
            in_slot.extend([True] * len(jtu.tree_leaves(x)))
        else:
            in_slot.append(False)
    return slots, in_slot


def _deleted_inputs(args: tuple, kwargs: dict) -> bool:
    return any(is_concrete_array(x) and x.is_deleted() for x in jtu.tree_leaves((args, kwargs)))


# The arrays `memox.filter_jit` gave back in place of a copy (slots' arrays passed
# through), by id, held weakly.
_handed_back: dict[int, weakref.ref] = {}


def _hand_back(x: Any) -> Any:
    """An input array given back as the output it was (a NumPy input as a JAX array),
    recorded as given back."""
    if not isinstance(x, jax.Array):
        return jnp.asarray(x)  # a new array: the caller's is NumPy
    if not is_concrete_array(x):  # inside an outer trace: nothing is donated
        return x
    key = id(x)
    ref = _handed_back.get(key)
    if ref is None or ref() is not x:
        _handed_back[key] = weakref.ref(x, functools.partial(_forget, _handed_back, key))
    return x


def _forget(table: dict, key: int, ref: weakref.ref) -> None:
    """Drop `table`'s entry for `key` where it is still the one `ref` was made for."""
    entry = table.get(key)
    if entry is ref or (isinstance(entry, tuple) and entry[0] is ref):
        table.pop(key, None)


def _unshared(arrays: list, donated: list[bool]) -> list:
    """`arrays`, with a copy of each one to be donated that was given back in place of a
    copy: the tree it came from still holds it (`eqx.filter_jit` would have donated the
    copy it returned)."""
    shared = []
    for i, (x, donate) in enumerate(zip(arrays, donated)):
        ref = _handed_back.get(id(x)) if donate else None
        if ref is not None and ref() is x:
            shared.append(i)
    if not shared:
        return arrays
    out = list(arrays)
    for i, x in zip(shared, copied([arrays[i] for i in shared])):
        out[i] = x
    return out


# Copies `memox.filter_jit` returned of the caller's arrays that a check reads, by id,
# held weakly, each with the array it copies (held while the copy lives): the host's
# decisions go by identity (`_prehash.Inputs`, `_decided.Hits`), and a copy holds the
# same values as its original, both immutable. A cache: cleared, the next call hashes
# the copies (in-graph) and decides nothing on the host, once.
_copies: dict[int, tuple[weakref.ref, jax.Array]] = {}
register("filter_jit copies", _copies)


def _remember(copy: Any, original: Any) -> None:
    if is_concrete_array(copy) and is_concrete_array(original) and copy is not original:
        key = id(copy)
        ref = weakref.ref(copy, functools.partial(_forget, _copies, key))
        _copies[key] = (ref, original)


def _originals(arrays: list, positions: frozenset[int]) -> list:
    """`arrays`, with the original in place of each copy at `positions` (while the
    original is usable)."""
    if not _copies or not positions:
        return arrays
    found = None
    for i in positions:
        if i >= len(arrays):
            continue
        entry = _copies.get(id(arrays[i]))
        if entry is not None and entry[0]() is arrays[i] and not entry[1].is_deleted():
            found = list(arrays) if found is None else found
            found[i] = entry[1]
    return arrays if found is None else found
