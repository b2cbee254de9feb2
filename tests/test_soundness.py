"""The key rule (memox/_key.py): a value is reused only when everything it can depend on
is the same. One test per class of input that once gave a stale value, a crash or no
caching at all (issue 10); each compares with the unmemoized method and counts real
executions."""

import dataclasses
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter

import memox
from memox import Memo


def _reference(method, module, *args):
    """The unmemoized method's value (its executions not counted)."""
    counter = getattr(module, "counter", None)
    if counter is None:
        return method.fn(module, *args)
    with counter.paused():
        return method.fn(module, *args)


def _same(a, b, rtol=0.0):
    """Equal values of equal types (dtype, weak type, shape), leaf by leaf (within
    `rtol` where one side was compiled and the other not)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert jax.typeof(x) == jax.typeof(y), (jax.typeof(x), jax.typeof(y))
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol)


# -- 1. abstract types: shape- and dtype-only reads ------------------------------------


class ShapeOnly(eqx.Module):
    a: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def eye(self):
        self.counter.tick()
        return 2.0 * jnp.eye(self.a.shape[0], dtype=self.a.dtype)


class LikeOnly(eqx.Module):
    a: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def ones(self):
        self.counter.tick()
        return jnp.ones_like(self.a) * jnp.finfo(self.a.dtype).eps


@pytest.mark.parametrize("placement", ["eager", "memox.jit", "filter_jit"])
@pytest.mark.parametrize(
    "cls, method, new_a",
    [
        (ShapeOnly, ShapeOnly.eye, jnp.ones(4)),  # another shape
        (ShapeOnly, ShapeOnly.eye, jnp.ones(3, jnp.float16)),  # another dtype
        (LikeOnly, LikeOnly.ones, jnp.ones((3,), jnp.float16)),
    ],
)
def test_array_types_are_part_of_the_key(placement, cls, method, new_a):
    # Regression: an array read only for its shape or dtype is no dependency (DCE sees no
    # use of its values), and the key held the dependencies' types only: stale value.
    counter = Counter()
    module = cls(jnp.ones(3), counter)
    run = {
        "eager": lambda m: memox.call(m, method),
        "memox.jit": memox.jit(method),
        "filter_jit": eqx.filter_jit(lambda m: memox.call(m, method)),
    }[placement]
    _, module = run(memox.init(module))
    changed = eqx.tree_at(lambda m: m.a, module, new_a)
    value, changed = run(memox.init(changed))
    _same(value, _reference(method, changed))
    assert counter.n == 2
    value, changed = run(changed)
    assert counter.n == 2  # and the new value is cached


# -- 2. weak types -----------------------------------------------------------------------


class Scaled(eqx.Module):
    x: jax.Array
    s: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def scaled(self):
        self.counter.tick()
        return self.x * self.s


@jax.numpy_dtype_promotion("standard")  # float32 * bfloat16: float32, weak 2.0: bfloat16
def test_weak_types_keep_the_unmemoized_type():
    # Regression: a weakly typed dependency mixed with bfloat16 crashed (`dynamic_update_
    # slice ... same dtypes`), or after a strong fill with the same bits a hit returned
    # float32 where the method returns bfloat16.
    counter = Counter()
    weak = Scaled(jnp.ones(3, jnp.bfloat16), jnp.asarray(2.0), counter)
    value, weak = memox.call(weak, Scaled.scaled)
    _same(value, _reference(Scaled.scaled, weak))
    value, weak = memox.call(weak, Scaled.scaled)
    assert counter.n == 1
    strong = eqx.tree_at(lambda m: m.s, weak, jnp.float32(2.0))
    value, strong = memox.call(strong, Scaled.scaled)
    _same(value, _reference(Scaled.scaled, strong))
    back = eqx.tree_at(lambda m: m.s, strong, jnp.asarray(2.0))
    value, back = memox.call(back, Scaled.scaled)
    _same(value, _reference(Scaled.scaled, back))
    assert counter.n == 3


class WeakOut(eqx.Module):
    s: jax.Array
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def doubled(self):
        return self.s * 2


def test_a_weakly_typed_value_is_returned_weakly_typed():
    module = WeakOut(jnp.asarray(1.5))
    for _ in range(2):  # a miss, then a hit
        value, module = memox.call(module, WeakOut.doubled)
        _same(value, _reference(WeakOut.doubled, module))
    assert memox.stats(module)["cache"].hits == 1


# -- 3. non-array parts by equality, never by repr ---------------------------------------


class Activated(eqx.Module):
    x: jax.Array
    fn: Callable
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def y(self):
        self.counter.tick()
        return self.fn(self.x)


def _scale_by(k):
    return lambda x: k * x


@pytest.mark.parametrize(
    "first, second",
    [
        (lambda x: x + 1.0, lambda x: x + 2.0),  # two lambdas
        (_scale_by(2.0), _scale_by(3.0)),  # closures from one factory
        (jax.nn.relu, jax.nn.softplus),  # named functions
    ],
)
def test_callables_in_fields_are_compared_by_equality(first, second):
    counter = Counter()
    module = Activated(jnp.linspace(-1.0, 1.0, 4), first, counter)
    _, module = memox.call(module, Activated.y)
    swapped = eqx.tree_at(lambda m: m.fn, module, second)
    value, swapped = memox.call(swapped, Activated.y)
    _same(value, second(module.x))
    assert counter.n == 2
    _, swapped = memox.call(swapped, Activated.y)
    assert counter.n == 2


def test_mlp_activation_swap():
    key = jax.random.key(0)

    class Net(eqx.Module):
        mlp: eqx.nn.MLP
        cache: Memo[jax.Array] = Memo()

        @memox.cached("cache")
        def out(self):
            return self.mlp(jnp.linspace(-1.0, 1.0, 3))

    net = Net(eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.relu, key=key))
    _, net = memox.call(net, Net.out)
    tanh = eqx.tree_at(lambda n: n.mlp.activation, net, jnp.tanh)
    value, tanh = memox.call(tanh, Net.out)
    _same(value, _reference(Net.out, tanh))
    assert memox.stats(tanh)["cache"].misses == 2


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float
    note: str = dataclasses.field(default="", repr=False)
    shift: float = dataclasses.field(default=0.0, repr=False)


class WithArgs(eqx.Module):
    x: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo(size=4)

    @memox.cached("cache")
    def apply(self, how):
        self.counter.tick()
        if isinstance(how, Config):
            return self.x * how.scale + how.shift
        return how(self.x)


@pytest.mark.parametrize(
    "first, second",
    [
        (lambda x: x + 1.0, lambda x: x + 2.0),
        (Config(2.0, shift=0.0), Config(2.0, shift=1.0)),  # equal repr, unequal values
    ],
)
def test_non_array_arguments_are_compared_by_equality(first, second):
    counter = Counter()
    module = WithArgs(jnp.ones(3), counter)
    assert repr(first) != repr(second) or first != second
    _, module = memox.call(module, WithArgs.apply, first)
    value, module = memox.call(module, WithArgs.apply, second)
    _same(value, _reference(WithArgs.apply, module, second))
    assert counter.n == 2
    value, module = memox.call(module, WithArgs.apply, first)  # both entries kept
    _same(value, _reference(WithArgs.apply, module, first))
    assert counter.n == 2


def test_an_equal_argument_hits():
    counter = Counter()
    module = WithArgs(jnp.ones(3), counter)
    _, module = memox.call(module, WithArgs.apply, Config(2.0, note="a"))
    _, module = memox.call(module, WithArgs.apply, Config(2.0, note="a"))
    assert counter.n == 1


class Table(eqx.Module):
    x: jax.Array
    table: np.ndarray = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def lookup(self):
        return self.x * float(self.table.sum())


def test_large_numpy_static_field_is_compared_by_value():
    # Regression: the key held `repr(table)`, which NumPy abbreviates with "...".
    big = np.zeros(5000)
    with pytest.warns(UserWarning, match="being set as static"):  # Equinox's advice
        module = Table(jnp.ones(2), big)
    _, module = memox.call(module, Table.lookup)
    changed_table = big.copy()
    changed_table[2500] = 1.0
    assert repr(changed_table) == repr(big)
    with pytest.warns(UserWarning, match="being set as static"):
        changed = Table(module.x, changed_table, cache=module.cache)
    value, changed = memox.call(changed, Table.lookup)
    _same(value, _reference(Table.lookup, changed))


def test_numpy_static_fields_of_two_modules_are_keyed_apart():
    # Regression: a module built again with an equal NumPy array as a static field
    # raised JAX's "Exception raised while checking equality of metadata fields": the
    # plan's lookup compared its tree structure with the first one's (a NumPy array's
    # `==` is no bool).
    values = []
    for table in (np.zeros(3), np.zeros(3), np.ones(3)):
        with pytest.warns(UserWarning, match="being set as static"):
            module = Table(jnp.ones(2), table)
        value, module = memox.call(module, Table.lookup)
        _same(value, _reference(Table.lookup, module))
        values.append(value)
    assert [float(v[0]) for v in values] == [0.0, 0.0, 3.0]


# -- 4. typed PRNG keys ---------------------------------------------------------------


class Noisy(eqx.Module):
    key: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo(size=2)
    key_cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def noise(self, extra):
        self.counter.tick()
        return jax.random.normal(jax.random.fold_in(self.key, 1), (3,)) + jax.random.uniform(
            extra, (3,)
        )

    @memox.cached("key_cache")
    def split(self):
        return jax.random.split(self.key)


@pytest.mark.parametrize("placement", ["eager", "memox.jit"])
def test_typed_prng_keys_as_fields_arguments_and_values(placement):
    counter = Counter()
    module = Noisy(jax.random.key(0), counter)
    noise = (
        memox.jit(Noisy.noise)
        if placement == "memox.jit"
        else (lambda m, e: memox.call(m, Noisy.noise, e))
    )
    split = (
        memox.jit(Noisy.split)
        if placement == "memox.jit"
        else (lambda m: memox.call(m, Noisy.split))
    )
    extra = jax.random.key(7)
    rtol = 1e-6 if placement == "memox.jit" else 0.0
    for _ in range(2):
        value, module = noise(module, extra)
        _same(value, _reference(Noisy.noise, module, extra), rtol)
    assert counter.n == 1
    value, module = noise(module, jax.random.key(8))
    _same(value, _reference(Noisy.noise, module, jax.random.key(8)), rtol)
    rekeyed = eqx.tree_at(lambda m: m.key, module, jax.random.key(1))
    value, rekeyed = noise(rekeyed, extra)
    _same(value, _reference(Noisy.noise, rekeyed, extra), rtol)
    assert counter.n == 3
    for _ in range(2):
        keys, rekeyed = split(rekeyed)
        _same(keys, _reference(Noisy.split, rekeyed))
    assert memox.stats(rekeyed)["key_cache"].hits == 1


# -- 6. a submodule at two paths --------------------------------------------------------


class Encoder(eqx.Module):
    w: jax.Array
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def gram(self):
        return self.w @ self.w.T


class Holder(eqx.Module):
    first: Encoder
    second: Encoder


def test_a_submodule_shared_at_two_paths_under_memox_jit():
    # Regression: "Attempt to donate the same buffer twice" on every call.
    enc = memox.init(Encoder(jnp.arange(6.0).reshape(2, 3)))
    holder = Holder(enc, enc)
    step = memox.jit(lambda h: h.first.gram() + h.second.gram())
    for _ in range(3):
        value, holder = step(holder)
        _same(value, 2 * Encoder.gram.fn(enc))
    stats = memox.stats(holder)
    assert stats["first.cache"].misses + stats["second.cache"].misses <= 2
    assert stats["first.cache"].hits + stats["second.cache"].hits >= 4


# -- 7. Equinox modules with a custom __init__ ---------------------------------------------


class Custom(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()
    table: Memo[jax.Array] = Memo(size=2)

    def __init__(self, n, counter, *, key):
        self.w = jax.random.normal(key, (n, n))
        self.counter = counter

    @memox.cached("cache")
    def gram(self):
        self.counter.tick()
        return self.w @ self.w.T

    @memox.cached("table")
    def shifted(self, s):
        self.counter.tick()
        return self.w + s


@pytest.mark.parametrize("init", [False, True])
def test_custom_init_that_leaves_slots_unset(init):
    # Regression: Equinox leaves a defaulted field unset after a custom `__init__`; the
    # slot was missing from the pytree and memox computed every time, silently.
    counter = Counter()
    module = Custom(3, counter, key=jax.random.key(0))
    assert isinstance(module.__dict__["cache"], Memo)
    if init:
        module = memox.init(module, Custom.shifted, jnp.float32(1.0))
    for _ in range(2):
        _, module = memox.call(module, Custom.gram)
        _, module = memox.call(module, Custom.shifted, jnp.float32(1.0))
    assert counter.n == 2
    assert memox.stats(module)["cache"].hits == 1
    assert memox.stats(module)["table"].hits == 1


# -- never silent: a slot memox cannot reach ----------------------------------------------


def test_a_method_inside_a_transformation_within_fn_warns():
    counter = Counter()

    class Foo(eqx.Module):
        a: jax.Array
        cache: Memo[jax.Array] = Memo()

        @memox.cached("cache")
        def b(self):
            counter.tick()
            return jnp.sum(self.a)

    inner = eqx.filter_jit(lambda m: m.b())
    with pytest.warns(memox.UncachedWarning, match=r"`.*Foo.b` ran inside `memox.call` but"):
        memox.call(memox.init(Foo(jnp.ones(3))), inner)


# -- 10. other module systems ------------------------------------------------------------


def test_a_flax_nnx_module_is_refused():
    nnx = pytest.importorskip("flax.nnx")

    def define():
        class Model(nnx.Module):
            cache: Memo[jax.Array]

            def __init__(self):
                self.w = nnx.Param(jnp.ones(3))
                self.cache = Memo()

            @memox.cached("cache")
            def norm(self):
                return jnp.sum(self.w.value)

        return Model.norm

    with pytest.raises(TypeError, match=r"is a `flax.nnx.Module`. memox caches in the fields"):
        method = define()
        assert sys.version_info < (3, 12)
        method(None)


# -- across processes: a restored slot never hits on a part it cannot prove equal --------

_PROCESS = """
import sys, jax, jax.numpy as jnp, equinox as eqx
import memox
from memox import Memo

SCALE = {scale}

class Act(eqx.Module):
    x: jax.Array
    fn: object
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def y(self):
        return self.fn(self.x)

fn = jax.nn.relu if "{kind}" == "named" else (lambda x: SCALE * x)
model = memox.init(Act(jnp.linspace(-1.0, 1.0, 4), fn))
if sys.argv[1] == "save":
    _, model = memox.call(model, Act.y)
    eqx.tree_serialise_leaves(sys.argv[2], model)
else:
    model = eqx.tree_deserialise_leaves(sys.argv[2], model)
    value, model = memox.call(model, Act.y)
    assert bool(jnp.all(value == fn(model.x)))
    print(memox.stats(model)["cache"])
"""


@pytest.mark.parametrize("kind, hits", [("named", 1), ("lambda", 0)])
def test_a_restored_slot_hits_only_on_parts_equal_across_processes(tmp_path, kind, hits):
    saved = tmp_path / "model.eqx"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run(mode, scale):
        script = textwrap.dedent(_PROCESS.format(kind=kind, scale=scale))
        out = subprocess.run(
            [sys.executable, "-c", script, mode, str(saved)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    run("save", 2.0)
    # The lambda of the second process differs (SCALE 3): a hit would be stale.
    assert f"hits={hits}," in run("load", 2.0 if kind == "named" else 3.0)
