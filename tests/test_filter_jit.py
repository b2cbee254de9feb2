"""`memox.filter_jit`: `eqx.filter_jit`'s results, unchanged inputs fingerprinted outside."""

import inspect
import re
from concurrent.futures import ThreadPoolExecutor

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Counter, Foo, Traces, foo

import memox
from memox import Memo, _prehash
from memox._fingerprint import known


class Frozen(eqx.Module):
    """A frozen backbone `w` and a trained head `v`; `features(x)` is keyed by `x`."""

    w: jax.Array
    v: jax.Array
    counter: Counter = eqx.field(static=True)
    features_cache: Memo[jax.Array] = Memo()

    @memox.cached("features_cache")
    def features(self, x):
        self.counter.tick()
        return jnp.tanh(x @ self.w)

    def predict(self, x):
        return self.features(x) @ self.v


def frozen(counter, seed=0):
    kw, kv = jax.random.split(jax.random.key(seed))
    return Frozen(jax.random.normal(kw, (4, 8)), jax.random.normal(kv, (8,)), counter)


def training_step(jit, traces):
    """The standard Equinox + optax step, `jit` being `eqx.filter_jit` or
    `memox.filter_jit`, its traces counted in `traces` (a `Traces`); the head `v` is
    trained, `w` frozen by the filter spec."""
    optim = optax.sgd(1e-2, momentum=0.9)  # (adam mixes int32 and floats: strict promotion)

    def spec(model):
        return eqx.tree_at(lambda m: m.v, jax.tree.map(lambda _: False, model), True)

    def loss_fn(diff, static, x, y):
        pred, model = memox.call(eqx.combine(diff, static), Frozen.predict, x)
        return jnp.mean(jnp.square(pred - y)), model

    @jit
    def step(model, opt_state, x, y):
        traces.tick()
        diff, static = eqx.partition(model, spec(model))
        (loss, model), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(diff, static, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, {"loss": loss, "tag": "mse"}

    def init(model):
        return optim.init(eqx.filter(model, spec(model)))

    return step, init


def data(seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (16, 4)), jax.random.normal(ky, (16,))


def test_same_results_and_structures_as_eqx_filter_jit():
    x, y = data()
    runs, c = {}, Counter()  # one counter: the static fields compare equal
    for jit in (eqx.filter_jit, memox.filter_jit):
        n0, traces = c.n, Traces()
        step, init = training_step(jit, traces)
        model = memox.init(frozen(c), Frozen.predict, x)
        opt_state = init(model)
        out = []
        for _ in range(4):
            model, opt_state, info = step(model, opt_state, x, y)
            out.append((model, opt_state, info))
        jax.effects_barrier()
        runs[jit] = out, c.n - n0, traces.n
    (eqx_out, eqx_n, eqx_traces), (our_out, our_n, our_traces) = runs.values()
    # One more program for `memox.filter_jit`: the hit decided on the host (no check).
    assert (eqx_n, eqx_traces) == (1, 1) and (our_n, our_traces) == (1, 2)
    for a, b in zip(eqx_out, our_out):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            if eqx.is_array(u):
                assert (u.dtype, u.shape) == (v.dtype, v.shape)
                # Integers (the slots) bit for bit, floats to their last bits: a decided
                # hit's program takes the features as a parameter (as a hand-hoisted step
                # does), and XLA may order the dots' sums otherwise than after a branch.
                floating = jnp.issubdtype(u.dtype, jnp.floating)
                rtol = 4 * np.finfo(u.dtype).eps if floating else 0
                np.testing.assert_allclose(u, v, rtol=rtol, atol=0)
            else:
                assert u == v
        assert b[2]["tag"] == "mse"


def test_unchanged_inputs_are_fingerprinted_outside_once(monkeypatch):
    tables = []
    original = _prehash.Inputs.table

    def spy(self, arrays):
        table = original(self, arrays)
        tables.append((np.asarray(table), list(arrays)))
        return table

    monkeypatch.setattr(_prehash.Inputs, "table", spy)
    monkeypatch.setattr(_prehash, "PREHASH_MIN_BYTES", 0)  # (this test's arrays are small)
    c, traces = Counter(), Traces()
    x, y = data()
    step, init = training_step(memox.filter_jit, traces)
    model = memox.init(frozen(c), Frozen.predict, x)
    w = model.w
    opt_state = init(model)
    for _ in range(3):
        model, opt_state, _ = step(model, opt_state, x, y)
    # The first call learns which inputs the check fingerprints (`w` and `x`); from the
    # second on, their fingerprints come in precomputed, by identity. The frozen `w`
    # comes back as a copy (as from `eqx.filter_jit`), known as the array it copies.
    assert model.w is not w
    np.testing.assert_array_equal(model.w, w)
    (first, _), (second, arrays), (third, _) = tables
    assert not first[:, 2].any()
    valid = {i for i in range(len(arrays)) if second[i, 2]}
    assert valid == {i for i, a in enumerate(arrays) if a is w or a is x}
    assert (third == second).all()
    for a in (w, x):
        (row,) = [i for i in valid if arrays[i] is a]
        np.testing.assert_array_equal(second[row, :2], known(a))
    assert c.n == 1 and traces.n == 2  # (the second: the hit decided on the host)


def test_passed_through_arrays_come_back_as_from_eqx_filter_jit():
    # Regression (issue 32): the frozen `w` passed through came back as the caller's own
    # array, so donating the returned model elsewhere deleted the caller's `w`. Now it is
    # a new array, as from `eqx.filter_jit` and `jax.jit`; a cache table passed through
    # (a hit's entries) is the caller's (copying it would cost what caching saves).
    c, traces = Counter(), Traces()
    x, y = data()
    step, init = training_step(memox.filter_jit, traces)
    model = memox.init(frozen(c), Frozen.predict, x)
    opt_state = init(model)
    model, opt_state, _ = step(model, opt_state, x, y)
    new, _, _ = step(model, opt_state, x, y)  # a hit decided on the host
    assert new.w is not model.w
    assert new.w.unsafe_buffer_pointer() != model.w.unsafe_buffer_pointer()
    np.testing.assert_array_equal(new.w, model.w)
    assert new.v is not model.v  # trained: a new array
    for field in ("value", "key"):
        assert getattr(new.features_cache, field) is getattr(model.features_cache, field)
    jax.effects_barrier()
    assert c.n == 1 and traces.n == 2


@pytest.mark.parametrize("change", ["new values", "same values, new array", "numpy, in place"])
def test_never_stale(change):
    c = Counter()
    model = memox.init(frozen(c), Frozen.predict, jnp.zeros((16, 4)))
    x = np.array(data()[0]) if change == "numpy, in place" else data()[0]

    @memox.filter_jit
    def predict(model, x):
        return memox.call(model, Frozen.predict, x)

    for _ in range(3):
        out, model = predict(model, x)
    assert c.n == 1
    if change == "new values":
        model = eqx.tree_at(lambda m: m.w, model, model.w.at[0, 0].add(1.0))
        x = x.at[3, 1].add(1.0)
    elif change == "same values, new array":
        model = eqx.tree_at(lambda m: m.w, model, jnp.array(model.w))
    else:
        x[3, 1] += 1.0  # a NumPy array can change in place: never trusted by identity
    out, model = predict(model, x)
    with c.paused():
        expected = model.predict(jnp.asarray(x))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert c.n == (1 if change == "same values, new array" else 2)


def test_donated_inputs_are_hashed_again_and_results_stay_right():
    c = Counter()
    x = data()[0]
    model = memox.init(frozen(c), Frozen.predict, x)

    @memox.filter_jit(donate="all-except-first")
    def predict(x, model):
        return memox.call(model, Frozen.predict, x)

    for i in range(4):
        w = model.w
        out, model = predict(x, model)
        # Donated: the old arrays are gone, the module's arrays are new objects.
        assert w.is_deleted() and model.w is not w
        with c.paused():
            np.testing.assert_allclose(out, model.predict(x), rtol=1e-5, atol=1e-6)
    assert c.n == 1  # new objects, same values: hashed again (in-graph), still hits


def test_donation_matches_eqx_filter_jit():
    for donate in ("all", "all-except-first", "none"):
        ours, theirs = (
            jit(lambda a, b: (a + 1, b * 2), donate=donate)
            for jit in (memox.filter_jit, eqx.filter_jit)
        )
        deleted = []
        for f in (ours, theirs):
            a, b = jnp.ones(3), jnp.ones(3)
            f(a, b)
            deleted.append((a.is_deleted(), b.is_deleted()))
        assert deleted[0] == deleted[1], donate


def test_traces_once_without_memox_init():
    # Empty slots are allocated before the first trace (as `memox.init` does for
    # methods without arguments), so the filled module does not retrace.
    c, traces = Counter(), Traces()

    @memox.filter_jit
    def step(f, scale):
        traces.tick()
        b, f = memox.call(f, Foo.b)
        return b * scale, f

    f = foo(c)
    for _ in range(4):
        out, f = step(f, jnp.float32(2))
    # (the second trace: the program for the hit decided on the host)
    assert traces.n == 2 and c.n == 1 and out == 2 * jnp.sum(f.a)


def test_static_and_keyword_arguments_and_non_array_outputs():
    c, traces = Counter(), Traces()

    @memox.filter_jit
    def fn(f, x, *, power, label="b"):
        traces.tick(power)
        b, f = memox.call(f, Foo.b)
        return {label: b * x * power, "n": power, "none": None}, f

    f = memox.init(foo(c))
    out, f = fn(f, jnp.float32(2), power=2)
    out, f = fn(f, x=jnp.float32(3), power=2)
    assert out == {"b": 6 * jnp.sum(f.a), "n": 2, "none": None}
    out, f = fn(f, jnp.float32(3), power=3, label="c")  # static arguments: retraces
    # (the second trace: the program for the hit decided on the host)
    assert set(out) == {"c", "n", "none"} and traces.seen == [2, 2, 3] and c.n == 1


def _signatures():
    def plain(a, b): ...
    def defaults(a, b=1, c=2): ...
    def positional_only(a, /, b=1): ...
    def var_args(a, *rest): ...
    def keyword_only(a, *, k): ...
    def keyword_default(a, *, k=1): ...
    def var_kwargs(a, **kw): ...
    def nothing(): ...

    return [
        plain,
        defaults,
        positional_only,
        var_args,
        keyword_only,
        keyword_default,
        var_kwargs,
        nothing,
    ]


@pytest.mark.parametrize("fun", _signatures(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("kwargs", [{}, {"a": 0}, {"k": 0}], ids=["no keywords", "a=", "k="])
def test_arguments_bind_as_inspect_binds_them(fun, kwargs):
    """The call a program is keyed by: what `inspect.Signature.bind` gives, or its error."""
    binding = memox._filter_jit._Binding.of(fun)
    signature = inspect.signature(fun)
    for n in range(5):
        args = tuple(range(10, 10 + n))
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            with pytest.raises(TypeError, match=re.escape(str(e))):
                binding.bind(args, kwargs)
        else:
            assert binding.bind(args, kwargs) == (bound.args, bound.kwargs)


def test_numpy_inputs_passed_through_come_back_as_jax_arrays():
    f = memox.filter_jit(lambda a, b: (a, b + 1))
    a = np.arange(3.0)
    out, _ = f(a, jnp.ones(2))
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, a)


def test_as_a_method():
    class Model(eqx.Module):
        a: jax.Array
        counter: Counter = eqx.field(static=True)
        b_cache: Memo[jax.Array] = Memo()

        @memox.cached("b_cache")
        def b(self):
            self.counter.tick()
            return jnp.sum(self.a)

        @memox.filter_jit
        def __call__(self, x):
            return memox.call(self, Model.b)[0] * x

    c = Counter()
    m = memox.init(Model(jnp.arange(4.0), c))
    assert m(jnp.float32(2)) == 12.0


def test_inside_an_outer_jit():
    c = Counter()

    @memox.filter_jit
    def inner(f):
        return memox.call(f, Foo.b)

    @jax.jit
    def outer(f):
        b, f = inner(f)
        return b + 1, f

    f = memox.init(foo(c))
    for _ in range(3):
        out, f = outer(f)
    assert out == jnp.sum(f.a) + 1 and c.n == 1


def test_invalid_donate_is_equinox_error():
    with pytest.raises(ValueError, match=re.escape("donate")):
        memox.filter_jit(lambda x: x, donate="some")


def test_docstring_example_runs():
    namespace = {"jax": jax, "jnp": jnp, "eqx": eqx, "memox": memox}
    for name in ("Memo", "init"):
        for code in re.findall(r"```python\n(.*?)```", getattr(memox, name).__doc__, re.S):
            exec(compile(_dedent(code), f"<memox.{name}>", "exec"), namespace)
    (code,) = re.findall(r"```python\n(.*?)```", memox.filter_jit.__doc__, re.S)
    exec(compile(_dedent(code), "<memox.filter_jit>", "exec"), namespace)
    assert namespace["y"] == 3 * jnp.sum(namespace["foo"].a)


def _dedent(code):
    import textwrap

    return textwrap.dedent(code)


def test_a_module_not_threaded_is_allocated_once(monkeypatch):
    # A caller that keeps passing the same unallocated module (not the returned one):
    # `memox.filter_jit` allocates its slots once (then misses, as `eqx.filter_jit`
    # would); `memox.jit` reuses the slots its last call on that module returned (hits).
    # (Regression: memox.jit allocated at every such call, 41x a threaded call.)
    import memox._lifecycle as lifecycle

    allocations = []
    allocate = lifecycle.allocate_plain_slots
    monkeypatch.setattr(
        lifecycle, "allocate_plain_slots", lambda t: allocations.append(1) or allocate(t)
    )
    c, traces = Counter(), Traces()

    @memox.filter_jit
    def step(f):
        traces.tick()
        return memox.call(f, Foo.b)

    f = foo(c)
    for _ in range(4):
        out, _ = step(f)
    assert len(allocations) == 1 and traces.n == 1 and c.n == 4
    del allocations[:]
    serve = memox.jit(lambda f: f.b())
    for _ in range(4):
        out, _ = serve(f)
    assert len(allocations) == 1 and c.n == 5 and out == jnp.sum(f.a)


@pytest.mark.parametrize("donor", ["memox.filter_jit", "eqx.filter_jit", "jax.jit"])
@pytest.mark.parametrize("where", ["argument", "inside a module"])
def test_donating_a_passed_through_output_deletes_what_eqx_filter_jit_would(where, donor):
    # Regression (issues 18, 32): an output that is an input passed through was the
    # caller's own array, where `eqx.filter_jit` returns a copy: a later donation of that
    # output deleted the caller's original (issue 18 guarded memox's own donation only).
    deleted = {}
    for jit in (eqx.filter_jit, memox.filter_jit):
        a, b = jnp.ones(3), jnp.ones(3)
        if where == "argument":
            through = jit(lambda a, b: (a, b + 1))
        else:
            through = jit(lambda a, b: ({"a": a}, b + 1))
        double = lambda t: jax.tree.map(lambda x: 2 * x, t)  # noqa: E731
        if donor == "jax.jit":
            donating = jax.jit(double, donate_argnums=0)
        else:
            donating = {"memox.filter_jit": memox.filter_jit, "eqx.filter_jit": eqx.filter_jit}[
                donor
            ](double, donate="all")
        out, _ = through(a, b)
        doubled = donating(out)
        np.testing.assert_array_equal(jax.tree.leaves(doubled)[0], 2 * a)
        deleted[jit] = (a.is_deleted(), jax.tree.leaves(out)[0].is_deleted())
    assert deleted[memox.filter_jit] == deleted[eqx.filter_jit] == (False, True)


def test_a_kept_model_survives_a_donating_step_after_a_passing_through_one():
    c = Counter()
    x = data()[0]
    model = memox.init(frozen(c), Frozen.predict, x)

    @memox.filter_jit
    def predict(model, x):
        return memox.call(model, Frozen.predict, x)

    @memox.filter_jit(donate="all")
    def shrink(model):
        return eqx.tree_at(lambda m: m.v, model, model.v * 0.5)

    _, model = predict(model, x)
    best = model
    _, model = predict(model, x)  # a hit decided on the host: the entries pass through
    assert model.features_cache.value is best.features_cache.value  # (not copied)
    model = shrink(model)  # donates a copy of them
    assert not any(x.is_deleted() for x in jax.tree.leaves(best))
    with c.paused():
        np.testing.assert_allclose(2 * model.predict(x), best.predict(x), rtol=1e-6)


class Normalised(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    unit_cache: Memo[jax.Array] = Memo()

    @memox.cached("unit_cache")
    def unit(self):
        self.counter.tick()
        return self.w / jnp.linalg.norm(self.w)


def test_partitioned_model_as_arguments_works_as_under_eqx_filter_jit():
    # Regression: `memox.filter_jit` allocated the empty slots of the static half of an
    # `eqx.partition` before the trace, computing the method on a module of `None`s.
    runs = {}
    for jit in (eqx.filter_jit, memox.filter_jit):
        c, traces = Counter(), Traces()
        model = Normalised(jnp.arange(1.0, 4.0), c)
        diff, static = eqx.partition(model, eqx.is_inexact_array)

        @jit
        def step(diff, static, x):
            traces.tick()
            y, model = memox.call(eqx.combine(diff, static), lambda m: m.unit() * x)
            return y, eqx.partition(model, eqx.is_inexact_array)

        for _ in range(3):
            y, (diff, static) = step(diff, static, jnp.float32(2))
        jax.effects_barrier()
        runs[jit] = (np.asarray(y), traces.n, c.n)
    (y_eqx, *counts_eqx), (y_ours, *counts_ours) = runs.values()
    np.testing.assert_array_equal(y_ours, y_eqx)
    # The first fill retraces once (`memox.init` avoids it); `memox.filter_jit` then
    # compiles the program for the hit decided on the host.
    assert counts_eqx == [2, 1] and counts_ours == [3, 1]


@pytest.mark.parametrize(
    "wrap", ["a function", "a bound method", "a module", "eqx.filter_grad", "a wrapper"]
)
@pytest.mark.parametrize("jit", [eqx.filter_jit, memox.filter_jit], ids=["eqx", "memox"])
def test_wrapping_again_reuses_the_program(wrap, jit):
    # Regression (issue 32): each `memox.filter_jit(fun)` compiled its own program, so a
    # function wrapped again (in a loop, in a function called often) traced every time.
    # As `eqx.filter_jit`: one program per function object (or name, for any other
    # callable), whatever wraps it. (The modules: their static parts compare equal.)
    traced = Traces()

    def f(x):
        traced.tick()
        return jnp.sin(x)

    class M(eqx.Module):
        scale: jax.Array

        def method(self, x):
            traced.tick()
            return x * self.scale

        def __call__(self, x):
            traced.tick()
            return x + self.scale

    wrapped = {
        "a function": lambda m: jit(f),
        "a bound method": lambda m: jit(m.method),
        "a module": lambda m: jit(m),
        "eqx.filter_grad": lambda m: jit(eqx.filter_grad(f)),
        "a wrapper": lambda m: jit(jit(f)),
    }[wrap]
    x = jnp.float32(0.5)
    for k in range(5):
        y = wrapped(M(jnp.float32(2 + k)))(x)
        assert jnp.isfinite(y)
    assert traced.n == 1


def _fine_tune(m, x):
    return memox.call(m, Frozen.predict, x)


def test_a_wrapper_made_at_every_call_shares_what_the_host_learned():
    # The prehash table and the hits decided on the host belong to the program, not to
    # the wrapper: a step wrapped afresh at every call decides the hit as one wrapper does.
    c = Counter()
    x = data()[0]
    model = memox.init(frozen(c), Frozen.predict, x)
    traced = Traces()

    def step(m, x):
        traced.tick()
        return _fine_tune(m, x)

    for _ in range(5):
        out, model = memox.filter_jit(step)(model, x)
    hit = memox.filter_jit(step).lower(model, x).compile().as_text()
    jax.effects_barrier()
    assert "conditional" not in hit  # the hit is decided on the host
    assert c.n == 1 and traced.n == 2  # (the second: the program of the decided hit)
    with c.paused():
        np.testing.assert_allclose(out, model.predict(x), rtol=1e-5, atol=1e-6)


def test_threads_wrapping_the_same_function_share_its_program():
    # Each thread wraps the step afresh at every call, on a model of its own: one
    # program, results right, each model's features computed once.
    c = Counter()
    x = data()[0]
    traced = Traces()

    def step(m, x):
        traced.tick()
        return _fine_tune(m, x)

    warm = memox.init(frozen(c, seed=9), Frozen.predict, x)
    for _ in range(3):
        _, warm = memox.filter_jit(step)(warm, x)
    jax.effects_barrier()
    assert traced.n == 2

    def run(seed):
        model = memox.init(frozen(c, seed), Frozen.predict, x)
        for _ in range(8):
            out, model = memox.filter_jit(step)(model, x)
        return out, model

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(4)))
    jax.effects_barrier()
    assert traced.n == 2 and c.n == 1 + 4
    with c.paused():
        for out, model in results:
            np.testing.assert_allclose(out, model.predict(x), rtol=1e-5, atol=1e-6)


# (As from `eqx.filter_jit(...).lower`: JAX warns, lowering, of a donated input no output
# can reuse.)
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("donate", ["none", "all-except-first", "all"])
def test_lower_compile_takes_and_returns_the_callers_trees(donate):
    # Regression (issue 32): `.lower(...)` lowered memox's flat function, whose compiled
    # form the caller's arguments did not fit. As Equinox's: called as the step.
    c, traced = Counter(), Traces()
    x = data()[0]

    @memox.filter_jit(donate=donate)
    def step(m, x):
        traced.tick()
        return _fine_tune(m, x)

    model = memox.init(frozen(c), Frozen.predict, x)
    compiled = step.lower(model, jnp.copy(x)).compile()
    assert traced.n == 1
    for _ in range(4):
        out, model = compiled(model, jnp.copy(x))
        with c.paused():
            np.testing.assert_allclose(out, model.predict(x), rtol=1e-5, atol=1e-6)
    jax.effects_barrier()
    # One program, fixed (it checks in-graph): the features computed once, then hits.
    assert traced.n == 1 and c.n == 1 and memox.stats(model)["features_cache"].hits == 3
    assert "conditional" in compiled.as_text() and compiled.memory_analysis() is not None


def test_a_compiled_hit_program_runs_where_the_host_decides_that_hit():
    # `step.lower(...)` after a loop lowers the program a call would run now (the hit
    # decided on the host: no check). Compiled, it runs where the host decides that hit
    # again; another call (a new model) runs the program that checks, compiled once.
    c, traced = Counter(), Traces()
    x = data()[0]

    @memox.filter_jit
    def step(m, x):
        traced.tick()
        return _fine_tune(m, x)

    model = memox.init(frozen(c), Frozen.predict, x)
    for _ in range(3):
        _, model = step(model, x)
    compiled = step.lower(model, x).compile()
    assert "conditional" not in compiled.as_text()
    for _ in range(3):
        out, model = compiled(model, x)
    other = memox.init(frozen(c, seed=5), Frozen.predict, x)
    for _ in range(2):
        out_other, other = compiled(other, x)
    jax.effects_barrier()
    # (`other`'s program, the checking one, was traced at the loop's first call.)
    assert c.n == 2 and traced.n == 2
    with c.paused():
        np.testing.assert_allclose(out, model.predict(x), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out_other, other.predict(x), rtol=1e-5, atol=1e-6)


def test_a_compiled_step_called_with_other_static_arguments_raises():
    f = memox.filter_jit(lambda x, n: x * n)
    compiled = f.lower(jnp.ones(3), 2).compile()
    np.testing.assert_array_equal(compiled(jnp.ones(3), 2), 2 * jnp.ones(3))
    with pytest.raises(TypeError, match=re.escape("lower and compile it again")):
        compiled(jnp.ones(3), 3)


def test_a_cache_table_deleted_elsewhere_is_recomputed():
    # A hit's entries pass through as the caller's arrays: donating the returned model
    # elsewhere deletes them in the model passed in too. That model still works: its
    # slot is revived (recomputed, with a warning), by `memox.filter_jit`, `memox.call`
    # and `memox.jit`. The parameters, copies, are untouched.
    c = Counter()
    x = data()[0]
    step = memox.filter_jit(_fine_tune)
    model = memox.init(frozen(c), Frozen.predict, x)
    _, model = step(model, x)
    _, new = step(model, x)  # a hit decided on the host: entries passed through
    assert new.features_cache.value is model.features_cache.value
    eqx.filter_jit(lambda t: t, donate="all")(new)
    assert model.features_cache.value.is_deleted() and not model.w.is_deleted()
    expected = [(step, (model, x)), (memox.call, (model, Frozen.predict, x))]
    expected.append((memox.jit(Frozen.predict), (model, x)))
    for f, args in expected:
        with pytest.warns(UserWarning, match="were deleted"):
            out, _ = f(*args)
        with c.paused():
            np.testing.assert_allclose(out, model.predict(x), rtol=1e-5, atol=1e-6)
    jax.effects_barrier()
    assert c.n == 1 + 3


def test_an_original_is_held_while_a_copy_of_it_lives():
    # A copy returned of an array a check reads is known as its original, which is held
    # (so the host's decisions by identity apply to the copy) only while a copy lives.
    import gc
    import weakref

    c = Counter()
    x = data()[0]
    step = memox.filter_jit(_fine_tune)
    model = memox.init(frozen(c), Frozen.predict, x)
    w = weakref.ref(model.w)
    for _ in range(3):
        _, model = step(model, x)
    gc.collect()
    assert w() is not None and model.w is not w()
    del model
    gc.collect()
    assert w() is None


def test_clear_caches_forgets_the_programs():
    traced = Traces()

    def f(x):
        traced.tick()
        return x + 1

    memox.filter_jit(f)(jnp.ones(2))
    memox.filter_jit(f)(jnp.ones(2))
    memox.clear_caches()
    memox.filter_jit(f)(jnp.ones(2))
    assert traced.n == 2
