"""A slot field declared `Memo[...] | None`: accepted in every spelling, with and without
`from __future__ import annotations`; where it holds `None`, the method computes and says
nothing; a plain `Memo[...]` field holding `None` warns."""

import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memox
from memox import Memo


ANNOTATIONS = [
    "Memo[jax.Array] | None",
    "None | Memo[jax.Array]",
    "Memo | None",
    "Optional[Memo[jax.Array]]",
    "Union[Memo[jax.Array], None]",
    "typing.Optional[memox.Memo[jax.Array]]",
]
REFUSED = ["jax.Array | None", "Optional[jax.Array]", "Memo[jax.Array] | int", "list[Memo]"]


def _define(annotation: str, future: bool) -> type:
    """A module class whose slot field is annotated `annotation`, defined in a source
    file's namespace with or without `from __future__ import annotations`."""
    source = textwrap.dedent(
        f"""
        import typing
        from typing import Optional, Union
        import equinox as eqx
        import jax
        import memox
        from memox import Memo

        class Layer(eqx.Module):
            w: jax.Array
            cache: {annotation}

            @memox.cached("cache")
            def normalised(self):
                return self.w / jax.numpy.linalg.norm(self.w)
        """
    )
    namespace: dict = {}
    exec(("from __future__ import annotations\n" if future else "") + source, namespace)
    return namespace["Layer"]


@pytest.mark.parametrize("future", [False, True], ids=["evaluated", "strings"])
@pytest.mark.parametrize("annotation", ANNOTATIONS)
def test_an_optional_slot_is_a_slot_in_every_spelling(annotation, future):
    layer = _define(annotation, future)
    assert layer.normalised.optional
    w = jnp.arange(4.0).reshape(2, 2) + 1
    value, model = memox.call(layer(w, Memo()), layer.normalised)
    value, model = memox.call(model, layer.normalised)
    np.testing.assert_array_equal(value, w / jnp.linalg.norm(w))
    assert memox.stats(model)["cache"].hits == 1


@pytest.mark.parametrize("future", [False, True], ids=["evaluated", "strings"])
@pytest.mark.parametrize("annotation", REFUSED)
def test_a_union_without_a_memo_is_refused_in_every_spelling(annotation, future):
    with pytest.raises((TypeError, ValueError), match="not as a `memox.Memo`"):
        _define(annotation, future)


class Layer(eqx.Module):
    w: jax.Array
    cache: Memo[jax.Array] | None

    @memox.cached("cache")
    def normalised(self):
        jax.debug.callback(lambda: COMPUTED.append(1))
        return self.w / jnp.linalg.norm(self.w)


class Required(eqx.Module):
    w: jax.Array
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def normalised(self):
        jax.debug.callback(lambda: COMPUTED.append(1))
        return self.w / jnp.linalg.norm(self.w)


class Pair(eqx.Module):
    a: eqx.Module
    b: eqx.Module

    def __call__(self, x):
        return self.b.normalised() @ (self.a.normalised() @ x)


COMPUTED: list = []


@pytest.mark.parametrize("api", ["call", "jit"])
def test_none_in_an_optional_slot_computes_and_says_nothing(api):
    w = jnp.arange(4.0).reshape(2, 2) + 1
    model = Pair(Layer(w, Memo()), Layer(2 * w, None))
    step = memox.jit(Pair.__call__)
    if api == "call":
        step = lambda m, x: memox.call(m, Pair.__call__, x)  # noqa: E731
    x = jnp.ones(2)
    COMPUTED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            y, model = step(model, x)
            jax.effects_barrier()
    want = (2 * w / jnp.linalg.norm(2 * w)) @ (w / jnp.linalg.norm(w) @ x)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    assert len(COMPUTED) == 1 + 3  # the slot's one fill, the None layer at every call
    assert memox.stats(model)["a.cache"].hits == 2


def test_none_in_a_required_slot_warns():
    w = jnp.arange(4.0).reshape(2, 2) + 1
    model = Pair(Required(w, Memo()), Required(2 * w, None))
    said = (
        r"`Required.normalised` ran inside `memox.call` on a `Required` whose slot `cache` "
        r"is None"
    )
    with pytest.warns(memox.UncachedWarning, match=said):
        memox.call(model, Pair.__call__, jnp.ones(2))
