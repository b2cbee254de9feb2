"""Type variables of the public API, and `Fn`: a callable type that run-time checkers skip.

memox validates `fn` itself, with messages that say what to do (it must be callable, and
a method must be passed unbound). The test suite runs memox under a run-time type checker
(beartype, through jaxtyping's import hook), which would answer first with a generic
message: `Fn[[A, B], R]` is `Callable[[A, B], R]` for static checkers and `Any` at run
time.
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
    from collections.abc import Callable as Fn
else:

    class Fn:
        """`collections.abc.Callable` for static checkers; `Fn[...]` is `Any` at run time."""

        def __class_getitem__(cls, item: Any) -> Any:
            return Any
