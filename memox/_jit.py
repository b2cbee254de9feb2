"""`memox.jit`: `memox.call` compiled, with only the slots crossing the jit boundary.

A jitted function that returns the module it was given copies every array of it on
every call (XLA gives each output a fresh buffer). Inside `memox.call` nothing but
slots can change, so the compiled function returns only the slots it actually wrote
(known at trace time) and the wrapper splices them into the caller's module outside
the compiled code: every other leaf of the returned module is the caller's own array.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx

from ._call import Fn, allocate_plain_slots, check_fn, check_module, run
from ._slot import is_memo, replace_slots


M = TypeVar("M")


def _split(module: Any) -> tuple[Any, Any]:
    return eqx.partition(module, is_memo, is_leaf=is_memo)


def jit(fn: Fn, /) -> Callable[..., tuple[Any, Any]]:
    """Compile `memox.call(module, fn, ...)`, with `eqx.filter_jit` semantics.

    **Arguments:**

    - `fn`: the function to run, called as `fn(module, *args, **kwargs)`.

    Arrays anywhere in `module` and the arguments are traced; everything else is static.
    Before the first trace, the module's slots for methods without arguments are
    allocated, so a loop `out, model = step(model, x)` traces once.

    **Returns:**

    A function `wrapped(module, *args, **kwargs) -> (result, new_module)`. The arrays of
    `new_module` that did not change are the caller's own (no copy crosses the boundary).

    !!! Example

        ```python
        use_b = memox.jit(lambda f: f.b())
        b, foo = use_b(foo)   # compiled once; a hit when `foo.a` has not changed
        ```
    """
    check_fn("jit", fn)

    def slots_only(slots: Any, rest: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        module = eqx.combine(slots, rest, is_leaf=is_memo)
        result, _, changed = run(module, fn, args, kwargs)
        # Paths are static outputs; the changed slots are the only arrays returned.
        return result, tuple(changed), tuple(changed.values())

    compiled = eqx.filter_jit(slots_only)

    @functools.wraps(fn)
    def wrapped(module: M, /, *args: Any, **kwargs: Any) -> tuple[Any, M]:
        check_module("jit", module)
        module = allocate_plain_slots(module)
        slots, rest = _split(module)
        result, paths, new_slots = compiled(slots, rest, args, kwargs)
        return result, replace_slots(module, dict(zip(paths, new_slots)))

    return wrapped
