"""`memox.jit`: `memox.call` compiled, with only slots crossing the jit boundary.

A jitted function that returns the module it was given copies every array of it on
every call (XLA gives each output a fresh buffer). Inside `memox.call` nothing but slots
can change, so the compiled function returns only the slots, and the wrapper splices
them into the caller's module outside the compiled code: every other leaf of the
returned module is the caller's own array. Where every slot of the module was donated,
its slot nodes are given the returned slots (`_donation.hand_over`), so the module passed
in holds what the call returned: it is returned itself, with no new module built (the
threaded loop, `out, model = step(model, x)`).

**Donation.** The slots are donated, so that a hit, whose table passes through
unchanged, copies nothing and a miss writes its entry in place; a slot's arrays are
donated only where nothing the caller holds loses them (`_donation.py`).

**Hits decided on the host.** A slot whose entries and inputs are the very arrays of the
previous call is known to hit before dispatch (`_decided.Hits`): the call runs a program
that takes its value as an input, with no check (decoded from the slot's bits once, on
the host), what a hit leaves unchanged (its entries) passed apart (not donated, and not
read by the program) and kept by the slot's node, which is handed only the counters.

Dependencies that are the caller's arrays are fingerprinted outside the compiled code,
once per array object (`_fingerprint.known`), and passed in (`_prehash.py`, shared
with `memox.filter_jit`): a hit on an unchanged dependency costs O(1), not a pass over
its bytes (and no collective for a sharded one). Which inputs are dependencies is
learned from the first trace. Inputs under 256 KiB are hashed in-graph, with no
`lax.cond` (as `memox.filter_jit`: the branch costs about what hashing them does, and
XLA compiles each conditional apart).

The wrapper flattens its arguments once and calls `jax.jit` directly, with the arrays as
traced arguments and everything else as one hashable static argument (`_partition.py`).
A module passed again with its slots empty (a caller that does not thread the returned
module) gets the slots the last call on that same object returned, by identity: no new
allocation, and no recomputation of what they hold.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, overload

import jax
import jax.tree_util as jtu

from . import _decided, _errors, _prehash
from ._caches import ByIdentity
from ._call import changed_slots, check_fn, check_module, check_slots_first, run
from ._donation import exclusive
from ._lifecycle import allocated
from ._partition import Signature, Signatures, hashable_combine, hashable_partition, refilled
from ._sites import slots
from ._slot import fields_of
from ._table import entry_leaves
from ._typing import M, P, R


class _Static:
    """Non-array outputs, carried in the output's tree structure: a pytree node with no
    children (rebuilt at every call by one Python call; an `eqx.Module`'s costs a few)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


jtu.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: _Static(value))


_SENTINEL: Any = object()


@overload
def jit(
    *, donate: bool = True
) -> Callable[[Callable[Concatenate[M, P], R]], Callable[Concatenate[M, P], tuple[R, M]]]: ...
@overload
def jit(
    fn: Callable[Concatenate[M, P], R], /, *, donate: bool = True
) -> Callable[Concatenate[M, P], tuple[R, M]]: ...
def jit(fn: Any = _SENTINEL, /, *, donate: Any = True) -> Any:
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
    boundary). Where every slot of `module` was donated, `new_module` is `module`
    itself, its slots updated in place; its parameters are never touched. Without `fn`,
    a decorator that returns it.

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
    return _Jit(fn, donate)


class _Jit:
    """The compiled function: takes a call apart on the host, runs `_Body` under
    `jax.jit`, and puts the returned slots into the caller's module."""

    def __init__(self, fn: Callable, donate: bool):
        self.donate = donate
        # Which input arrays cached methods fingerprinted (learned from the traces), and
        # their fingerprints per call, computed outside (`_prehash.py`).
        self._inputs = _prehash.Inputs()
        # Which slots hit, known before a call (`_decided.Hits`).
        self._hits = _decided.Hits()
        self._signatures = Signatures()
        # A module passed again with its slots empty, as by a caller that does not thread
        # the returned module: the slots the last call on it returned, not a new
        # allocation (which also recomputes what they hold).
        self._latest = ByIdentity()
        body = _Body(fn, donate, self._inputs)
        donated = (3,) if donate else ()
        self._compiled = jax.jit(body, static_argnums=(0, 1), donate_argnums=donated)
        # Name, docstring and `__wrapped__`; not `fn.__dict__` (a callable's own fields,
        # such as `donate` or `lower`, would replace the wrapper's).
        functools.update_wrapper(self, fn, updated=())

    def _prepared(self, module: Any, args: tuple, kwargs: dict, donating: bool) -> tuple:
        """A call taken apart: the split, the module it was given where its slots had to
        be allocated or revived, and the arguments of the compiled function (with the
        hits decided on the host, their entries passed apart)."""
        split = Signature.split(module, args, kwargs, donating)
        if jtu.treedef_is_leaf(split.signature.module):
            check_module("jit", module, args, kwargs)
        if not split.slots:
            check_slots_first("jit", args, kwargs)
        given = None
        if not split.ready:  # rare: allocate, or revive
            given, module = module, self._latest.get(module) or allocated(module)
            split = Signature.split(module, args, kwargs, donating)
        split.signature = self._signatures.same(split.signature, module)
        hits, decided = self._hits.decide(split.signature, split.flat)
        slot_leaves, kept = split.parted(hits)
        if donating:
            slot_leaves = split.donated(slot_leaves)
        table = self._inputs.table(split.arrays)
        call = (split.signature, hits, split.arrays, slot_leaves, kept, table, decided)
        return split, given, call

    def __call__(self, module: Any, /, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        with exclusive(self.donate):
            return self._call(module, args, kwargs)

    def _call(self, module: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        split, given, call = self._prepared(module, args, kwargs, self.donate)
        _, hits, *_, decided = call  # (not donated: `Hits.learn` keeps their indices)
        try:
            dynamic, static_out, new_slots, held_indices = self._compiled(*call)
        except BaseException:  # (a failure after the donation: the nodes get empty slots)
            split.hand_over_empty()
            raise
        self._inputs.register(split.arrays)
        treedef, statics, vouched, decided_slots = static_out.value
        new_module = split.hand_over(new_slots, decided_slots)
        vouched = [
            (h, new_slots[k], i)
            for (h, k), i in zip(vouched, held_indices)
            if k in new_slots  # (a vouched slot was written, so it is returned)
        ]
        self._hits.learn(split.signature, vouched, split.flat, (hits, decided), entry_leaves)
        self._signatures.returned(split.signature, new_module)
        if given is not None:
            self._latest.put(given, new_module)
        return jtu.tree_unflatten(treedef, hashable_combine(statics, iter(dynamic))), new_module

    def lower(self, module: Any, /, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The program that a call on these arguments would run now, lowered (JAX's
        `Lowered`, as `jax.jit(...).lower` gives): with the hits it would decide on the
        host."""
        return self._compiled.lower(*self._prepared(module, args, kwargs, False)[2])

    def __get__(self, instance: Any, owner: Any) -> Any:
        del owner
        if instance is None:
            return self
        return functools.partial(self, instance)


class _Body:
    """What `jax.jit` compiles: `memox.call` on the rebuilt arguments, returning the
    result's arrays, the slots, and (static) the rest of the result and what the host
    needs to decide the next call's hits."""

    def __init__(self, fn: Callable, donate: bool, inputs: _prehash.Inputs):
        self.fn = fn
        self.donate = donate
        self.inputs = inputs
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(
        self,
        static: Signature,
        hits: tuple,
        arrays: list,
        slot_leaves: list,
        kept: list,
        table: Any,
        decided: list[_decided.Decided],
    ) -> Any:
        slot_leaves = refilled(len(arrays), hits, slot_leaves, kept)
        module, args, kwargs = static.rebuild(arrays, slot_leaves)
        flat = [*arrays, *(x for leaves in slot_leaves for x in leaves)]
        min_bytes = _prehash.PREHASH_MIN_BYTES
        with _prehash.scope(flat, table, min_bytes, dict(zip(hits, decided))) as scope:
            result, module, frame = run(module, self.fn, args, kwargs)
            self.inputs.learned(scope.used)
            changed = changed_slots(module, frame)
            final = {path: changed.get(path, slot) for path, slot in slots(module).items()}
            held = scope.held(list(final.values()), keeps_indices=True)
        new_slots, counted = self._returned(final, changed, kept)
        # The result as its arrays and the rest: the wrapper rebuilds it with one
        # unflatten, where splitting it into two trees would flatten both at every call.
        leaves, treedef = jtu.tree_flatten(result)
        dynamic: list[Any] = []
        statics = hashable_partition(leaves, dynamic)
        vouched = tuple((h, k) for h, k, _ in held)
        static_out = _Static((treedef, statics, vouched, counted))
        return dynamic, static_out, new_slots, [i for _, _, i in held]

    def _returned(self, final: dict, changed: dict, kept: list) -> tuple[dict, frozenset]:
        """The slots the call returns, by position, and the positions of those whose
        entries are the ones passed apart (a hit decided on the host, nothing else
        written): each of those is returned as its counters alone.

        With donation every allocated slot goes out (an unchanged one aliases its input);
        without, only the changed ones: an unchanged slot stays the caller's. Entries
        passed through are not outputs (XLA would copy them, and each output costs the
        call): the wrapper gives back the caller's arrays."""
        new_slots = {
            k: slot
            for k, (path, slot) in enumerate(final.items())
            if (path in changed or self.donate) and slot.allocated
        }
        passed = {tuple(map(id, entries)) for entries in kept}
        counted = frozenset(
            k for k, slot in new_slots.items() if tuple(map(id, entry_leaves(slot))) in passed
        )
        for k in counted:
            new_slots[k] = fields_of(new_slots[k])["counts"]
        return new_slots, counted
