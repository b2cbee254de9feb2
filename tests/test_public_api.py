"""The public names, and the README's examples run (the docstrings' run in
test_docstring_examples.py)."""

import pathlib
import re

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
    "UncachedWarning",
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


def test_readme_examples_run():
    readme = pathlib.Path(__file__).parent.parent / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace = {}
    for code in blocks:
        exec(compile(code, "<README.md>", "exec"), namespace)
    # Two hits in the quick example, then ten in the scan: `b` computed once in all.
    assert memox.stats(namespace["foo"])["b_cache"] == memox.SlotStats(hits=12, misses=1)
