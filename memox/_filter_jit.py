"""`memox.filter_jit`: `eqx.filter_jit`, where unchanged inputs are not hashed again.

The standard Equinox loop calls `memox.call` inside its own `eqx.filter_jit` step. There
every check of a cached value hashes its dependencies in-graph, on every call: the
frozen backbone of a fine-tuned model and the training inputs, although neither
changed. `memox.filter_jit` is `eqx.filter_jit` (it calls it: same arguments, same
results, same tree structures, same donation) with two additions:

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
3. **No copy of what passes through.** An output that is one of the inputs, unchanged
   (the frozen backbone in the model the step returns), is not an output of the
   compiled function (XLA would copy it into a fresh buffer on every call): the caller's
   own array is put back in its place. So the frozen arrays keep their identity from
   step to step, and (1) and (2) apply to them. Donated inputs are left to XLA (their
   buffers are reused).

**Never deletes what `eqx.filter_jit` would not.** An array given back in place of a
copy (3) is the caller's own, also held by the tree it came from, where
`eqx.filter_jit` would have returned a fresh copy. So where a `memox.filter_jit` call
later donates such an array, it donates a copy of it instead (the copy
`eqx.filter_jit` would have made at the first call): the tree it came from keeps it.
These arrays are known by identity, held weakly (`_handed_back`).

Empty slots in the arguments are allocated before the first trace (as `memox.init`
does), so that a step does not retrace even when the model was not initialised; the `Memo`
nodes of an optimizer state made from `eqx.filter(model, ...)` (leaves `None`) mirror
the model's slots and are left as they are (`_lifecycle.allocated`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _decided, _prehash
from ._jax_internals import is_concrete_array
from ._lifecycle import allocated_once
from ._partition import ARRAY, hashable_combine, hashable_partition
from ._sites import holds_empty
from ._slot import Memo, is_memo
from ._table import copied, entry_leaves


_P = ParamSpec("_P")
_T = TypeVar("_T")
Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")
_SENTINEL: Any = object()


@dataclasses.dataclass(frozen=True)
class _Input:
    """Stands, in the compiled function's outputs, for its `index`-th input array,
    passed through unchanged: the caller's array is put back in its place."""

    index: int


def _is_input(x: Any) -> bool:
    return isinstance(x, _Input)


@overload
def filter_jit(*, donate: Donate = "none") -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...
@overload
def filter_jit(fun: Callable[_P, _T], /, *, donate: Donate = "none") -> Callable[_P, _T]: ...
def filter_jit(fun: Any = _SENTINEL, /, *, donate: Any = "none") -> Any:
    """`eqx.filter_jit`, with the fingerprints of unchanged inputs computed once.

    A drop-in replacement: swap `eqx.filter_jit` for `memox.filter_jit` on a step that
    calls `memox.call`, and nothing else changes (arguments, results, tree structures,
    donation, retracing rules), except that a cached method whose dependencies are
    inputs of the step that did not change (a frozen part of the model, the training
    data) no longer hashes them in-graph at every call: their fingerprints are computed
    outside, once per array object, and passed in. The arrays that merely pass through
    the step (unchanged leaves of the returned model) come back as the caller's own
    objects instead of copies. Where a slot and what its check reads are the very
    arrays of the previous call, the hit is decided before dispatch, and a second
    program (compiled at the second call; at most 4 per signature) reads the value with
    no check; `step.lower(*args)` gives the program a call would run now.

    **Arguments:**

    - `fun`: the function to compile, as for `eqx.filter_jit`.
    - `donate`: as for `eqx.filter_jit`: `"all"`, `"all-except-first"`, `"warn"`,
      `"warn-except-first"` or `"none"` (the default).

    Empty slots in the arguments are allocated before the first trace (as
    `memox.init(module)` does), so the step does not retrace without `memox.init`.

    **Returns:**

    The compiled function, called as `fun` is.

    **When to call `memox.init`:** not for `memox.filter_jit`. Before the first trace,
    the empty slots for methods without arguments in the arguments are allocated (an
    optimizer state's mirrors of them, from `opt.init(eqx.filter(model, ...))`, are
    left alone), so the ordinary loop `model, opt_state = step(model, opt_state)` with
    `memox.call` inside the loss does not retrace on a model never initialised. A slot of a
    cached method that takes arguments (a keyed table) is allocated at its first fill:
    one retrace, unless `memox.init(model, fn, *args)` ran first. (With `eqx.filter_jit`
    in its place, call `memox.init(model)` first: it retraces once at the first fill
    otherwise.)

    **Donation** is `eqx.filter_jit`'s, with one difference that keeps your arrays: an
    array that `memox.filter_jit` gave back in place of a copy (an input passed through)
    is still held by the tree it came from, so a `memox.filter_jit` call that donates it
    donates a copy instead. (Donating it to other code, such as `jax.jit`'s
    `donate_argnums`, deletes it for both.)

    !!! Example

        ```python
        @memox.filter_jit                        # was: @eqx.filter_jit
        def step(foo, x):
            b, foo = memox.call(foo, Foo.b)      # foo.a: hashed outside, once
            return b * x, foo

        y, foo = step(foo, jnp.float32(2.0))
        y, foo = step(foo, jnp.float32(3.0))     # a hit; foo.a is the caller's array
        ```
    """
    if fun is _SENTINEL:
        return functools.partial(filter_jit, donate=donate)
    if donate not in _DONATE:
        eqx.filter_jit(fun, donate=donate)  # raises Equinox's own error
    return _FilterJit.make(fun, donate)


class _FilterJit(eqx.Module):
    """The compiled function. A Module, like `eqx.filter_jit`'s: arrays in `fun` are
    traced, and as a method it receives its instance as its first argument.

    It calls `eqx.filter_jit` (so Equinox's own handling of donation, runtime errors
    and warnings applies) on flat lists of arrays and one hashable description of
    everything else, flattened once here: Equinox and `jax.jit` then have nothing left
    to take apart."""

    fun: Callable  # may hold arrays: traced
    _compiled: Any = eqx.field(static=True, repr=False)  # `eqx.filter_jit`'s wrapper
    _signature: inspect.Signature = eqx.field(static=True, repr=False)
    _inputs: _prehash.Inputs = eqx.field(static=True, repr=False)
    _hits: _decided.Hits = eqx.field(static=True, repr=False)
    _donate: Donate = eqx.field(static=True, repr=False)

    @classmethod
    def make(cls, fun: Callable, donate: Donate) -> Any:
        inputs = _prehash.Inputs()
        donate_first, donate_rest = donate in ("all", "warn"), donate != "none"

        def traced(head: tuple, rest: list, call: _Call, hits: tuple) -> Any:
            first, table, decided = head
            arrays = call.merge(first, rest)
            fn, args, kwargs = call.rebuild(arrays)
            hits_ = dict(zip(hits, decided))
            with _prehash.scope(arrays, table, _prehash.PREHASH_MIN_BYTES, hits_) as scope:
                out = fn(*args, **kwargs)
                inputs.learned(scope.used)
                slots_out = _slots_in(out)
                held = scope.held(slots_out, keeps_indices=not donate_first)
            # Outputs that are inputs passed through unchanged are given back outside
            # (the caller's arrays): not outputs of the compiled function, which would
            # copy them. Donated inputs are left to XLA, which reuses their buffers.
            donated = call.donated(donate_first, donate_rest)
            index = {id(x): i for i, x in enumerate(arrays) if not donated[i]}
            leaves, treedef = jtu.tree_flatten(out)
            dynamic, static = [], []
            for x in leaves:
                if not eqx.is_array(x):
                    static.append(x)
                elif id(x) in index:
                    static.append(_Input(index[id(x)]))
                else:
                    dynamic.append(x)
                    static.append(ARRAY)
            # Where each slot the host can vouch for leaves the call (`_decided.Hits`):
            # the positions of its entry arrays among the output's leaves.
            at = {id(x): j for j, x in enumerate(leaves)}
            vouched = tuple(
                (h, tuple(at[id(x)] for x in entry_leaves(slots_out[k]))) for h, k, _ in held
            )
            out_static = _Out(treedef, tuple(static), vouched)
            # A donated table is returned (unchanged) so that XLA reuses its buffer and
            # `donate="warn"` warns about the caller's arrays only.
            donated_table = (table, decided) if donate_first else None
            return dynamic, out_static, donated_table, [i for _, _, i in held]

        name = getattr(fun, "__name__", type(fun).__name__)
        traced.__name__ = name
        traced.__qualname__ = getattr(fun, "__qualname__", name)
        # The table travels with the first argument: donated with it, and only then.
        compiled = eqx.filter_jit(traced, donate=donate)
        wrapper = cls(fun, compiled, inspect.signature(fun), inputs, _decided.Hits(), donate)
        return eqx.module_update_wrapper(wrapper)

    @property
    def __wrapped__(self) -> Callable:
        return self.fun

    def _prepared(self, args: tuple, kwargs: dict) -> tuple[_Call, list, list, tuple]:
        """A call taken apart: its signature, its input arrays as given and as passed
        (copies of the donated ones given back earlier), and the compiled function's
        arguments, with the hits decided on the host."""
        bound = self._signature.bind(*args, **kwargs)
        args, kwargs = bound.args, bound.kwargs
        call, arrays = _Call.split(self.fun, args, kwargs, self._donate)
        if call.empty_slots:  # rare: allocate empty slots first (once per object)
            args = tuple(map(allocated_once, args))
            kwargs = {k: allocated_once(v) for k, v in kwargs.items()}
            call, arrays = _Call.split(self.fun, args, kwargs, self._donate)
        hits, decided = self._hits.decide(call, arrays)
        given = arrays
        if self._donate != "none" and _handed_back:
            arrays = _unshared(arrays, call.donated(self._donate in ("all", "warn"), True))
        table = self._inputs.table(arrays)
        first, rest = call.groups(arrays)
        return call, given, arrays, ((first, table, decided), rest, call, hits)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        call, given, arrays, compiled_args = self._prepared(args, kwargs)
        dynamic, out, _, held_indices = self._compiled(*compiled_args)
        self._inputs.register(arrays)
        dynamic_ = iter(dynamic)
        leaves = [
            next(dynamic_) if x is ARRAY else _hand_back(arrays[x.index]) if _is_input(x) else x
            for x in out.leaves
        ]
        vouched = [
            (h, [leaves[j] for j in where], i) for (h, where), i in zip(out.vouched, held_indices)
        ]
        hits, (_, _, decided) = compiled_args[3], compiled_args[0]
        self._hits.learn(call, vouched, given, (hits, decided))
        return jtu.tree_unflatten(out.treedef, leaves)

    def lower(self, /, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The program that a call on these arguments would run now, lowered (JAX's
        `Lowered`, as `jax.jit(...).lower` gives): with the hits it would decide on the
        host."""
        return self._compiled.lower(*self._prepared(args, kwargs)[3]).lowered

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return eqx.Partial(self, instance)


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

    @classmethod
    def split(cls, fun: Any, args: tuple, kwargs: dict, donate: str) -> tuple[_Call, list]:
        leaves, treedef = jtu.tree_flatten((fun, args, kwargs))
        arrays: list[Any] = []
        statics = hashable_partition(leaves, arrays)
        empty = holds_empty((fun, args, kwargs), treedef)
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


class _Out(eqx.Module):
    """The compiled function's outputs other than its arrays: carried in its tree
    structure (static). `vouched`: the slots whose state after the call the host records
    (`_decided.Hits`), with the positions of their entries among the output's leaves."""

    treedef: Any = eqx.field(static=True)
    leaves: tuple[Any, ...] = eqx.field(static=True)
    vouched: tuple[tuple[_decided.Held, tuple[int, ...]], ...] = eqx.field(static=True)


def _slots_in(tree: Any) -> list[Memo]:
    """The slots in `tree` (the step's output; walked once per trace)."""
    return [x for x in jtu.tree_leaves(tree, is_leaf=is_memo) if is_memo(x)]


# The arrays `memox.filter_jit` gave back in place of a copy (inputs passed through), by
# id, held weakly.
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
        _handed_back[key] = weakref.ref(x, functools.partial(_forget, key))
    return x


def _forget(key: int, ref: weakref.ref) -> None:
    if _handed_back.get(key) is ref:
        del _handed_back[key]


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
