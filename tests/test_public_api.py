"""The public names, and every docstring example runs."""

import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp

import memox


PUBLIC = ["Memo", "cached", "call", "jit", "init", "clear", "stats", "SlotStats"]


def test_public_names():
    for name in PUBLIC:
        assert hasattr(memox, name), name
    assert isinstance(memox.__version__, str)
    assert callable(memox.internal.fingerprint)


def _examples(obj):
    doc = obj.__doc__ or ""
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    return [textwrap.dedent(b) for b in blocks]


def test_every_public_callable_has_an_example():
    for name in ["Memo", "cached", "call", "jit", "init", "clear", "stats"]:
        assert _examples(getattr(memox, name)), name


def test_docstring_examples_run_in_order():
    # Memo's example defines `Foo`; init's makes `foo`; the others use them.
    namespace = {"jax": jax, "jnp": jnp, "eqx": eqx, "memox": memox}
    for name in ["Memo", "cached", "init", "call", "jit", "clear", "stats"]:
        for code in _examples(getattr(memox, name)):
            exec(compile(code, f"<memox.{name} docstring>", "exec"), namespace)
    assert memox.stats(namespace["foo"])["b_cache"].misses >= 1
