"""Every public name has a runnable example, and it runs.

The examples assume what the API reference says: `jax`, `jax.numpy as jnp`, `equinox as
eqx` and `memox` imported, the class `Foo` of `memox.Memo`'s example, and
`foo = Foo(jnp.ones((3, 3)))`. Each example runs on its own, from that setup.
"""

import importlib
import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import memox
import memox.internal
import memox.policies


def public_names() -> list[tuple[str, object]]:
    """Every public name of `memox`, `memox.policies`, `memox.internal` and
    `memox.diffrax` (where diffrax is installed), by its full name."""
    modules = [memox, memox.policies, memox.internal]
    try:
        modules.append(importlib.import_module("memox.diffrax"))
    except ImportError:
        pass
    names = []
    for module in modules:
        for name in dir(module):
            obj = getattr(module, name)
            if name.startswith("_") or type(obj) is type(memox):
                continue
            if module is not memox and getattr(memox, name, None) is obj:
                continue  # imported there from `memox`
            names.append((f"{module.__name__}.{name}", obj))
    return names


def examples(obj: object) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", obj.__doc__ or "", flags=re.S)
    return [textwrap.dedent(block) for block in blocks]


NAMES = public_names()
SETUP = examples(memox.Memo)[0] + "\nfoo = Foo(jnp.ones((3, 3)))\n"


def test_the_names_are_found():
    found = {name for name, _ in NAMES}
    assert {"memox.call", "memox.Memo", "memox.policies.Drift", "memox.internal.Spec"} <= found


@pytest.mark.parametrize("name, obj", NAMES, ids=[name for name, _ in NAMES])
def test_example_runs(name, obj):
    codes = examples(obj)
    assert codes, f"`{name}`'s docstring has no ```python example"
    namespace = {"jax": jax, "jnp": jnp, "eqx": eqx, "memox": memox}
    exec(compile(SETUP, "<setup>", "exec"), namespace)
    # diffrax 0.7.2's own solves fail JAX's leak checker (see tests/test_diffrax.py).
    with jax.check_tracer_leaks(not name.startswith("memox.diffrax.")):
        for code in codes:
            exec(compile(code, f"<{name} docstring>", "exec"), namespace)
