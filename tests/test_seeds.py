"""The failure modes of ../shared/seeds/, rewritten with memox: `b` is computed exactly
once wherever the module is threaded (real executions counted, not traces)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from helpers import Counter, Foo, foo

import memox


def test_seed1_eager_twice():
    c = Counter()
    b, f = memox.call(foo(c), Foo.b)
    b, f = memox.call(f, Foo.b)
    assert c.n == 1


def test_seed1_eager_then_jit():
    # cached_property: the jitted function recomputed `b` (its cache lived in __dict__).
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)
    use_b = memox.jit(lambda f: f.b())
    b, f = use_b(f)
    assert c.n == 1 and b == jnp.sum(f.a)


def test_seed1_jit_then_eager():
    # A cache filled inside jit never reached the caller; with memox it does.
    c = Counter()
    use_b = memox.jit(lambda f: f.b())
    _, f = use_b(foo(c))
    b, f = memox.call(f, Foo.b)
    assert c.n == 1


def test_seed1_jit_of_jit():
    c = Counter()
    use_b = memox.jit(lambda f: f.b())
    f = foo(c)
    for _ in range(3):
        _, f = use_b(f)
    _, f = jax.jit(lambda f: memox.call(f, Foo.b))(f)
    assert c.n == 1


def test_seed2_new_params_same_shapes_do_not_recompile():
    # New parameter values of the same shapes: no retrace, but a recomputation.
    c = Counter()
    traces = []

    def step(f, x):
        traces.append(None)
        return f.b() + x

    step = memox.jit(step)
    f1 = foo(c)
    f2 = eqx.tree_at(lambda t: t.a, f1, f1.a + 1)
    y1, _ = step(f1, jnp.float32(0))
    y2, _ = step(f2, jnp.float32(0))
    assert len(traces) == 1 and c.n == 2
    assert y2 == y1 + 9


def test_seed3_changed_self_is_seen():
    # `jax.jit(c.calc)` froze `self`; memox tracks the module it is given.
    c = Counter()
    use_b = memox.jit(lambda f: f.b())
    f = foo(c)
    b1, f = use_b(f)
    f = eqx.tree_at(lambda t: t.a, f, 2 * f.a)
    b2, f = use_b(f)
    assert b2 == 2 * b1 and c.n == 2
