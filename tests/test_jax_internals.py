"""Pins the JAX behaviour memox reads through `memox/_jax_internals.py`, one test per
function, so that a rename or a change of meaning in a new JAX fails here (CI runs the
oldest and the newest JAX memox declares) instead of making memox silently inert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from memox import _jax_internals as internals


def test_current_trace_and_lineage():
    outer = internals.current()
    outside = jnp.ones(())
    seen = {}

    @jax.jit
    def f(x):
        inner = internals.current()
        seen["inner is outer"] = inner is outer
        seen["visible outer value"] = internals.visible_at(outside, inner)
        # A tracer of the inner trace is visible there, and not where the outer trace is
        # current (storing it there would leak it).
        seen["tracer inside"] = internals.visible_at(x, inner)
        seen["tracer outside"] = internals.visible_at(x, outer)
        return x

    f(1.0)
    assert seen == {
        "inner is outer": False,
        "visible outer value": True,
        "tracer inside": True,
        "tracer outside": False,
    }


def test_transforming_only_under_a_transformation():
    seen = []

    def probe(x):
        seen.append(internals.transforming())
        return x

    probe(1.0)
    jax.jit(probe)(1.0)
    jax.grad(probe)(1.0)
    jax.vmap(probe)(jnp.ones(2))
    jax.lax.scan(lambda c, _: (probe(c), None), 0.0, length=1)
    with jax.ensure_compile_time_eval():
        probe(1.0)
    assert seen == [False, True, True, True, True, False]


def test_visible_through_nested_transformations():
    results = {}

    def outer_fn(x):
        outer = internals.current()

        def inner_fn(y):
            results["outer value inside"] = internals.visible_at(x, internals.current())
            results["inner value outside"] = internals.visible_at(y, outer)
            return y

        jax.vmap(inner_fn)(jnp.stack([x, x]))
        return x

    jax.jit(jax.grad(outer_fn))(1.0)
    assert results == {"outer value inside": True, "inner value outside": False}


@pytest.mark.parametrize(
    "loop, name",
    [
        (lambda body: jax.lax.scan(lambda c, x: (body(c), x), 0.0, jnp.arange(2.0)), "scan"),
        (lambda body: jax.lax.while_loop(lambda c: c < 2.0, body, 0.0), "while_body"),
        (lambda body: jax.lax.fori_loop(0, 2, lambda i, c: body(c), 0.0), "fori_loop"),
    ],
)
def test_inside_loop_body(loop, name):
    seen = []

    def body(c):
        seen.append(internals.inside_loop_body())
        return c + 1.0

    loop(body)
    assert seen and set(seen) == {name}


def test_not_inside_a_loop_in_jit_or_eagerly():
    seen = []
    jax.jit(lambda x: (seen.append(internals.inside_loop_body()), x)[1])(1.0)
    seen.append(internals.inside_loop_body())
    assert seen == [None, None]


def test_loop_closing_over_tells_closed_over_values_from_the_carry():
    seen = {}
    concrete = jnp.ones(2)

    @jax.jit
    def f(outer):
        def body(carry, x):
            seen["closed over (traced)"] = internals.loop_closing_over([outer])
            seen["closed over (concrete)"] = internals.loop_closing_over([concrete])
            seen["made in the body"] = internals.loop_closing_over([jnp.ones(2)])
            seen["carry"] = internals.loop_closing_over([carry])
            seen["carry and closed over"] = internals.loop_closing_over([carry, outer])
            seen["nothing"] = internals.loop_closing_over([])
            return carry, None

        return jax.lax.scan(body, outer, jnp.ones(2))[0]

    f(jnp.ones(2))
    seen["outside a loop"] = internals.loop_closing_over([jnp.ones(2)])
    assert seen == {
        "closed over (traced)": "scan",
        "closed over (concrete)": "scan",
        "made in the body": None,
        "carry": None,
        "carry and closed over": None,
        "nothing": None,
        "outside a loop": None,
    }


def test_used_inputs_by_dead_code_elimination():
    closed = jax.make_jaxpr(lambda a, b, c: a * 2.0 + jnp.zeros(b.shape[0] - 1, c.dtype))(
        jnp.ones(2), jnp.ones(3), jnp.ones(4)
    )
    assert internals.used_inputs(closed) == [True, False, False]


def test_lowered_unwraps_what_a_transformation_only_passed_through():
    outside = jnp.ones(3)
    seen = {}

    def f(x):
        passed = jax.vmap(lambda _: outside, axis_size=2)  # an unbatched value
        seen["lowered is outer"] = internals.lowered(jnp.asarray(outside)) is outside
        return passed(x)

    f(jnp.ones(2))
    assert seen["lowered is outer"]
    values = {}

    def g(x):
        t = jax.jvp(lambda y: y * 0.0 + outside, (x,), (jnp.zeros(3),))[0]
        values["type"] = type(internals.lowered(t)).__name__
        return t

    g(jnp.ones(3))
    assert "JVP" not in values["type"]


def test_varying_axes_inside_shard_map():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    seen = {}

    def body(w, x):
        seen["w"] = internals.varying_axes(jax.typeof(w))
        seen["x"] = internals.varying_axes(jax.typeof(x))
        return w

    w = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, P("x")))
    x = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, P()))
    jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=True)
    )(w, x)
    assert seen == {"w": frozenset({"x"}), "x": frozenset()}
    assert internals.varying_axes(jax.typeof(jnp.ones(2))) == frozenset()


def test_prng_keys():
    key = jax.random.key(3)
    assert internals.is_key(key.dtype)
    assert not internals.is_key(jnp.ones(2).dtype)
    name = internals.key_impl_name(key.dtype)
    data = jax.random.key_data(key)
    again = jax.random.wrap_key_data(data, impl=name)
    np.testing.assert_array_equal(jax.random.key_data(again), data)
    assert again.dtype == key.dtype


def test_weakly_typed():
    x = internals.weakly_typed(jnp.float32(2.0))
    assert jax.typeof(x).weak_type and x.dtype == jnp.float32
    assert (jnp.ones(2, jnp.bfloat16) * x).dtype == jnp.bfloat16


def test_differentiating_in_tells_grad_from_branches_loops_and_vmap():
    # A hit decided on the host may be read where code runs once per run of the jitted
    # program: directly, or under `grad`/`jvp`/`vjp`/`linearize` opened there.
    seen = {}

    def probe(name, outer):
        def f(x):
            seen[name] = internals.differentiating_in(internals.current(), outer[0])
            return x * 2.0

        return f

    def run(name, wrap):
        outer = [None]

        @jax.jit
        def g(x):
            outer[0] = internals.current()
            return wrap(probe(name, outer), x)

        g(1.0)

    run("direct", lambda f, x: f(x))
    run("grad", lambda f, x: jax.grad(f)(x))
    run("jvp", lambda f, x: jax.jvp(f, (x,), (x,))[1])
    run("vjp", lambda f, x: jax.vjp(f, x)[1](x)[0])
    run("linearize", lambda f, x: jax.linearize(f, x)[1](x))
    run("cond", lambda f, x: jax.lax.cond(x > 0, f, f, x))
    run("scan", lambda f, x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0])
    run("vmap", lambda f, x: jax.vmap(f)(jnp.stack([x, x]))[0])
    run("checkpoint", lambda f, x: jax.checkpoint(f)(x))
    run("grad of checkpoint", lambda f, x: jax.grad(jax.checkpoint(f))(x))
    assert seen == {
        "direct": True,
        "grad": True,
        "jvp": True,
        "vjp": True,
        "linearize": True,
        "cond": False,
        "scan": False,
        "vmap": False,
        "checkpoint": False,
        "grad of checkpoint": False,
    }


def test_jit_context_changes_with_what_jax_jit_keys_on():
    before = internals.jit_context()
    assert internals.jit_context() == before
    with jax.numpy_dtype_promotion("standard"):
        assert internals.jit_context() != before
    flag = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", not flag)
    try:
        assert internals.jit_context() != before
    finally:
        jax.config.update("jax_threefry_partitionable", flag)
    assert internals.jit_context() == before


def test_memox_is_hidden_from_jax_filtered_tracebacks():
    import os

    from jax._src import traceback_util

    import memox

    assert os.path.dirname(memox.__file__) in traceback_util._exclude_paths


def test_node_data_reads_every_nodes_data_at_once():
    # The treedef's picklable state lists the nodes with their data, on every JAX memox
    # supports; read in one call, they are the data JAX's own `node_data` gives.
    import equinox as eqx

    tree = ({"b": eqx.nn.Linear(2, 3, key=jax.random.key(0)), "a": None}, [1, (2.0,)])
    treedef = jax.tree_util.tree_structure(tree)
    assert internals._state_lists_node_data()
    listed, walked = internals.node_data(treedef), internals._walked(treedef)
    assert len(listed) == len(walked) == treedef.num_nodes
    assert sorted(map(repr, listed)) == sorted(map(repr, walked))
    assert ["a", "b"] in listed
