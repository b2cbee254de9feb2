"""Every error names what was wrong and what to do (wording checked)."""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, foo

import memox
from memox import Memo


def _definition_error(define):
    """The error memox gives for a badly declared cached method on an `eqx.Module`: at
    the class's creation (on Python 3.11 too, where `ABCMeta` raises it: an error raised
    in `__set_name__` would come wrapped in a `RuntimeError`)."""
    with pytest.raises((TypeError, ValueError)) as excinfo:
        define()
    return excinfo.value


def test_slot_name_must_be_a_string():
    with pytest.raises(TypeError, match=r"takes the name of a `memox.Memo` field as a string"):
        memox.cached(3)


def test_unknown_slot():
    def define():
        class Bad(eqx.Module):
            a: jax.Array

            @memox.cached("nope")
            def b(self):
                return self.a

        return Bad.b

    err = _definition_error(define)
    assert isinstance(err, ValueError)
    assert str(err) == (
        "`memox.cached('nope')` on `Bad.b`: `Bad` has no field `nope`. "
        "Declare it as `nope: memox.Memo[...] = memox.Memo()`."
    )


def test_slot_that_is_not_a_memo_field():
    def define():
        class Bad(eqx.Module):
            a: jax.Array

            @memox.cached("a")
            def b(self):
                return self.a

        return Bad.b

    err = _definition_error(define)
    assert isinstance(err, ValueError)
    assert re.search(r"field `a` is declared as `[\w.]*Array`, not as a `memox.Memo`", str(err))
    assert "Declare it as `a: memox.Memo[...] = memox.Memo()`" in str(err)


def test_a_misspelt_slot_is_caught_at_class_creation_with_the_closest_field():
    # Regression (issue 33): `memox.cached("b_cach")` with a field `b_cache` was accepted
    # at class creation on Python 3.11, caught at first use, and suggested nothing.
    with pytest.raises(ValueError) as excinfo:

        class Bad(eqx.Module):
            a: jax.Array
            b_cache: Memo[jax.Array] = Memo()
            c_cache: Memo[jax.Array] = Memo()

            @memox.cached("b_cach")
            def b(self):
                return self.a

    assert str(excinfo.value) == (
        "`memox.cached('b_cach')` on `Bad.b`: `Bad` has no field `b_cach`. Did you mean "
        "`b_cache`? Its `memox.Memo` fields: `b_cache`, `c_cache`. Declare it as "
        "`b_cach: memox.Memo[...] = memox.Memo()`, or pass one of those to `memox.cached`."
    )


def test_a_misspelt_slot_declared_on_a_base_class():
    class Base(eqx.Module):
        a: jax.Array
        b_cache: Memo[jax.Array] = Memo()

    class Good(Base):  # a slot of the base class is the subclass's slot
        @memox.cached("b_cache")
        def b(self):
            return jnp.sum(self.a)

    assert memox.call(Good(jnp.ones(2)), Good.b)[0] == 2.0
    with pytest.raises(ValueError, match=r"`Bad` has no field `cache`. Did you mean `b_cache`"):

        class Bad(Base):
            @memox.cached("cache")
            def b(self):
                return jnp.sum(self.a)


def test_a_slot_that_is_not_a_memo_field_names_the_memo_fields():
    with pytest.raises(ValueError) as excinfo:

        class Bad(eqx.Module):
            a: jax.Array
            a_cache: Memo[jax.Array] = Memo()

            @memox.cached("a")
            def b(self):
                return self.a

    message = "not as a `memox.Memo`. Its `memox.Memo` fields: `a_cache`. Declare it as "
    assert message in str(excinfo.value)


def test_two_methods_on_one_slot():
    def define():
        class Bad(eqx.Module):
            a: jax.Array
            cache: Memo[jax.Array] = Memo()

            @memox.cached("cache")
            def one(self):
                return self.a

            @memox.cached("cache")
            def two(self):
                return self.a

        return Bad.two

    err = _definition_error(define)
    # The method checked first names the other (which one is checked first depends on
    # the Python version's order of `__set_name__` calls).
    bound = r"on `Bad.(one|two)`: slot `cache` is already bound to `Bad.(two|one)`"
    assert re.search(bound, str(err))
    assert "Give each cached method a `memox.Memo` field of its own" in str(err)


@pytest.mark.parametrize("api", ["call", "init", "jit"])
def test_fn_must_be_callable(api):
    f = foo(Counter())
    with pytest.raises(TypeError, match=rf"`memox.{api}`: `fn` must be callable; got int"):
        if api == "jit":
            memox.jit(3)
        else:
            getattr(memox, api)(f, 3)


def test_bound_method_is_refused():
    f = foo(Counter())
    with pytest.raises(TypeError, match=r"`fn` is the bound method .* Pass the unbound method"):
        memox.call(f, f.b)
    with pytest.raises(TypeError, match=r"instead: `Foo.b`"):
        memox.jit(f.b)


@pytest.mark.parametrize("module", [object(), jnp.ones(3), 1.0])
@pytest.mark.parametrize("api", ["call", "init", "clear", "stats"])
def test_module_must_be_a_pytree(api, module):
    with pytest.raises(TypeError, match=rf"`memox.{api}`: `module` must be a pytree holding"):
        if api == "call":
            memox.call(module, lambda m: m)
        else:
            getattr(memox, api)(module)


class _NoSlot(eqx.Module):
    a: jax.Array


@pytest.mark.parametrize("module", [{"a": jnp.ones(3)}, _NoSlot(jnp.ones(3))])
@pytest.mark.parametrize("api", ["call", "init", "stats"])
def test_a_pytree_holding_no_slot_is_refused(api, module):
    # Regression (issue 33): `memox.call`, `init` and `stats` accepted a pytree holding no
    # slot silently, although nothing could be cached, allocated or counted in it.
    got = type(module).__name__
    message = rf"`memox.{api}`: `module` holds no `memox.Memo` slot \(got a `{got}`\), so"
    with pytest.raises(TypeError, match=message) as excinfo:
        if api == "call":
            memox.call(module, lambda m: m)
        else:
            getattr(memox, api)(module)
    assert "Pass the module whose cached methods you call" in str(excinfo.value)


def test_slots_anywhere_in_the_module_or_hoisted_values_are_enough():
    c = Counter()
    f = foo(c)
    b, tree = memox.call({"models": [f]}, lambda t: t["models"][0].b())  # slots deeper
    assert b == jnp.sum(f.a) and memox.stats(tree)["['models'][0].b_cache"].misses == 1
    # A view by `memox.hoist` holds values in place of slots: a call on it reads them.
    b, f = memox.call(f, lambda m: memox.call(memox.hoist(m), lambda h: h.b())[0])
    assert b == jnp.sum(f.a)
    # `memox.filter_jit`, a drop-in for `eqx.filter_jit`, takes any function and arguments.
    assert memox.filter_jit(lambda x: x + 1)(jnp.ones(2)).shape == (2,)


@pytest.mark.parametrize("module", [object(), jnp.ones(3), 1.0])
def test_jit_says_the_first_argument_must_be_the_module(module):
    # Regression (issue 32): `memox.jit(lambda x, m: ...)(x, model)` advised
    # "`memox.jit(model, ...)`", which is no call anyone should write.
    with pytest.raises(TypeError, match=r"first argument must be the module; .* `step\(model"):
        memox.jit(lambda m: m)(module)
    c = Counter()
    message = r"first argument must be .* argument 2 .* holds the slots"
    with pytest.raises(TypeError, match=message):
        memox.jit(lambda x, m: m.b() * x)(module, foo(c))


@pytest.mark.parametrize("api", ["call", "jit"])
def test_slots_in_a_later_argument_are_refused(api):
    # Regression (issue 32): with an optimizer state or a dict first and the model after
    # it, the cached method recomputed at every call, silently.
    c = Counter()
    first = {"opt": jnp.ones(2)}
    with pytest.raises(TypeError, match=rf"`memox.{api}`: the module given first holds no"):
        if api == "call":
            memox.call(first, lambda s, f: f.b(), foo(c))
        else:
            memox.jit(lambda s, f: f.b())(first, foo(c))
    with pytest.raises(TypeError, match=r"keyword argument `model` does"):
        memox.jit(lambda s, model: model.b())(first, model=foo(c))


class Keyed(eqx.Module):
    w: jax.Array
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def apply(self, x):
        return self.w * x


# An empty slot in a loop's carry is a traced 0-d integer, which memox cannot allocate
# without changing the carry's type: memox's error names the fix.
@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop"])
def test_unallocated_slot_as_loop_carry_names_init(loop):
    m = memox.init(Keyed(jnp.ones(3)))  # takes an argument: not allocated by init(m)

    def body(m, x):
        y, m = memox.call(m, Keyed.apply, x)
        return m, y

    run = {
        "scan": lambda m: jax.lax.scan(body, m, jnp.ones((4, 3))),
        "fori_loop": lambda m: jax.lax.fori_loop(0, 2, lambda i, m: body(m, jnp.ones(3))[0], m),
        "while_loop": lambda m: jax.lax.while_loop(
            lambda m: False, lambda m: body(m, jnp.ones(3))[0], m
        ),
    }[loop]
    with pytest.raises(TypeError) as excinfo:
        run(m)
    assert "`memox.init(module, fn, *args)` for a method that takes arguments" in str(
        excinfo.value
    )
    if loop != "scan":
        return
    # The fix works:
    m = memox.init(m, Keyed.apply, jnp.ones(3))
    m, ys = jax.lax.scan(body, m, jnp.ones((4, 3)))
    assert memox.stats(m)["cache"] == memox.SlotStats(hits=3, misses=1)


def test_empty_no_argument_slot_as_scan_carry_names_init():
    f = foo(Counter())

    def body(f, _):
        return memox.call(f, Foo.b)[1], None

    with pytest.raises(TypeError, match=r"Allocate it first with `module = memox.init\(module\)`"):
        jax.lax.scan(body, f, length=2)
    # The fix works:
    f, _ = jax.lax.scan(body, memox.init(f), length=2)
    assert memox.stats(f)["b_cache"] == memox.SlotStats(hits=1, misses=1)


# The same for `jax.jit`'s arguments (`eqx.filter_jit`, `memox.jit` and `memox.filter_jit`
# allocate before tracing, and a module closed over is allocated in the trace).
def test_jax_jit_of_a_call_on_an_empty_module_names_init():
    c = Counter()

    @jax.jit
    def step(f):
        return memox.call(f, Foo.b)

    with pytest.raises(TypeError, match=r"Allocate it first with `module = memox.init\(module\)`"):
        step(foo(c))
    f = memox.init(foo(c))
    for _ in range(3):
        b, f = step(f)
    assert c.n == 1 and memox.stats(f)["b_cache"] == memox.SlotStats(hits=2, misses=1)
    np.testing.assert_array_equal(b, jnp.sum(f.a))


def test_reshaped_slot_inside_scan():
    m = memox.init(Keyed(jnp.ones(())), Keyed.apply, jnp.ones(3))

    def body(m, x):
        y, m = memox.call(m, Keyed.apply, x)
        return m, y

    with pytest.raises(ValueError, match=r"with a value of shape float32\[4\], but the slot"):
        jax.lax.scan(body, m, jnp.ones((2, 4)))


class Nested(eqx.Module):
    inner: Keyed
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def total(self):
        return self.inner.apply(jnp.ones(3)).sum()


def test_unallocated_slot_reached_from_another_cached_method():
    m = Nested(Keyed(jnp.ones(3)))
    with pytest.raises(ValueError) as excinfo:
        memox.call(m, Nested.total)
    msg = str(excinfo.value)
    assert "`Keyed.apply` is reached from inside cached `Nested.total`" in msg
    assert "`module = memox.init(module, fn, *args)`" in msg
    m = memox.init(m, Nested.total)
    assert memox.call(m, Nested.total)[0] == 3.0


def test_batched_fill_into_unbatched_slot():
    m = Keyed(jnp.ones(3))
    with pytest.raises(ValueError) as excinfo:
        memox.call(m, lambda m: jax.vmap(m.apply)(jnp.ones((2, 3))))
    msg = str(excinfo.value)
    assert "`Keyed.apply` updates slot `cache` with values that belong to a JAX" in msg
    assert "Either run `memox.call` inside the transformation" in msg
    # What the message suggests works; with a batched argument a hit cannot skip the
    # computation (both branches of a batched `cond` run), and memox says so:
    with pytest.warns(memox.UncachedWarning, match="batched dependencies or arguments"):
        ys, _ = jax.vmap(lambda x: memox.call(m, Keyed.apply, x))(jnp.ones((2, 3)))
    assert ys.shape == (2, 3)


# Regression (issue 33): a cached method run under a JAX transformation outside any
# `memox.call` computed at every evaluation, silently.
TRANSFORMED = {
    "jax.jit": lambda f: jax.jit(Foo.b)(f),
    "eqx.filter_jit": lambda f: eqx.filter_jit(lambda m: m.b())(f),
    "jax.vmap": lambda f: jax.vmap(lambda a: Foo(a, f.counter).b())(jnp.stack([f.a, f.a])),
    "eqx.filter_grad": lambda f: eqx.filter_grad(lambda m: m.b())(f),
    "lax.scan": lambda f: jax.lax.scan(lambda c, _: (c + f.b(), None), 0.0, length=2),
}


@pytest.mark.parametrize("transform", TRANSFORMED)
def test_a_method_under_a_transformation_outside_memox_call_warns(transform):
    f = memox.init(foo(Counter()))
    with pytest.warns(memox.UncachedWarning) as record:
        TRANSFORMED[transform](f)
    (warning,) = record
    assert str(warning.message).startswith(
        "`Foo.b` ran inside a JAX transformation (`jax.jit`, `eqx.filter_jit`, `jax.vmap`, "
        "`jax.grad`, ...) but outside `memox.call`, so it computes at every evaluation"
    )
    assert "Call it through `memox.call(module, fn)`" in str(warning.message)


def test_the_warning_is_given_once_per_method_and_can_be_silenced():
    f = memox.init(foo(Counter()))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")  # what a program shows by default
        for _ in range(3):
            jax.jit(lambda m: m.b() + 1)(f)  # a new function, traced each time
        eqx.filter_grad(lambda m: m.b())(f)
    assert [w.category for w in record] == [memox.UncachedWarning]
    message = 'warnings.filterwarnings("ignore", category=memox.UncachedWarning)'
    assert message in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=memox.UncachedWarning)  # as it says
        jax.jit(Foo.b)(f)


def test_an_eager_call_outside_memox_call_does_not_warn():
    # Eagerly, outside any trace, a cached method is an ordinary method: it computes, as
    # the caller sees, and nothing is staged to compute again. (Warnings are errors.)
    f = memox.init(foo(Counter()))
    assert f.b() == Foo.b(f) == jnp.sum(f.a)


class Tangents(eqx.Module):
    seed: jax.Array
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def zero_tangent(self):
        return np.zeros((), jax.dtypes.float0)


def test_unsupported_value_dtype():
    with pytest.raises(
        TypeError, match=r"`Tangents.zero_tangent` returned a leaf of dtype .*float0"
    ):
        memox.call(Tangents(jnp.ones(())), Tangents.zero_tangent)


def test_every_message_says_what_to_do():
    # Each message names the API in backticks and gives a fix (an instruction with code).
    from memox import _errors

    verbs = (
        "Declare",
        "Give",
        "Pass",
        "Allocate",
        "run ",
        "Run ",
        "Return",
        "Use",
        "Keep",
        "Decorate",
        "Either",
        "make the step",
        "Define",
        "Make",
        "Hoist",
        "Call",
        "Cast",
    )
    # (A dict of parts of messages, such as `SLOT_HINTS`, is checked in the messages.)
    messages = {k: v for k, v in vars(_errors).items() if k.isupper() and isinstance(v, str)}
    assert len(messages) >= 15
    for name, text in messages.items():
        assert "`" in text, name
        assert any(v in text for v in verbs), name


# `memox.jit`'s `donate` is a bool: a string of `eqx.filter_jit`'s (`"none"`, truthy)
# would silently donate. Checked in both forms, before `fn` is looked at.
@pytest.mark.parametrize("donate", ["none", "all", 0, None])
def test_jit_donate_must_be_a_bool(donate):
    message = rf"`memox.jit`: `donate` must be a bool; got {re.escape(repr(donate))}\. Pass"
    with pytest.raises(TypeError, match=message):
        memox.jit(Foo.b, donate=donate)
    with pytest.raises(TypeError, match=message):
        memox.jit(donate=donate)


@pytest.mark.parametrize("fn", [3, "Foo.b", None])
def test_jit_as_a_decorator_factory_checks_fn(fn):
    with pytest.raises(TypeError, match=r"`memox.jit`: `fn` must be callable; got"):
        memox.jit(donate=False)(fn)


class _Placed(eqx.Module):
    x: jax.Array
    sharding: object = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def out(self):
        return jax.device_put(2 * self.x, self.sharding)


def test_an_explicit_mesh_no_input_lives_on_is_named_eagerly():
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
    module = _Placed(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    with pytest.raises(ValueError, match=r"sharded over `Explicit` mesh axes \('x',\)") as e:
        memox.call(module, _Placed.out)
    assert "jax.set_mesh(mesh)" in str(e.value)
    # Each way out the message names works.
    value, _ = memox.jit(lambda m: m.out())(module)
    with jax.set_mesh(mesh):
        placed = _Placed(jnp.arange(4.0), NamedSharding(mesh, P("x")))
        value_set, placed = memox.call(placed, _Placed.out)
        again, placed = memox.call(placed, _Placed.out)
    assert memox.stats(placed)["cache"].hits == 1
    np.testing.assert_array_equal(value, value_set)
    np.testing.assert_array_equal(again, 2 * np.arange(4.0))
