"""The signatures of the public names show public types only (issue 33).

The API reference renders these signatures: the overloads of a function that has them,
a class's constructor as `help()` shows it. Every name in an annotation must be public
or standard, a default is shown as a value, and no internal marker appears.
"""

import builtins
import collections.abc
import inspect
import re
import typing

import jaxtyping
import pytest
from test_docstring_examples import NAMES

import memox


def signatures(obj: object) -> list[inspect.Signature]:
    """What the API reference shows: the overloads, else the signature."""
    overloads = typing.get_overloads(obj) if inspect.isfunction(obj) else []
    if overloads:
        return [inspect.signature(f) for f in overloads]
    try:
        return [inspect.signature(obj)]  # pyright: ignore[reportArgumentType]
    except ValueError:  # a warning class: built in, no signature to show
        return []


def declared_by_memox(cls: type, field: str) -> bool:
    """Whether the constructor's parameter `field` is declared by memox, not inherited
    from a third-party class (`memox.diffrax.FixedVeryChord` takes diffrax's fields)."""
    for klass in cls.__mro__:
        if field in klass.__dict__.get("__annotations__", {}):
            return klass.__module__.startswith("memox")
    return True


# The names an annotation may use: standard ones, the type variables of memox's
# signatures, and memox's own public names.
TYPE_VARIABLES = {"M", "P", "R", "C", "X", "Y", "Owner", "T", "args", "kwargs"}
STANDARD = {*dir(builtins), *dir(typing), *dir(collections.abc), *dir(jaxtyping)}
STANDARD |= {"Array", "ArrayLike", "PyTree", "jax", "jtu", "tree_util", "PyTreeDef", "KeyPath"}
STANDARD |= {"AbstractImplicitSolver"}  # diffrax's
PUBLIC = {name.rpartition(".")[2] for name, _ in NAMES}


def problems(name: str, sig: inspect.Signature, cls: type | None) -> list[str]:
    found = []
    texts = [("return", sig.return_annotation, inspect.Parameter.empty)]
    for p in sig.parameters.values():
        if cls is not None and not declared_by_memox(cls, p.name):
            continue
        texts.append((p.name, p.annotation, p.default))
        variadic = p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        internal = name.startswith("memox.internal.")  # no stability promise
        if p.annotation in ("Any", typing.Any) and not variadic and not internal:
            found.append(f"`{p.name}: Any`: say what it takes")
        # (`<factory>` is a dataclass's `default_factory`: the page shows the call.)
        shown = repr(p.default) == "<factory>" or repr(p.default)[0] != "<"
        if p.default is not p.empty and (p.default is ... or not shown):
            found.append(f"`{p.name}`'s default is not shown as a value: {p.default!r}")
    for where, annotation, _ in texts:
        if annotation is inspect.Parameter.empty:
            continue
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        text = re.sub(r"(['\"]).*?\1", "", text)  # jaxtyping's shape strings
        for word in re.findall(r"[A-Za-z_]\w*", text):
            if word not in STANDARD | TYPE_VARIABLES | PUBLIC:
                found.append(f"`{where}`'s annotation names `{word}`: {text}")
    return found


@pytest.mark.parametrize("name, obj", NAMES, ids=[name for name, _ in NAMES])
def test_signature_shows_public_types(name, obj):
    cls = obj if inspect.isclass(obj) else None
    found = [x for sig in signatures(obj) for x in problems(name, sig, cls)]
    assert not found, f"`{name}`: " + "; ".join(found)


@pytest.mark.parametrize("name", ["Memo", "cached", "jit", "filter_jit", "invalidate"])
def test_documented_signatures(name):
    # The signatures issue 33 found missing or showing internals, as they read now.
    shown = " | ".join(str(sig) for sig in signatures(getattr(memox, name)))
    expected = {
        "Memo": "(*, size: int = 1)",
        "cached": "policy: 'Policy' = Exact(max_age=None)",
        "jit": "fn: 'Callable[Concatenate[M, P], R]'",
        "filter_jit": "fun: 'Callable[P, R]'",
        "invalidate": "*methods: 'CachedMethod', when: \"Bool[ArrayLike, '']\" = True",
    }[name]
    assert expected in shown
