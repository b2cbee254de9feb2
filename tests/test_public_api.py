"""The public names, and every docstring example runs."""

import pathlib
import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import memox


PUBLIC = [
    "Memo",
    "cached",
    "CachedMethod",
    "call",
    "jit",
    "scan",
    "init",
    "clear",
    "stats",
    "SlotStats",
    "flops",
    "FlopCount",
]


def test_public_names():
    for name in PUBLIC:
        assert hasattr(memox, name), name
    assert isinstance(memox.__version__, str)
    assert callable(memox.internal.fingerprint)


def test_returned_types_are_public():
    # Issue 21: public docstrings named `FlopCount` and `CachedMethod`, which were only in
    # `memox.internal`. A type a public function returns is public, and in one place.
    assert isinstance(memox.flops(jnp.sin, jnp.ones(3)), memox.FlopCount)

    class Foo(eqx.Module):
        a: jax.Array
        b_cache: memox.Memo[jax.Array] = memox.Memo()

        @memox.cached("b_cache")
        def b(self):
            return jnp.sum(self.a)

    assert isinstance(Foo.b, memox.CachedMethod)
    # The old names still work, for one release, with a `DeprecationWarning`.
    for name in ("FlopCount", "CachedMethod"):
        with pytest.warns(
            DeprecationWarning, match=f"`memox.internal.{name}` is now `memox.{name}`"
        ):
            assert getattr(memox.internal, name) is getattr(memox, name)


def _examples(obj):
    doc = obj.__doc__ or ""
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    return [textwrap.dedent(b) for b in blocks]


def test_every_public_callable_has_an_example():
    for name in PUBLIC:
        assert _examples(getattr(memox, name)), name


def test_docstring_examples_run_in_order():
    # Memo's example defines `Foo`; init's makes `foo`; the others use them.
    namespace = {"jax": jax, "jnp": jnp, "eqx": eqx, "memox": memox}
    order = ["Memo", "cached", "CachedMethod", "init", "scan", "call", "jit", "clear", "stats"]
    order += ["SlotStats"]
    for name in [*order, "FlopCount"]:
        for code in _examples(getattr(memox, name)):
            exec(compile(code, f"<memox.{name} docstring>", "exec"), namespace)
    assert memox.stats(namespace["foo"])["b_cache"].misses >= 1


def test_readme_examples_run():
    readme = pathlib.Path(__file__).parent.parent / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace = {}
    for code in blocks:
        exec(compile(code, "<README.md>", "exec"), namespace)
    # Two hits in the quick example, then ten in the scan: `b` computed once in all.
    assert memox.stats(namespace["foo"])["b_cache"] == memox.SlotStats(hits=12, misses=1)
