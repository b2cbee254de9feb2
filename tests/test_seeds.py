"""Three caching failures reported by JAX users, rewritten with memox: `b` is computed
exactly once wherever the module is threaded (real executions counted, not traces).

Seed 1, `functools.cached_property` on a pytree (a `flax.struct.PyTreeNode`):

    class Foo(flax.struct.PyTreeNode):
        a: jax.Array

        @functools.cached_property
        def b(self):
            jax.debug.print("Computing b ...")
            return jnp.sum(self.a)

    use_b = jax.jit(lambda foo: foo.b)

The cache lives in the instance's `__dict__`, which is not a pytree field: `foo.b` then
`use_b(foo)` computes twice, `use_b(foo)` twice computes twice, and `use_b(foo)` then
`foo.b` computes twice. A cache field assigned inside `use_b` is lost too: the traced
copy is written, and the function does not return it.

Seed 2, new parameters for a jitted function that scans with a closure over them:
`example(Params(jnp.array([1., 2.]), 2))` then `example(Params(jnp.array([3., 4.]), 2))`.
Only static data and shapes are in the compilation key: no recompilation, and the new
values are used.

Seed 3, `jax.jit(c.calc)` on a bound method: `self` is baked into the compiled function,
so `c.mul = False` afterwards changes nothing.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from helpers import Counter, Foo, Traces, foo

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
    traces = Traces()

    def step(f, x):
        traces.tick()
        return f.b() + x

    step = memox.jit(step)
    f1 = foo(c)
    f2 = eqx.tree_at(lambda t: t.a, f1, f1.a + 1)
    y1, _ = step(f1, jnp.float32(0))
    y2, _ = step(f2, jnp.float32(0))
    assert traces.n == 1 and c.n == 2
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
