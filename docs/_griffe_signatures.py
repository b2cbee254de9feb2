"""A griffe extension for the API reference: the constructors of `eqx.Module` classes.

griffe reads source, and an `eqx.Module` gets its `__init__` from `dataclasses` at run
time, so griffe finds none. For a class with no `__init__` in its source, this gives
griffe the signature `help()` shows (`inspect.signature` of the class). Annotations are
as written in memox's source; a third-party type or default is named by its public
package (`lineax.AbstractLinearSolver`, not `lineax._solve.AbstractLinearSolver`).
"""

import importlib
import inspect
import re
import sys
from typing import Any

import equinox as eqx
import griffe


# Prefixes a reader does not need before a standard name.
_DROPPED = re.compile(r"\b(?:builtins|collections\.abc|typing|jaxtyping)\.")
# A dotted path with a private part: `lineax._solve.AbstractLinearSolver`.
_PRIVATE_PATH = re.compile(r"\b([A-Za-z]\w*)((?:\.\w+)*\._\w+(?:\.\w+)*)\.(\w+)\b")


def _public(match: re.Match[str]) -> str:
    """A private dotted path as its top-level package's name for the object, or as
    `jax.`'s (`jaxlib._jax.Array` is `jax.Array`)."""
    top, name = match.group(1), match.group(3)
    target = getattr(sys.modules.get(f"{top}{match.group(2)}"), name, None)
    for package in (top, "jax"):
        module = sys.modules.get(package)
        if target is not None and getattr(module, name, None) is target:
            return f"{package}.{name}"
    return match.group(0)


def _text(x: Any) -> str:
    text = x if isinstance(x, str) else inspect.formatannotation(x)
    return _PRIVATE_PATH.sub(_public, _DROPPED.sub("", text))


def _default(x: Any) -> str:
    if inspect.isfunction(x) or inspect.isclass(x):
        return _text(f"{x.__module__}.{x.__qualname__}")
    text, cls = repr(x), type(x)
    if cls.__module__ != "builtins" and text.startswith(f"{cls.__name__}("):
        return _text(f"{cls.__module__}.{cls.__qualname__}") + text.removeprefix(cls.__name__)
    return _text(text)


class ModuleSignatures(griffe.Extension):
    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if "__init__" in cls.members:
            return
        obj: Any = importlib.import_module(cls.module.path)
        for name in cls.path.removeprefix(cls.module.path + ".").split("."):
            obj = getattr(obj, name, None)
        if not (inspect.isclass(obj) and issubclass(obj, eqx.Module)):
            return
        parameters = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
        for p in inspect.signature(obj).parameters.values():
            parameters.append(
                griffe.Parameter(
                    p.name,
                    annotation=None if p.annotation is p.empty else _text(p.annotation),
                    kind=griffe.ParameterKind(p.kind.description),
                    default=None if p.default is p.empty else _default(p.default),
                )
            )
        init = griffe.Function(
            "__init__", parent=cls, parameters=griffe.Parameters(*parameters), returns="None"
        )
        cls.set_member("__init__", init)
