"""`memox.cached`: binding a method to a slot, and what happens when it is called.

Inside a `memox.call` (a frame is current, `_context.py`), calling a cached method finds
its slot in the frame, plans the call (`_plan.py`: dependencies, static key, the slot
fitted to the value) and runs the memoised operation (`_memo.py`). Outside a frame it
simply computes, and under a trace warns once per method (`memox.call` would have
cached it). Where a frame is current but cannot reach the slot (the method runs
inside a transformation opened inside `fn`, or on a module the call does not hold), it
computes and warns: memox is never silently inert. So it does where no frame is current
on its thread but a call running on another thread holds its slot (a worker thread or a
host callback started inside `fn`): a call's frame is live on its own thread only.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import sys
import types
import typing
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, TypeVar

import equinox as eqx

from . import _context, _errors, _jax_internals, _ledger, _prehash
from ._hoisted import Hoisted
from ._memo import memoised
from ._plan import Call, Method, latest
from ._policy import Exact, Policy
from ._slot import Memo, admits_none, annotations_of, is_memo_annotation
from ._token import token
from ._typing import P, R


if TYPE_CHECKING:
    from ._plan import Plan

# The class a cached method is defined on (the type of its `self`).
Owner = TypeVar("Owner")


# -- the decorator --------------------------------------------------------------------


class CachedMethod(Generic[Owner, P, R]):
    """A method bound to a `memox.Memo` slot: what `memox.cached` returns.

    Typed as the method it wraps: `CachedMethod[Foo, P, R]` for a method
    `def m(self, *args: P.args, **kwargs: P.kwargs) -> R` of `Foo`. Read from the class
    (`Foo.m`), it is itself, called as `Foo.m(foo, *args)`: the method to give
    `memox.call(foo, Foo.m)` or `memox.invalidate(foo, Foo.m)`. Read from an instance
    (`foo.m`), a bound method `(*args: P.args, **kwargs: P.kwargs) -> R`. Its `slot` and
    `policy` are those given to `memox.cached`.

    !!! Example

        ```python
        assert isinstance(Foo.b, memox.CachedMethod)
        assert (Foo.b.slot, Foo.b.policy) == ("b_cache", memox.policies.Exact())
        ```
    """

    def __init__(self, fn: Callable[Concatenate[Owner, P], R], slot: str, policy: Policy):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.slot = slot
        self.policy = policy
        self.qualname: str = getattr(fn, "__qualname__", repr(fn))
        self._spec: Method | None = None
        # A definition error that Python 3.11 would hide (see `__set_name__`).
        self.error: Exception | None = None
        # Whether the slot's field is declared `Memo[...] | None`: where it holds `None`,
        # that instance has no slot by design, and the method computes, saying nothing.
        self.optional = False
        # The registry of the warning that it runs traced outside `memox.call`.
        self._warned: dict[Any, Any] = {}
        params = list(inspect.signature(fn).parameters.values())[1:]
        required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.takes_arguments = any(
            p.default is p.empty and (p.kind in required or p.kind == p.KEYWORD_ONLY)
            for p in params
        )

    def __memox_token_parts__(self) -> tuple[Any, ...]:
        """What the cache key takes of this method (`_token.py`): its function, slot and
        policy, each by content."""
        return (self.fn, self.slot, self.policy)

    @property
    def spec(self) -> Method:
        """What planning needs of this method (made at first use, once its class is
        bound to its name, so that the key can name the method across processes)."""
        if self._spec is None:
            self._spec = Method(self.fn, self.slot, self.policy, self.qualname, token(self))
        return self._spec

    @property
    def latest_plan(self) -> Plan | None:
        """The plan of the last call (for `memox.stats` of a method with arguments)."""
        return latest(self.spec)

    def __set_name__(self, owner: type, name: str) -> None:
        self.qualname = f"{owner.__qualname__}.{name}"
        try:
            self.optional = _check_owner(owner, name, self.slot)
        except (TypeError, ValueError) as e:
            # Python 3.11 wraps an error raised here in a `RuntimeError` that hides the
            # message; there it is raised as `ABCMeta` (an `eqx.Module`'s metaclass)
            # finishes the class, below, or else at the method's first use.
            if sys.version_info >= (3, 12):
                raise
            self.error = e

    @property
    def __isabstractmethod__(self) -> bool:
        """Whether the method is abstract, as for `property`. `ABCMeta` asks every
        attribute of a class it creates, right after `__set_name__`: on Python 3.11 a
        definition error is raised here, unwrapped, as the class is created."""
        if self.error is not None:
            raise self.error
        return getattr(self.fn, "__isabstractmethod__", False)

    @typing.overload
    def __get__(self, instance: None, owner: type | None = None) -> CachedMethod[Owner, P, R]: ...
    @typing.overload
    def __get__(self, instance: Owner, owner: type | None = None) -> Callable[P, R]: ...
    @typing.overload  # held by an object of another class (a field of `_plan.Call`)
    def __get__(
        self, instance: object, owner: type | None = None
    ) -> CachedMethod[Owner, P, R]: ...
    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, module: Owner, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.error is not None:
            raise self.error
        held = getattr(module, "__dict__", {}).get(self.slot)
        if isinstance(held, Hoisted):  # read ahead by `memox.hoist`
            if args or kwargs:
                raise TypeError(_errors.HOISTED_WITH_ARGUMENTS.format(method=self.qualname))
            return held.read(self.spec, module)
        frame = _context.top()
        if held is None and self.slot in getattr(module, "__dict__", {}):  # no slot here
            if not self.optional and frame is not None and not isinstance(frame, _context.Plain):
                message = _errors.NONE_SLOT.format(cls=type(module).__name__)
                _ledger.record_uncached(self.qualname, message.replace("{slot}", self.slot))
                with _ledger.uncached_scope(self.qualname):
                    return self.fn(module, *args, **kwargs)
            return self.fn(module, *args, **kwargs)
        if isinstance(frame, _context.Plain):
            frame.nested = True
        elif frame is not None:
            path = frame.find(module, self.slot)
            if path is None:  # not this call's slot: computes, and the call says so
                message = _errors.UNREACHED_SLOT.replace("{slot}", self.slot)
                _ledger.record_uncached(self.qualname, message)
                with _ledger.uncached_scope(self.qualname):
                    return self.fn(module, *args, **kwargs)
            call = Call.prepare(self.spec, frame, path, module, args, kwargs)
            if frame.discover:  # `memox.init`: allocate the slot, then compute
                frame.write(path, call.slot, self.qualname)
                return self.fn(module, *args, **kwargs)
            return memoised(call)
        elif _context.elsewhere(module, self.slot):  # a call on another thread holds it
            message = _errors.OTHER_THREAD.format(method=self.qualname, slot=self.slot)
            warnings.warn(message, _errors.UncachedWarning, stacklevel=2)
        else:
            api = _tracing()
            if api is not None:  # traced, but no `memox.call`: say so
                self._warn_uncached(api)
        return self.fn(module, *args, **kwargs)

    def _warn_uncached(self, api: str) -> None:
        """Warn that this method runs under `api` outside any `memox.call`: once per
        method (its own registry, the warning placed at its definition), by the standard
        rules otherwise (a filter that shows every warning, or raises, applies here too,
        and a change of filters shows it again)."""
        code = getattr(self.fn, "__code__", None)
        warnings.warn_explicit(
            _errors.NO_CALL.format(method=self.qualname, api=api),
            _errors.UncachedWarning,
            filename="<memox>" if code is None else code.co_filename,
            lineno=0 if code is None else code.co_firstlineno,
            module=getattr(self.fn, "__module__", None),
            registry=self._warned,
        )

    def __repr__(self) -> str:
        return f"<memox.cached('{self.slot}') {self.qualname}>"


# Parameters that memox validates itself, with messages that say what to do, are typed
# for static checkers only: a runtime type checker would otherwise answer first.
if TYPE_CHECKING:
    SlotName: typing.TypeAlias = str
    PolicyArg: typing.TypeAlias = Policy | None
else:
    SlotName = PolicyArg = Any


@typing.overload
def cached(
    slot: str, /, *, policy: Policy = Exact()
) -> Callable[[Callable[Concatenate[Owner, P], R]], CachedMethod[Owner, P, R]]: ...
@typing.overload
def cached(
    slot: str, method: Callable[Concatenate[Owner, P], R], /, *, policy: Policy = Exact()
) -> CachedMethod[Owner, P, R]: ...
def cached(
    slot: SlotName, method: Callable[..., Any] | None = None, /, *, policy: PolicyArg = None
) -> Any:
    """Bind a method of an `eqx.Module` to one of its `memox.Memo` slots.

    **Arguments:**

    - `slot`: the name of a field of the same class declared as `memox.Memo[...]`.
    - `method`: the method (usually omitted: `cached("slot")` is a decorator).
    - `policy`: when a stored value may be reused (`memox.policies`): `Exact()` (the
      default) while nothing it depends on has changed; `Drift(rtol=...)` while its
      dependencies stay within a tolerance; `Manual()` until `memox.invalidate`. Each
      takes `max_age=k` to recompute after `k` hits.

    **Returns:**

    A `memox.CachedMethod` (with `method` omitted, a decorator that makes one), typed as
    the method it wraps.

    Inside `memox.call` or `memox.jit`, the method returns the slot's value when nothing
    it depends on has changed (the module's arrays it reads, the module's static fields,
    its own arguments) and computes and stores it otherwise. Outside them it simply
    computes: eagerly without a word, and under a JAX transformation (`jax.jit`,
    `jax.vmap`, `jax.grad`, ...) with a `memox.UncachedWarning`, once per method.
    Arguments the method takes are part of the cache key.

    A host callback in the method (`jax.debug.callback`, `jax.debug.print`) runs only
    when it computes, yet costs every call of a compiled step, hits included: JAX
    dispatches a program with an effect through its Python path and, on CPU, waits for
    it (0.6-0.7 ms more per `memox.jit` call of a 40-leaf model). Read `memox.stats` for
    hits and misses; keep a counting callback behind a static field (docs/performance.md,
    "A host callback in a cached method costs every step").

    !!! Example

        ```python
        class Gram(eqx.Module):
            x: jax.Array
            chol_cache: memox.Memo[jax.Array] = memox.Memo()

            @memox.cached("chol_cache")
            def chol(self):
                return jnp.linalg.cholesky(self.x @ self.x.T + jnp.eye(3))

        L, model = memox.call(Gram(jnp.eye(3)), Gram.chol)
        ```
    """
    if not isinstance(slot, str):
        raise TypeError(_errors.SLOT_NAME_NOT_STR.format(slot=slot))
    policy = Exact() if policy is None else policy
    if not isinstance(policy, Policy):
        raise TypeError(_errors.NOT_A_POLICY.format(got=type(policy).__name__))
    if method is None:
        return lambda fn: CachedMethod(fn, slot, policy)
    return CachedMethod(method, slot, policy)


def _tracing() -> str | None:
    """What traces a cached method run outside any `memox.call`, in words: a memox
    wrapper, else a JAX transformation. None where it runs eagerly: there it is an
    ordinary method call, seen computing, and says nothing."""
    if _context.pins() is not None:
        return "`memox.scan`"
    if _prehash.tracing():
        return "`memox.filter_jit`"
    if _jax_internals.transforming():
        return "a JAX transformation (`jax.jit`, `eqx.filter_jit`, `jax.vmap`, `jax.grad`, ...)"
    return None


def _check_owner(owner: type, name: str, slot: str) -> bool:
    """Refuse a cached method whose class is not an `eqx.Module` or has no such slot;
    else say whether the slot's annotation lets the field hold `None`."""
    where = dict(slot=slot, cls=owner.__name__, name=name)
    if not issubclass(owner, eqx.Module):
        kind = "a `flax.nnx.Module`" if _is_nnx(owner) else "not an `eqx.Module`"
        raise TypeError(_errors.NOT_EQX_MODULE.format(kind=kind, **where))
    annotations: dict[str, Any] = {}
    for klass in reversed(owner.__mro__):
        annotations.update(annotations_of(klass))
    slots = [field for field, a in annotations.items() if _declares_slot(owner, field, a)]
    if slot not in slots:
        others = _other_slots(slot, slots)
        if slot not in annotations:
            raise ValueError(_errors.UNKNOWN_SLOT.format(**where, **others))
        annotation = annotations[slot]
        shown = getattr(annotation, "__qualname__", None) or str(annotation)
        raise ValueError(_errors.NOT_A_MEMO_FIELD.format(annotation=shown, **where, **others))
    for other_name, other in cached_methods(owner, skip=name).items():
        if other.slot == slot:
            raise ValueError(_errors.SLOT_TAKEN.format(other=other_name, **where))
    return admits_none(annotations[slot])


def _declares_slot(owner: type, field: str, annotation: Any) -> bool:
    """Whether `owner`'s field `field`, annotated `annotation`, is a `memox.Memo` slot."""
    default = next((k.__dict__[field] for k in owner.__mro__ if field in k.__dict__), None)
    default = getattr(default, "default", default)  # a field made by `Memo.__set_name__`
    return isinstance(default, Memo) or is_memo_annotation(annotation)


def _other_slots(slot: str, slots: list[str]) -> dict[str, str]:
    """The parts of a message that list a class's slots, the closest to `slot` first."""
    if not slots:
        return dict(known="", other="")
    hints = _errors.SLOT_HINTS
    closest = difflib.get_close_matches(slot, slots, n=1)
    known = hints["closest"].format(closest=closest[0]) if closest else ""
    known += hints["known"].format(fields=", ".join(f"`{s}`" for s in slots))
    return dict(known=known, other=hints["other"])


def _is_nnx(cls: type) -> bool:
    return any(k.__module__.startswith("flax.nnx") for k in cls.__mro__)


def cached_methods(cls: type, skip: str | None = None) -> dict[str, CachedMethod]:
    """The cached methods of `cls` by attribute name (subclasses override bases).

    !!! Example

        ```python
        assert memox.internal.cached_methods(Foo) == {"b": Foo.b}
        ```
    """
    found: dict[str, CachedMethod] = {}
    for klass in reversed(cls.__mro__):
        for attr, value in klass.__dict__.items():
            if attr == skip:
                found.pop(attr, None)
            elif isinstance(value, CachedMethod):
                found[attr] = value
            else:
                found.pop(attr, None)
    return found


def method_for(owner: Any, field: str) -> CachedMethod | None:
    """The cached method bound to `owner.<field>`, if any."""
    for method in cached_methods(type(owner)).values():
        if method.slot == field:
            return method
    return None
