"""Tokens of non-array parts (memox/_token.py): exact, canonical where provable. One
test per class of non-array part that once returned another part's value (issue 18,
item 2), each comparing with the unmemoized method in every placement and counting real
executions; and one answer in every process: functions and classes defined in a
function by their code (issue 19). By content, never by a name that can be rebound
(issue 31)."""

import collections
import dataclasses
import functools
import itertools
import operator
import re
import sys
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fuzz_parts import Cfg, nan
from helpers import PLACEMENTS, Counter, assert_same, call_in
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import memox
from memox import Memo, _jax_internals, _key, _token


# -- non-array parts: exact tokens -----------------------------------------------------


class Applied(eqx.Module):
    x: jax.Array
    how: object = eqx.field(static=True)
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def out(self):
        self.counter.tick()
        how = self.how
        if isinstance(how, Cfg):
            return jnp.broadcast_to(jnp.asarray(how.flag), self.x.shape)
        if isinstance(how, np.random.Generator):
            seed = how.bit_generator.state["state"]["state"] % 1000  # (not advanced)
            return self.x + jnp.float32(seed)
        if isinstance(how, jax.Device):
            return jax.device_put(self.x, how)
        if isinstance(how, tuple):
            return jnp.broadcast_to(jnp.asarray(how[0]), self.x.shape)
        if isinstance(how, float):
            return self.x * 0 + 1.0 / jnp.float32(how)
        return how(self.x)


CASES = [
    (operator.itemgetter(0), operator.itemgetter(1)),
    (operator.attrgetter("real"), operator.attrgetter("imag")),
    (operator.methodcaller("sum"), operator.methodcaller("prod")),
    (np.random.default_rng(0), np.random.default_rng(1)),
    ((1,), (True,)),
    (Cfg(1), Cfg(True)),
    (0.0, -0.0),
]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("first, second", CASES)
def test_distinct_static_parts_never_share_a_value(placement, first, second):
    # Regression: C callables and Generators were guessed "stateless"; the fast path
    # compared by `==` (`0.0 == -0.0`, `(1,) == (True,)`, `Cfg(1) == Cfg(True)`).
    counter = Counter()
    module = Applied(jnp.arange(3.0), first, counter)
    _, module = call_in(placement, module, Applied.out)
    other = Applied(module.x, second, counter, cache=module.cache)
    with counter.paused():
        expected = Applied.out.fn(other)
    value, other = call_in(placement, other, Applied.out)
    assert_same(value, expected)
    assert counter.n == 2


def test_nan_payloads_are_distinct():
    assert _token.token(nan(1)) != _token.token(nan(2))
    assert _token.token(nan(1)) == _token.token(nan(1))


def test_two_devices_get_two_keys():
    # (A second CPU device needs XLA_FLAGS before JAX starts: compared by identity.)
    device = jax.devices()[0]
    assert _token.token(device) == _token.token(device)
    assert _token.token(np.random.default_rng(0)) != _token.token(np.random.default_rng(0))


def test_equal_parts_of_distinct_objects_hit():
    counter = Counter()
    module = Applied(jnp.arange(3.0), Cfg(2), counter)
    _, module = memox.call(module, Applied.out)
    again = Applied(module.x, Cfg(2), counter, cache=module.cache)
    _, again = memox.call(again, Applied.out)
    assert counter.n == 1


def test_the_fast_path_is_as_exact_as_the_key():
    # The per-call lookup compares tree structures by `==`; the tokens of their nodes'
    # data make it exact: equal fast keys, equal static keys.
    one = jax.tree.structure(Applied(jnp.zeros(1), (1,), None))
    true = jax.tree.structure(Applied(jnp.zeros(1), (True,), None))
    assert one == true  # JAX's own comparison cannot tell them apart
    assert _token.token(one) != _token.token(true)
    assert _token.node_token(Applied(jnp.zeros(1), (1,), None)) != _token.node_token(
        Applied(jnp.zeros(1), (True,), None)
    )


@pytest.mark.parametrize(
    "part",
    [
        (1, "a", None, True, 2.5, b"x"),
        {"b": 1, "a": (2, 3)},
        frozenset({"x", "y", "z"}),
        Cfg((1, 2.0)),
        np.arange(3),
        jax.numpy.sum,
    ],
)
def test_canonical_parts_have_the_same_bytes_in_every_process(part):
    import subprocess
    import sys

    script = (
        "import pickle, sys, jax, jax.numpy as jnp, numpy as np; from memox import _key, _token; "
        "sys.path.insert(0, 'tests'); import test_token; "
        "part = pickle.loads(bytes.fromhex(sys.argv[1])); "
        "k = _key.static_key(_token.token(part)); print(k.local, k.encoded.hex())"
    )
    import pickle

    out = subprocess.run(
        [sys.executable, "-c", script, pickle.dumps(part).hex()],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "PYTHONHASHSEED": "123", "JAX_PLATFORMS": "cpu"},
    ).stdout.split()
    here = _key.static_key(_token.token(part))
    assert out == ["False", here.encoded.hex()] and not here.local


# -- one answer in every process: functions and local classes by their code ------------


def _scaled(a):
    def scale(x):
        return x * a

    return scale


def _local_module():
    class Inner(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return super().__getattribute__("w") * x

    return Inner(jnp.ones(3))


def _local_config():
    @dataclasses.dataclass(frozen=True)
    class Config:
        depth: int
        act: object

    return Config(2, lambda x: x - 1)


MODELS = {
    "lambda": lambda: Applied(jnp.zeros(3), lambda x: x + 1, None),
    "closure": lambda: Applied(jnp.zeros(3), _scaled(2.0), None),
    "local module": lambda: Applied(_local_module(), jnp.tanh, None),
    "local dataclass": lambda: Applied(jnp.zeros(3), _local_config(), None),
    "dataclass of a lambda": lambda: Applied(jnp.zeros(3), Cfg(lambda x: x), None),
}


def _model_key(name):
    from memox import _plan

    module, arrays = _plan.Parts.split(MODELS[name]())
    args, arg_arrays = _plan.Parts.split(((), {}))
    return _plan._static_key(Applied.out.spec, module, arrays, args, arg_arrays)


@pytest.mark.parametrize("name", MODELS)
def test_functions_and_local_classes_have_the_same_key_in_every_process(name):
    # Regression (issue 19 item 2): a lambda, a closure or a class defined in a function
    # was keyed by identity and salted with a per-process nonce, so the processes of one
    # program held different key bits (one hit where another missed).
    import os
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, 'tests'); import test_token; "
        "k = test_token._model_key(sys.argv[1]); print(k.local, k.encoded.hex())"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", script, name],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"},
        ).stdout.split()
        for seed in ("1", "2")
    ]
    # (Not compared with this process's key: conftest.py's configuration is in the
    # trace context.)
    assert outs[0] == outs[1] and outs[0][0] == "False"
    assert not _model_key(name).local


def test_functions_are_equal_by_code_defaults_and_closure_contents():
    same = [lambda x: x + 1, lambda x: x + 1]
    assert _token.token(same[0]) == _token.token(same[1])
    assert _token.token(lambda x: x + 1) != _token.token(lambda x: x + 2)
    assert _token.token(lambda x: x + 1) != _token.token(lambda y: y + 1)  # (names too)
    assert _token.token(lambda x, a=1: x + a) != _token.token(lambda x, a=True: x + a)
    assert _token.token(_scaled(2.0)) == _token.token(_scaled(2.0))
    for a, b in [(2.0, 3.0), (0.0, -0.0), (1, True), ((1,), [1])]:
        assert _token.token(_scaled(a)) != _token.token(_scaled(b))
    assert _token.token(_local_config()) == _token.token(_local_config())


def _recursive():
    def countdown(n):
        return n if n <= 0 else countdown(n - 1)

    return countdown


def test_a_cycle_is_encoded_not_numbered():
    assert _token.token(_recursive()) == _token.token(_recursive())
    assert not _key.static_key(_token.token(_recursive())).local
    assert not _key.static_key(_token.token(type(_local_module()))).local


def test_a_closure_over_an_array_is_taken_by_identity():
    w = jnp.ones(3)
    first, second = (lambda x: x * w), (lambda x: x * w)
    assert _token.token(first) == _token.token(first) != _token.token(second)
    assert _key.static_key(_token.token(first)).local


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_equal_function_hits_and_a_different_one_recomputes(placement):
    counter = Counter()
    module = Applied(jnp.arange(3.0), _scaled(2.0), counter)
    _, module = call_in(placement, module, Applied.out)
    again = Applied(module.x, _scaled(2.0), counter, cache=module.cache)
    _, again = call_in(placement, again, Applied.out)
    assert counter.n == 1
    other = Applied(module.x, _scaled(-2.0), counter, cache=again.cache)
    value, _ = call_in(placement, other, Applied.out)
    assert_same(value, -2.0 * module.x)
    assert counter.n == 2


_TRACES = collections.Counter()  # a global a cached method writes to


class Counted(eqx.Module):
    x: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def out(self):
        _TRACES["out"] += 1
        self.counter.tick()
        return self.x * 2


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_method_reading_an_unhashable_global_is_keyed_on_it_by_identity(placement):
    # The examples count traces in a module-level `collections.Counter`: an unhashable
    # object with its own `__eq__`, read by the method's code. `jax.jit` captures such a
    # global when it traces; memox keys on it by identity and does not refuse it.
    counter = Counter()
    module = Counted(jnp.arange(3.0), counter)
    value, module = call_in(placement, module, Counted.out)
    again, _ = call_in(placement, module, Counted.out)
    assert_same(value, 2 * module.x)
    assert_same(again, 2 * module.x)
    assert counter.n == 1
    assert _key.static_key(_token.token(Counted.out)).local


def test_an_unhashable_static_field_is_refused():
    module = Applied(jnp.arange(3.0), collections.Counter(), Counter())
    with pytest.raises(TypeError, match="`Counter` is neither hashable nor a plain value"):
        memox.call(module, Applied.out)


def _closing_over_an_array():
    w = jnp.ones(3)
    return lambda x: x * w


@pytest.mark.parametrize(
    "part, named",
    [
        (np.random.default_rng(0), r"`numpy.random._generator.Generator` object"),
        (_closing_over_an_array(), r"closure variable `w` of `_closing_over_an_array.<locals>"),
    ],
)
def test_several_processes_refuse_a_part_without_a_canonical_token(monkeypatch, part, named):
    from memox import _jax_internals

    monkeypatch.setattr(_jax_internals, "process_count", lambda: 2)
    module = Applied(jnp.arange(3.0), part, None)
    with pytest.raises(ValueError, match=r"memox runs in 2 processes") as error:
        memox.call(module, Applied.out)
    assert re.search(named, str(error.value))
    assert "Make it a dataclass" in str(error.value)
    # Canonical parts pass.
    value, _ = memox.call(Mapped(jnp.arange(3.0), _scaled(2.0)), Mapped.out)
    assert_same(value, 2.0 * jnp.arange(3.0))


# -- JAX's own objects by their pickle reduction -----------------------------------------


def _sharding_parts():
    explicit = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
    auto = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
    meshes = [explicit, auto, jax.make_mesh((1,), ("y",)), jax.make_mesh((1, 1), ("x", "y"))]
    specs = [P(), P("x"), P(None), P(("x",)), P("x", None), P("x", unreduced={"y"})]
    specs.append(P(P.UNCONSTRAINED))
    shardings = [NamedSharding(m, s) for m in (explicit, auto) for s in specs[:3]]
    shardings.append(NamedSharding(explicit, P("x"), memory_kind="pinned_host"))
    return [*meshes, *specs, *shardings, explicit.abstract_mesh, auto.abstract_mesh]


def test_meshes_specs_and_shardings_have_equal_tokens_exactly_when_equal():
    # Built twice: equal objects that are distinct (specs, shardings) and interned ones
    # (a `Mesh` built again is the same object); none numbered by this process.
    for a, b in itertools.product(_sharding_parts(), _sharding_parts()):
        same = a is b if type(a).__eq__ is object.__eq__ else type(a) is type(b) and a == b
        assert (_token.token(a) == _token.token(b)) == bool(same), (a, b)
    assert not any(_key.static_key(_token.token(p)).local for p in _sharding_parts())


def test_a_sharding_has_the_same_bytes_in_every_process():
    import subprocess
    import sys

    made = 'NamedSharding(jax.make_mesh((1,), ("x",)), P("x", None), memory_kind="device")'
    script = (
        "import jax; from jax.sharding import NamedSharding, PartitionSpec as P; "
        "from memox import _key, _token; "
        f"k = _key.static_key(_token.token({made})); print(k.local, k.encoded.hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "PYTHONHASHSEED": "123", "JAX_PLATFORMS": "cpu"},
    ).stdout.split()
    here = _key.static_key(_token.token(eval(made)))
    assert out == ["False", here.encoded.hex()] and not here.local


_RUNS = []


def _ran():
    _RUNS.append(None)


class Placed(eqx.Module):
    x: jax.Array
    sharding: object = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def out(self):
        jax.debug.callback(_ran)
        return jax.device_put(2 * self.x, self.sharding)


def test_several_processes_take_a_sharding_by_value(monkeypatch):
    from memox import _jax_internals

    monkeypatch.setattr(_jax_internals, "process_count", lambda: 2)
    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
    runs = len(_RUNS)
    value, module = memox.call(Placed(jnp.arange(4.0), NamedSharding(mesh, P("x"))), Placed.out)
    again = Placed(module.x, NamedSharding(mesh, P("x")), cache=module.cache)  # equal, not same
    value_again, _ = memox.call(again, Placed.out)
    assert len(_RUNS) - runs == 1
    assert_same(value_again, value)


class Mapped(eqx.Module):
    x: jax.Array
    how: object = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def out(self):
        return self.how(self.x)


# -- by content, never by a rebindable name (issue 31) ----------------------------------


def _script(monkeypatch, source, name="issue31_script", file=None):
    """`source` run as a module of the user's (a script, a notebook's `__main__`)."""
    module = types.ModuleType(name)
    module.__file__ = file or f"/home/user/{name}.py"
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(source, module.__file__, "exec"), vars(module))
    return module


def test_a_variable_rebound_in_a_loop_is_keyed_by_its_value(monkeypatch):
    # Regression: issue 31 case 3. Each object bound to a variable of the module that
    # defines its class was keyed by that name: `Config(1.0)` and then `Config(2.0)`,
    # bound to `cfg` by a loop at the top of a script, got one token.
    script = _script(
        monkeypatch,
        "import dataclasses\n"
        "from memox import _token\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Config:\n"
        "    lr: float\n"
        "class Marker:\n"
        "    pass\n"
        "tokens, markers = [], []\n"
        "for cfg in [Config(1.0), Config(2.0), Config(1.0)]:\n"
        "    tokens.append(_token.token(cfg))\n"
        "for marker in [Marker(), Marker()]:\n"
        "    markers.append(_token.token(marker))\n",
    )
    assert script.tokens[0] != script.tokens[1] and script.tokens[0] == script.tokens[2]
    assert script.markers[0] != script.markers[1]  # no content: by identity
    assert _key.static_key(script.markers[0]).local


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_rebound_variable_recomputes(monkeypatch, placement):
    # Regression: issue 31 case 3, end to end: the second value hit the first's.
    import fuzz_parts

    counter = Counter()
    monkeypatch.setattr(fuzz_parts, "current", Cfg(1.0), raising=False)
    module = Applied(jnp.arange(3.0), fuzz_parts.current, counter)
    _, module = call_in(placement, module, Applied.out)
    monkeypatch.setattr(fuzz_parts, "current", Cfg(2.0))
    other = Applied(module.x, fuzz_parts.current, counter, cache=module.cache)
    value, _ = call_in(placement, other, Applied.out)
    assert_same(value, jnp.full(3, 2.0))
    assert counter.n == 2


def test_a_redefined_function_or_class_is_a_new_token(monkeypatch):
    # Regression: issue 31 case 3. A function or class importable by its qualified name
    # was keyed by it: defined again under that name (a notebook cell run again), it
    # kept the old one's token.
    script = _script(monkeypatch, "def f(x):\n    return x + 1\nclass K:\n    n = 1\n")
    f, k = _token.token(script.f), _token.token(script.K)
    exec("def f(x):\n    return x + 2\nclass K:\n    n = 2\n", vars(script))
    assert _token.token(script.f) != f and _token.token(script.K) != k
    exec("def f(x):\n    return x + 1\nclass K:\n    n = 1\n", vars(script))
    assert _token.token(script.f) == f and _token.token(script.K) == k  # same code
    # A function reading a global: by the value it reads.
    exec("def g(x):\n    return f(x)\n", vars(script))
    g = _token.token(script.g)
    exec("def f(x):\n    return x + 3\ndef g(x):\n    return f(x)\n", vars(script))
    assert _token.token(script.g) != g


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_redefined_function_recomputes(monkeypatch, placement):
    # Regression: issue 31 case 3, end to end: the redefinition hit the old value.
    script = _script(monkeypatch, "def f(x):\n    return x + 1\n")
    counter = Counter()
    module = Applied(jnp.arange(3.0), script.f, counter)
    _, module = call_in(placement, module, Applied.out)
    exec("def f(x):\n    return x + 2\n", vars(script))
    other = Applied(module.x, script.f, counter, cache=module.cache)
    value, _ = call_in(placement, other, Applied.out)
    assert_same(value, jnp.arange(3.0) + 2)
    assert counter.n == 2


def test_installed_sentinels_are_named_once(monkeypatch):
    # Regression: issue 31 case 3. Installed code's sentinels keep their name; a name
    # is given to one object per process, never to the object bound there next.
    import site

    assert _token.token(dataclasses.MISSING) == ("n", "dataclasses:MISSING")
    file = f"{site.getsitepackages()[0]}/issue31_library.py"
    library = _script(
        monkeypatch,
        "class _Sentinel:\n    pass\nMISSING = _Sentinel()\n",
        name="issue31_library",
        file=file,
    )
    first = library.MISSING
    assert _token.token(first) == ("n", "issue31_library:MISSING")
    library.MISSING = library._Sentinel()
    assert _token.token(library.MISSING) != _token.token(first)
    assert _token.token(first) == ("n", "issue31_library:MISSING")


def test_functions_that_call_each_other_cost_one_walk_and_one_answer(monkeypatch):
    # Regression: issue 31 case 3. Module-level functions are walked by content: many
    # that call each other are walked once, and the token of one does not depend on
    # which were met first (the processes of a program meet them in any order).
    n = 12
    source = "".join(
        f"def f{i}(x):\n    return " + " + ".join(f"f{j}(x)" for j in range(n) if j != i) + "\n"
        for i in range(n)
    )
    script = _script(monkeypatch, source)
    cold = _token.token(script.f0)
    exec(source, vars(script))  # the same code again, new objects: nothing remembered
    for i in reversed(range(n)):
        _token.token(getattr(script, f"f{i}"))
    assert _token.token(script.f0) == cold
    exec(source.replace("def f3(x):\n    return ", "def f3(x):\n    return 1 + "), vars(script))
    assert _token.token(script.f0) != cold


class _Calls(functools.partial):
    def __call__(self, x):
        return -super().__call__(x)


def _first_keyword(x, **keywords):
    return x * next(iter(keywords.values()))


def test_partials_by_type_and_keywords_in_order_and_arrays_by_type():
    # Regression: issue 31 case 4.
    assert _token.token(_Calls(jnp.multiply, 2.0)) != _token.token(
        functools.partial(jnp.multiply, 2.0)
    )
    ab = functools.partial(_first_keyword, a=2.0, b=3.0)
    assert _token.token(ab) != _token.token(functools.partial(_first_keyword, b=3.0, a=2.0))
    assert _token.token(ab) == _token.token(functools.partial(_first_keyword, a=2.0, b=3.0))
    assert _token.token({"a": 1, "b": 2}) != _token.token({"b": 2, "a": 1})
    weak, strong = jnp.asarray(1.0), jnp.asarray(1.0, jnp.float32)
    assert weak.weak_type and not strong.weak_type
    assert _token.token(weak) != _token.token(strong)
    assert _token.token(strong) == _token.token(jnp.asarray(1.0, jnp.float32))
    assert _token.token(np.float32(1)) != _token.token(np.array(1, np.float32))
    assert not _key.static_key(_token.token(weak)).local


@pytest.mark.parametrize(
    "first, second",
    [
        (functools.partial(jnp.multiply, 2.0), _Calls(jnp.multiply, 2.0)),
        (
            functools.partial(_first_keyword, a=2.0, b=3.0),
            functools.partial(_first_keyword, b=3.0, a=2.0),
        ),
    ],
)
def test_partials_that_differ_recompute(first, second):
    # Regression: issue 31 case 4, end to end: the second hit the first's value.
    counter = Counter()
    module = Applied(jnp.arange(3.0), first, counter)
    _, module = memox.call(module, Applied.out)
    other = Applied(module.x, second, counter, cache=module.cache)
    value, _ = memox.call(other, Applied.out)
    assert_same(value, second(module.x))
    assert counter.n == 2


def _local_cached_class():
    class Local(eqx.Module):
        x: jax.Array
        cache: Memo[jax.Array] = Memo()

        @memox.cached("cache", policy=memox.policies.Drift(rtol=0.1, max_age=3))
        def out(self):
            return 2 * self.x

    return Local


MODELS["class with a cached method"] = lambda: Applied(jnp.zeros(3), _local_cached_class(), None)


def test_a_class_defined_in_a_function_runs_in_several_processes(monkeypatch):
    # Regression: issue 31 case 5. Its cached method (memox's `CachedMethod`), its
    # policy, its `Memo[...]` annotation and its empty slot had no canonical encoding.
    monkeypatch.setattr(_jax_internals, "process_count", lambda: 2)
    model = _local_cached_class()(jnp.arange(3.0))
    value, model = memox.call(model, type(model).out)
    assert_same(value, 2 * jnp.arange(3.0))
    value, model = memox.call(model, type(model).out)
    assert_same(value, 2 * jnp.arange(3.0))
    stats = memox.stats(model)["cache"]
    assert (int(stats.hits), int(stats.misses)) == (1, 1)
    assert not _key.static_key(_token.token(type(model).out)).local
    assert _token.token(type(model).out) == _token.token(_local_cached_class().out)
