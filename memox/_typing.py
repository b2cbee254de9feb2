"""Type variables of the public API, and the types of the arguments memox checks itself.

memox validates `fn` and `*methods` with messages that say what to do: `fn` must be
callable and a method must be passed unbound; `*methods` must be cached methods. The
test suite runs memox under a run-time type checker (beartype, through jaxtyping's
import hook), which would answer first with a generic message. So `Callable` and
`CachedMethod` imported from here are the real types for static checkers and the API
reference, and are not checked at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar


# A module (any pytree). Bound to `Any` so that a checker gives the parameter of a lambda
# passed to `memox.jit` the type `Any`, not `object`: nothing tells it the module's type.
M = TypeVar("M", bound=Any)
# The result of a function run by `memox.call`, of a cached method.
R = TypeVar("R")
# The parameters after the module of such a function, or after `self` of a cached method.
P = ParamSpec("P")

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._cached import CachedMethod
else:

    class Callable:
        """`collections.abc.Callable` for static checkers; `Callable[...]` is `Any` at
        run time."""

        def __class_getitem__(cls, item: Any) -> Any:
            return Any

    CachedMethod = Any
