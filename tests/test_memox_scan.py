"""`memox.scan`: the same results, gradients and counts as `lax.scan`, with cached values
whose inputs the loop does not change read as loop constants (no `cond` in the loop)."""

import inspect

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, Kernel, Traces, foo, gp_loss, outer
from jax import lax

import memox
from memox import Memo
from memox.policies import Drift, Manual


T = 6
_SCANS = (lax.scan, memox.scan)


def _conds_in_loop(fn, *args):
    """The `cond`s inside the `scan`s of `fn`'s jaxpr, and the number of `scan`s."""
    conds, scans = 0, 0

    def walk(jaxpr, in_loop):
        nonlocal conds, scans
        for eqn in jaxpr.eqns:
            scans += eqn.primitive.name == "scan"
            conds += in_loop and eqn.primitive.name == "cond"
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, in_loop or eqn.primitive.name == "scan")

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return conds, scans


def _both(run, make, *args):
    """`run(scan, module, *args)` with `lax.scan` and `memox.scan` on fresh models
    (`make()` returns `(module, counter)`): `(outputs, computations)` for each."""
    out = {}
    for scan in (lax.scan, memox.scan):
        module, counter = make()
        out[scan] = jax.jit(lambda m, *a: run(scan, m, *a))(module, *args), counter.n
    return out[lax.scan], out[memox.scan]


def _assert_same(a, b):
    """Equal computation counts, and equal outputs leaf by leaf (slots included).

    Outputs are compared to `rtol=1e-6`, not bit for bit (see `memox/_scan.py`): a
    cached value computed at step 0 is computed by the first step, outside the loop,
    where XLA may compile the method otherwise (on jax 0.12's XLA:CPU a dot product is
    summed in another order), and the difference goes on through the carry. Elementwise
    bodies are compared bit for bit in `test_elementwise_bodies_are_bitwise_lax_scan`."""
    (out_a, n_a), (out_b, n_b) = a, b
    assert n_a == n_b
    leaves_a, leaves_b = _leaves(out_a), _leaves(out_b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def _leaves(tree):
    # The keys differ: each model's static `Counter` is part of its slots' fingerprints.
    items = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [x for path, x in items if jax.tree_util.keystr(path)[-4:] != ".key"]


def _fresh_foo():
    c = Counter()
    return memox.init(foo(c)), c


def _stats(module):
    return {k: (s.hits, s.misses) for k, s in memox.stats(module).items()}


# -- hoisted ---------------------------------------------------------------------------


def _reads_b(scan, f, xs):
    def body(f, x):
        b, f = memox.call(f, type(f).b)
        return f, b * x

    return scan(body, f, xs)


def test_an_unchanged_dependency_is_computed_once_and_read_outside_the_branch():
    xs = jnp.arange(T, dtype=jnp.float32)
    (ref, n_ref), (got, n_got) = _both(_reads_b, _fresh_foo, xs)
    assert n_ref == n_got == 1
    np.testing.assert_array_equal(ref[1], got[1])
    assert _stats(ref[0]) == _stats(got[0]) == {"b_cache": (T - 1, 1)}
    f = memox.init(foo(Counter()))
    assert _conds_in_loop(lambda f: _reads_b(lax.scan, f, xs), f) == (1, 1)
    assert _conds_in_loop(lambda f: _reads_b(memox.scan, f, xs), f) == (0, 1)


def test_a_filled_slot_hits_in_every_step():
    c = Counter()
    f = memox.init(foo(c))
    _, f = memox.call(f, Foo.b)
    xs = jnp.arange(T, dtype=jnp.float32)
    f, ys = jax.jit(lambda f: _reads_b(memox.scan, f, xs))(f)
    assert c.n == 1
    assert _stats(f) == {"b_cache": (T, 1)}
    np.testing.assert_array_equal(ys, np.asarray(f.a).sum() * np.asarray(xs))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 2])
def test_outputs_in_order(reverse, unroll):
    xs = {"x": jnp.arange(T, dtype=jnp.float32), "i": jnp.arange(T)}

    def run(scan, f, xs):
        def body(f, x):
            b, f = memox.call(f, Foo.b)
            return f, (b * x["x"], x["i"])

        return scan(body, f, xs, reverse=reverse, unroll=unroll)

    _assert_same(*_both(run, _fresh_foo, xs))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_length_without_xs(n):
    def run(scan, f):
        def body(carry, _):
            f, acc = carry
            b, f = memox.call(f, Foo.b)
            return (f, acc + b), acc

        return scan(body, (f, jnp.float32(0)), None, length=n)

    _assert_same(*_both(run, _fresh_foo))


@pytest.mark.parametrize("policy", [Drift(rtol=1e-3), Manual()], ids=["Drift", "Manual"])
def test_policies_that_decide_from_the_dependencies_are_hoisted(policy):
    class Model(eqx.Module):
        a: jax.Array
        counter: Counter = eqx.field(static=True)
        cache: Memo[jax.Array] = Memo()

        @memox.cached("cache", policy=policy)
        def b(self):
            self.counter.tick()
            return jnp.sum(self.a**2)

    def make():
        c = Counter()
        return memox.init(Model(jnp.arange(4.0), c)), c

    def run(scan, m, xs):
        def body(m, x):
            b, m = memox.call(m, Model.b)
            return m, b * x

        return scan(body, m, xs)

    xs = jnp.arange(T, dtype=jnp.float32)
    ref, got = _both(run, make, xs)
    _assert_same(ref, got)
    assert got[1] == 1
    assert _conds_in_loop(lambda m: run(memox.scan, m, xs), make()[0]) == (0, 1)


class _Counters:
    """The counters of `helpers.outer()`'s two methods, as one."""

    def __init__(self, *counters):
        self.counters = counters

    @property
    def n(self):
        return tuple(c.n for c in self.counters)


def test_nested_cached_methods():
    def make():
        model, ci, co = outer()
        return memox.init(model), _Counters(ci, co)

    def run(scan, m, xs):
        def body(m, x):
            L, m = memox.call(m, type(m).chol)
            return m, jnp.sum(L) * x

        return scan(body, m, xs)

    xs = jnp.arange(T, dtype=jnp.float32)
    ref, got = _both(run, make, xs)
    _assert_same(ref, got)
    assert got[1] == (1, 1)
    assert _stats(got[0][0]) == _stats(ref[0][0])
    assert _conds_in_loop(lambda m: run(memox.scan, m, xs), make()[0]) == (0, 1)


def test_a_slot_filled_by_another_method_in_the_first_step():
    # The body reads `inner.gram` directly after `chol`, whose first step fills it in its
    # miss branch: the first step's direct read of `gram` is then a hit on a slot that
    # `chol` rewrote, not a read of the slot that entered the body, so it is not
    # recorded, and `gram`'s slot stays in the carry (a branch in the loop); `chol` is
    # read as a loop constant.
    def make():
        model, ci, co = outer()
        return memox.init(model), _Counters(ci, co)

    def run(scan, m, xs):
        def body(m, x):
            L, m = memox.call(m, type(m).chol)
            G, m = memox.call(m, lambda m: m.inner.gram())
            return m, (jnp.sum(L) + jnp.sum(G)) * x

        return scan(body, m, xs)

    xs = jnp.arange(T, dtype=jnp.float32)
    ref, got = _both(run, make, xs)
    _assert_same(ref, got)
    assert got[1] == (1, 1)
    assert _stats(got[0][0]) == _stats(ref[0][0])
    assert _conds_in_loop(lambda m: run(memox.scan, m, xs), make()[0]) == (1, 1)


class Scaled(eqx.Module):
    a: jax.Array
    counter: Counter = eqx.field(static=True)
    cache: Memo[jax.Array] = Memo(size=2)

    @memox.cached("cache")
    def scaled(self, s):
        self.counter.tick()
        return self.a * s


def _scaled():
    c = Counter()
    return memox.init(Scaled(jnp.arange(3.0), c), Scaled.scaled, jnp.float32(1)), c


def _reads_scaled(scan, m, s, xs):
    def body(m, x):
        v, m = memox.call(m, Scaled.scaled, s)
        return m, v * x

    return scan(body, m, xs)


def test_an_argument_from_outside_the_loop():
    xs = jnp.arange(T, dtype=jnp.float32)
    ref, got = _both(_reads_scaled, _scaled, jnp.float32(3), xs)
    _assert_same(ref, got)
    assert got[1] == 1
    conds = _conds_in_loop(lambda m, s: _reads_scaled(memox.scan, m, s, xs), _scaled()[0], 3.0)
    assert conds == (0, 1)


# -- not hoisted: the same as lax.scan -------------------------------------------------


def _changes_a(scan, f, xs):
    def body(f, x):
        b, f = memox.call(f, Foo.b)
        f = eqx.tree_at(lambda f: f.a, f, f.a + jnp.where(x > 2, 1.0, 0.0))
        return f, b

    return scan(body, f, xs)


def _invalidates(scan, f, xs):
    def body(f, x):
        f = memox.invalidate(f, Foo.b, when=x == 3)
        b, f = memox.call(f, Foo.b)
        return f, b

    return scan(body, f, xs)


def _in_a_branch(scan, f, xs):
    def body(f, x):
        b, f = lax.cond(x > 2, lambda f: memox.call(f, Foo.b), lambda f: (jnp.float32(0), f), f)
        return f, b

    return scan(body, f, xs)


@pytest.mark.parametrize(
    "run", [_changes_a, _invalidates, _in_a_branch], ids=lambda f: f.__name__.strip("_")
)
def test_a_slot_the_loop_may_change_stays_in_the_carry(run):
    xs = jnp.arange(T, dtype=jnp.float32)
    ref, got = _both(run, _fresh_foo, xs)
    _assert_same(ref, got)
    assert _stats(ref[0][0]) == _stats(got[0][0])
    f = memox.init(foo(Counter()))
    jaxprs = {scan: _equations(jax.make_jaxpr(lambda f: run(scan, f, xs))(f)) for scan in _SCANS}
    assert jaxprs[memox.scan] == jaxprs[lax.scan]  # no first step outside the loop


def _equations(jaxpr):
    """The primitives and output types of `jaxpr`'s equations, sub-jaxprs included, in
    order. (Not `str(jaxpr)`: some JAX versions print function addresses in it.)"""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in jaxpr.eqns:
        out.append((eqn.primitive.name, tuple(str(v.aval) for v in eqn.outvars)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    out.append(_equations(sub))
    return out


def test_an_argument_computed_in_the_body_is_not_a_loop_constant():
    def run(scan, m, xs):
        def body(m, x):
            v, m = memox.call(m, Scaled.scaled, jnp.floor(x / 2))
            return m, v * x

        return scan(body, m, xs)

    xs = jnp.arange(T, dtype=jnp.float32)
    ref, got = _both(run, _scaled, xs)
    _assert_same(ref, got)
    assert got[1] == T // 2


def test_two_keys_in_one_step_are_not_loop_constants():
    # Pinning reads a slot as it was after the first step: with two keys per step in a
    # table of two entries that would hold, but memox pins one key per slot only.
    def run(scan, m, s, xs):
        def body(m, x):
            v, m = memox.call(m, Scaled.scaled, s)
            w, m = memox.call(m, Scaled.scaled, s + 1)
            return m, v * x + w

        return scan(body, m, xs)

    xs = jnp.arange(T, dtype=jnp.float32)
    ref, got = _both(run, _scaled, jnp.float32(3), xs)
    _assert_same(ref, got)
    assert got[1] == 2


def test_max_age_stays_in_the_carry():
    class Model(eqx.Module):
        a: jax.Array
        counter: Counter = eqx.field(static=True)
        cache: Memo[jax.Array] = Memo()

        @memox.cached("cache", policy=memox.policies.Exact(max_age=2))
        def b(self):
            self.counter.tick()
            return jnp.sum(self.a)

    def make():
        c = Counter()
        return memox.init(Model(jnp.arange(3.0), c)), c

    xs = jnp.arange(T, dtype=jnp.float32)
    ref, got = _both(_reads_b, make, xs)
    _assert_same(ref, got)
    assert got[1] == 2  # computed at steps 0 and 3


# -- lax.scan's types, counts and bits (issue 18, item 6) -------------------------------
#
# `memox.scan` runs `lax.scan`'s loop from the same `init` over every step: the first
# step, outside the loop, is run for what it fills only (see `memox/_scan.py`).


def _types(tree):
    return [jax.typeof(x) for x in jax.tree_util.tree_leaves(tree)]


_INITS = {
    "python float": lambda: 0.0,
    "weak array": lambda: jnp.asarray(0.0),
    "strong array": lambda: jnp.float32(0),
    "numpy scalar": lambda: np.float32(0),
    "weak vector": lambda: lax.full((2,), 0.0),
}
_UPDATES = {
    "unchanged": lambda acc, b, x: acc,
    "weak": lambda acc, b, x: acc + 1.0,
    "strong": lambda acc, b, x: acc + b * x,
}
_OUTPUTS = {
    "carry": lambda acc, b, x: acc,
    "weak from carry": lambda acc, b, x: acc * 2.0,
    "strong": lambda acc, b, x: b * x,
    "python scalar": lambda acc, b, x: 1.0,
    "x": lambda acc, b, x: x,
}


def _typed_run(scan, init, update, output, xs):
    def body(carry, x):
        f, acc, n = carry
        b, f = memox.call(f, Foo.b)
        return (f, update(acc, b, x), n + 1), (output(acc, b, x), acc)

    return scan(body, (memox.init(foo(Counter())), init, 0), xs)


# Regression (issue 18, item 6): from a Python scalar, a body returning a strongly typed
# carry gave strongly typed `ys` where `lax.scan`'s are weak (`lax.scan` passes its body
# `init`'s types at every step; the loop started from the first step's carry).
@pytest.mark.parametrize("init", _INITS, ids=str)
@pytest.mark.parametrize("update", _UPDATES, ids=str)
@pytest.mark.parametrize("output", _OUTPUTS, ids=str)
@pytest.mark.parametrize("xs", ["strong", "weak"])
def test_types_are_lax_scans(init, update, output, xs):
    xs = jnp.arange(T, dtype=jnp.float32) if xs == "strong" else lax.full((T,), 2.0)
    args = (_INITS[init](), _UPDATES[update], _OUTPUTS[output], xs)
    want, got = (jax.eval_shape(lambda: _typed_run(scan, *args)) for scan in _SCANS)
    assert _types(got) == _types(want)


@pytest.mark.parametrize("run", ["eager", "jit"])
def test_weak_outputs_combine_as_lax_scans(run):
    # The program: an accumulator from `0.0`, `ys` multiplied by bfloat16.
    xs = jnp.arange(T, dtype=jnp.float32)
    args = (0.0, _UPDATES["strong"], _OUTPUTS["carry"], xs)
    out = {}
    for scan in _SCANS:
        go = lambda: _typed_run(scan, *args)  # noqa: E731
        out[scan] = go() if run == "eager" else jax.jit(go)()
        assert (out[scan][1][0] * jnp.ones(T, jnp.bfloat16)).dtype == jnp.bfloat16
    assert _types(out[memox.scan]) == _types(out[lax.scan])
    np.testing.assert_array_equal(out[memox.scan][1], out[lax.scan][1])


class _Two(eqx.Module):
    """A method keyed by an argument (`scaled`) and one without (`total`)."""

    a: jax.Array
    scaled_cache: Memo[jax.Array] = Memo()
    total_cache: Memo[jax.Array] = Memo()

    @memox.cached("scaled_cache")
    def scaled(self, s):
        return self.a * s

    @memox.cached("total_cache")
    def total(self):
        return jnp.sum(jnp.sin(self.a))


def _counted(scan, how, filled):
    m = memox.init(_Two(jnp.arange(3.0)), _Two.scaled, jnp.float32(1))
    if filled:
        _, m = memox.call(m, _Two.scaled, jnp.float32(2))
        _, m = memox.call(m, _Two.total)
    xs = jnp.arange(T, dtype=jnp.float32)

    def loss(s, a, w):
        def body(m, x):
            v, m = memox.call(m, _Two.scaled, s)
            t, m = memox.call(m, _Two.total)
            return m, w * (jnp.sum(v) + t) * x

        m_out, ys = scan(body, eqx.tree_at(lambda m: m.a, m, a), xs)
        return jnp.sum(ys), m_out

    args = (jnp.float32(2), m.a, jnp.float32(3))
    run = {
        "plain": loss,
        "grad, frozen": jax.grad(loss, argnums=2, has_aux=True),
        "grad, argument": jax.grad(loss, argnums=0, has_aux=True),
        "grad, dependencies": jax.grad(loss, argnums=1, has_aux=True),
        "jvp, dependencies": lambda s, a, w: jax.jvp(
            lambda a: loss(s, a, w), (a,), (jnp.ones(3),), has_aux=True
        )[2],
    }[how]
    out = jax.jit(run)(*args)
    return _stats(out if how.startswith("jvp") else out[1])


# `memox.stats` counts are `lax.scan`'s, but where a hoisted method's dependencies or
# arguments carry a tangent: `lax.scan`'s tangent rule runs the method's `jvp` and
# stores its value at every read (`T` misses); `memox.scan` runs it once, in the first
# step (one miss), and the loop reads it (`T - 1` hits). This pins the rule its
# docstring states (issue 18, item 6: the docstring said "the same" under `grad`).
@pytest.mark.parametrize(
    "how",
    ["plain", "grad, frozen", "grad, argument", "grad, dependencies", "jvp, dependencies"],
)
@pytest.mark.parametrize("filled", [False, True], ids=["empty", "filled"])
def test_counts_are_lax_scans(how, filled):
    with jax.check_tracer_leaks(False):  # (see `test_gradients_through_a_frozen_carried_module`)
        want = _counted(lax.scan, how, filled)
    got = _counted(memox.scan, how, filled)
    before = {"scaled_cache": (0, 1), "total_cache": (0, 1)} if filled else {}
    differentiated = {
        "grad, argument": {"scaled_cache"},
        "grad, dependencies": {"scaled_cache", "total_cache"},
        "jvp, dependencies": {"scaled_cache", "total_cache"},
    }.get(how, set())
    for slot in ("scaled_cache", "total_cache"):
        h, m = before.get(slot, (0, 0))
        if slot in differentiated:
            assert (want[slot], got[slot]) == ((h, m + T), (h + T - 1, m + 1))
        else:
            assert want[slot] == got[slot] == (h + T - (not filled), m + (not filled))


_BODIES = {
    # (new accumulator, output) from the accumulator, the cached value and the element
    "sin": lambda acc, b, x: (acc + jnp.sin(b * x), jnp.sin(acc * x)),
    "division": lambda acc, b, x: (acc / (1 + b * x * x), acc / (b + x * x)),
    "rsqrt": lambda acc, b, x: (acc + lax.rsqrt(1 + b * x * x), jnp.sqrt(1 + acc * acc)),
    "constant": lambda acc, b, x: (acc + x, jnp.sin(_C * 1.3) + jnp.exp(_C) / 3 + 0 * x),
}
_C = jnp.linspace(-1.0, 1.0, 16)


def _elementwise(scan, body, how, filled):
    f = memox.init(foo(Counter()))
    if filled:
        _, f = memox.call(f, Foo.b)
    xs = jnp.asarray(np.random.default_rng(0).normal(size=(T, 16)), jnp.float32)

    def run(f, xs, w):
        def step(carry, x):
            f, acc = carry
            b, f = memox.call(f, Foo.b)
            acc, y = _BODIES[body](acc, b / 36.0, w * x)
            return (f, acc), y

        return scan(step, (f, jnp.ones(16)), xs)

    w = jnp.float32(0.5)
    if how == "eager":
        return run(f, xs, w)
    if how == "jit":
        return jax.jit(run)(f, xs, w)
    if how == "jit, closed over":
        return jax.jit(lambda: run(f, xs, w))()
    # The gradient with respect to a weight on the elements, the module frozen.
    return jax.jit(jax.grad(lambda w: jnp.sum(run(f, xs, w)[1] ** 2)))(w)


# Regression (issue 18, item 6): an elementwise body on a frozen module differed from
# `lax.scan` at step 0, where the step ran outside the loop: XLA folded it at compile
# time where its inputs were constants (other rounding than the compiled kernels), and
# eagerly it ran op by op. Now every step runs in the loop.
@pytest.mark.parametrize("body", _BODIES)
@pytest.mark.parametrize("how", ["eager", "jit", "jit, closed over", "grad"])
@pytest.mark.parametrize("filled", [False, True], ids=["empty", "filled"])
def test_elementwise_bodies_are_bitwise_lax_scan(body, how, filled):
    with jax.check_tracer_leaks(False):  # (see `test_gradients_through_a_frozen_carried_module`)
        want = _elementwise(lax.scan, body, how, filled)
    got = _elementwise(memox.scan, body, how, filled)
    leaves_want, leaves_got = _leaves(want), _leaves(got)
    assert len(leaves_want) == len(leaves_got)
    for a, b in zip(leaves_want, leaves_got):
        np.testing.assert_array_equal(a, b)


# -- composed with other transformations -------------------------------------------------


def _gp_scan(scan, log_scale, k, ys):
    def body(carry, y):
        k, acc = carry
        k = eqx.tree_at(lambda k: k.log_scale, k, log_scale)
        L, k = memox.call(k, Kernel.chol)
        return (k, acc + gp_loss(L, y)), None

    (k, acc), _ = scan(body, (k, jnp.float32(0)), ys)
    return acc


# Gradients through a hoisted value whose dependency carries a tangent are not bit for
# bit `lax.scan`'s: its cotangents are summed over the steps and pulled back through the
# method once, where `lax.scan` pulls back each step's and sums those (a few ulps).
def test_gradients_equal_lax_scan():
    c = Counter()
    x = jnp.linspace(0, 1, 8)[:, None]
    k = memox.init(Kernel(x, jnp.float32(0), c))
    ys = jnp.sin(jnp.arange(T, dtype=jnp.float32)[:, None] * x[None, :, 0])
    g = {
        scan: jax.jit(jax.grad(lambda s: _gp_scan(scan, s, k, ys)))(jnp.float32(0.3))
        for scan in (lax.scan, memox.scan)
    }
    np.testing.assert_allclose(g[memox.scan], g[lax.scan], rtol=1e-5)


def test_gradients_through_a_frozen_carried_module():
    x = jnp.linspace(0, 1, 8)[:, None]
    ys = jnp.sin(jnp.arange(T, dtype=jnp.float32)[:, None] * x[None, :, 0])

    def grad(scan):
        c = Counter()
        k = memox.init(Kernel(x, jnp.float32(0.2), c))

        def loss(w):
            def body(carry, y):
                k, acc = carry
                L, k = memox.call(k, Kernel.chol)
                return (k, acc + gp_loss(L, w * y)), None

            (_, acc), _ = scan(body, (k, jnp.float32(0)), ys)
            return acc

        return jax.jit(jax.grad(loss))(jnp.float32(1.5)), c.n

    got, computed = grad(memox.scan)
    # JAX's leak checker reports a false positive for `lax.scan` here (a debug callback
    # in a scan under `grad`: see the note in `test_scan.py`).
    with jax.check_tracer_leaks(False):
        want, _ = grad(lax.scan)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert computed == 1  # in the first step; the loop reads it


def test_differentiating_a_hoisted_dependency_is_exact():
    c = Counter()
    x = jnp.linspace(0, 1, 8)[:, None]
    ys = jnp.sin(jnp.arange(T, dtype=jnp.float32)[:, None] * x[None, :, 0])

    def loss(k, scan):
        def body(carry, y):
            k, acc = carry
            L, k = memox.call(k, Kernel.chol)
            return (k, acc + gp_loss(L, y)), None

        (_, acc), _ = scan(body, (k, jnp.float32(0)), ys)
        return acc

    k = memox.init(Kernel(x, jnp.float32(0.2), c))
    grads = {
        scan: eqx.filter_jit(eqx.filter_grad(lambda k: loss(k, scan)))(k).log_scale
        for scan in (lax.scan, memox.scan)
    }
    np.testing.assert_allclose(grads[memox.scan], grads[lax.scan], rtol=1e-5)


@pytest.mark.parametrize("outer_scan", _SCANS)
def test_inside_a_scan(outer_scan):
    xs = jnp.arange(T, dtype=jnp.float32)

    def outer_body(f, x):
        f, ys = _reads_b(memox.scan, f, xs * x)
        return f, ys.sum()

    c = Counter()
    run = jax.jit(lambda f: outer_scan(outer_body, f, jnp.arange(3.0)))
    f, totals = run(memox.init(foo(c)))
    assert c.n == 1
    assert _stats(f) == {"b_cache": (3 * T - 1, 1)}
    np.testing.assert_allclose(totals, np.asarray(f.a).sum() * xs.sum() * np.arange(3.0))
    conds, scans = _conds_in_loop(run, memox.init(foo(Counter())))
    # Inside `lax.scan`, the inner first step (a `cond`) runs in every outer step; inside
    # `memox.scan`, the outer first step holds it, and no `cond` is left in any loop
    # (scans: the outer loop, the inner loop in it, and the inner loop of the first step).
    assert (conds, scans) == ((1, 2) if outer_scan is lax.scan else (0, 3))


def test_eagerly():
    xs = jnp.arange(T, dtype=jnp.float32)
    c = Counter()
    f, ys = _reads_b(memox.scan, memox.init(foo(c)), xs)  # no jit
    assert (c.n, _stats(f)) == (1, {"b_cache": (T - 1, 1)})


def test_traced_once_under_jit():
    traces = Traces()

    @jax.jit
    def run(f, xs):
        traces.tick()
        return _reads_b(memox.scan, f, xs)

    c = Counter()
    f = memox.init(foo(c))
    for _ in range(3):
        f, _ = run(f, jnp.arange(T, dtype=jnp.float32))
    assert (traces.n, c.n) == (1, 1)
    assert _stats(f) == {"b_cache": (3 * T - 1, 1)}


def test_vmap_over_the_inputs():
    xs = jnp.arange(2 * T, dtype=jnp.float32).reshape(2, T)
    c = Counter()
    f = memox.init(foo(c))
    _, f = memox.call(f, Foo.b)
    ys = jax.jit(jax.vmap(lambda xs: _reads_b(memox.scan, f, xs)[1]))(xs)
    np.testing.assert_allclose(ys, np.asarray(f.a).sum() * np.asarray(xs))
    assert c.n == 1


def test_python_scalars_in_the_carry():
    def run(scan, f, xs):
        def body(carry, x):
            f, acc, steps = carry
            b, f = memox.call(f, Foo.b)
            return (f, acc + b * x, steps + 1), acc.shape

        return scan(body, (f, 0.0, 0), xs)

    xs = jnp.arange(T, dtype=jnp.float32)
    _assert_same(*_both(run, _fresh_foo, xs))


def test_a_carry_whose_type_changes_gets_lax_scans_error():
    def body(carry, x):
        f, acc = carry
        b, f = memox.call(f, Foo.b)
        return (f, (acc + b * x).astype(jnp.float16)), None

    f = memox.init(foo(Counter()))
    for scan in _SCANS:
        with pytest.raises(TypeError, match="scan body function carry input and carry output"):
            scan(body, (f, jnp.float32(0)), jnp.arange(T, dtype=jnp.float32))


def test_a_body_that_traces_differently_in_the_loop_loses_its_pin():
    # The probe and the first step see a body that leaves the slot alone; the loop's
    # trace (the third) invalidates it at step 3: a new slot (its key array is new), which
    # the loop checks in-graph at every step, as it is not the pinned one.
    traces = Traces()

    def run(scan, f, xs):
        def body(f, x):
            traces.tick()
            if traces.n >= 3:
                f = memox.invalidate(f, Foo.b, when=x == 3)
            b, f = memox.call(f, Foo.b)
            return f, b * x

        return scan(body, f, xs)

    xs = jnp.arange(T, dtype=jnp.float32)
    c = Counter()
    f, ys = jax.jit(lambda f: run(memox.scan, f, xs))(memox.init(foo(c)))
    assert traces.n == 3  # probe, first step, loop
    assert c.n == 2  # step 0 and step 3
    assert _stats(f) == {"b_cache": (T - 2, 2)}
    np.testing.assert_allclose(ys, np.asarray(f.a).sum() * np.asarray(xs))


def test_vmap_over_modules():
    xs = jnp.arange(T, dtype=jnp.float32)
    a = jnp.stack([jnp.eye(3), 2 * jnp.arange(9.0).reshape(3, 3)])

    def make():
        c = Counter()
        return jax.vmap(lambda a: memox.init(Foo(a, c)))(a), c

    def run(scan, fs):
        return jax.vmap(lambda f: _reads_b(scan, f, xs))(fs)

    # With batched dependencies the hit predicate is batched (a `select` would run both
    # sides): `lax.scan` computes in every step, and says so; `memox.scan` in the first
    # step only (its loop reads a loop constant).
    with pytest.warns(memox.UncachedWarning, match="batched"):
        ref, got = _both(run, make)
    assert (ref[1], got[1]) == (T, 1)
    _assert_same((ref[0], 0), (got[0], 0))
    fs, ys = got[0]
    np.testing.assert_allclose(ys, a.sum(axis=(1, 2))[:, None] * xs[None, :])
    np.testing.assert_array_equal(memox.stats(fs)["b_cache"].hits, [T - 1, T - 1])


# -- `lax.scan`'s signature ---------------------------------------------------------------


def test_the_signature_is_lax_scans():
    # Issue 32: `_split_transpose` was refused. Same names, kinds and defaults.
    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(memox.scan) == params(lax.scan)


@pytest.mark.parametrize("filled", [False, True], ids=["lax.scan's path", "hoisted"])
@pytest.mark.parametrize("length", [jnp.int32(T), np.int64(T), T], ids=["jax", "numpy", "int"])
def test_a_length_that_int_takes(length, filled):
    # Issue 32: a JAX or NumPy integer raised `TypeError: unhashable type` (`lax.scan`
    # takes what `int` takes).
    def run(scan, f, xs):
        def body(carry, x):
            f, acc = carry
            b, f = memox.call(f, Foo.b) if filled else (jnp.ones((3, 3)), f)
            return (f, acc + jnp.sum(b)), acc if x is None else x * b

        return scan(body, (f, jnp.float32(0)), xs, length=length)

    _assert_same(*_both(run, _fresh_foo, None))
    _assert_same(*_both(run, _fresh_foo, jnp.arange(T, dtype=jnp.float32)))


def test_a_traced_length_gets_lax_scans_error():
    # Issue 32: a traced `length` raised `TypeError: unhashable type`.
    f = memox.init(foo(Counter()))
    for scan in _SCANS:
        run = jax.jit(lambda n: scan(lambda c, _: (c, None), f, None, length=n))
        with pytest.raises(jax.errors.ConcretizationTypeError, match="`length` argument"):
            run(T)


@pytest.mark.parametrize("filled", [False, True], ids=["lax.scan's path", "hoisted"])
def test_split_transpose(filled):
    xs = jnp.arange(T, dtype=jnp.float32)

    def loss(scan, f, w):
        def body(f, x):
            b, f = memox.call(f, Foo.b) if filled else (jnp.ones((3, 3)), f)
            return f, w * b * x

        return jnp.sum(scan(body, f, xs, _split_transpose=True)[1])

    f = memox.init(foo(Counter()))
    got = jax.jit(jax.grad(lambda w: loss(memox.scan, f, w)))(2.0)
    # JAX's leak checker reports a false positive for `lax.scan` here (a debug callback
    # in a scan under `grad`: see the note in `test_scan.py`).
    with jax.check_tracer_leaks(False):
        want = jax.jit(jax.grad(lambda w: loss(lax.scan, f, w)))(2.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_refuses_a_function_that_is_not_callable():
    # Issue 32: the message was `memox.call`'s ("e.g. `memox.scan(Foo.b)`").
    message = r"^`memox.scan`: `f`, as for `lax.scan`, must be callable, .*; got str\. Pass"
    with pytest.raises(TypeError, match=message):
        memox.scan("body", memox.init(foo(Counter())), jnp.arange(3.0))
    with pytest.raises(TypeError, match="lax.scan.*callable.*"):  # as JAX's tests ask
        memox.scan(42, 0, 1)


# -- `xs` under `vjp` ---------------------------------------------------------------------


class _Scaled(eqx.Module):
    a: jax.Array  # (N,)
    b_cache: Memo[jax.Array] = Memo()

    @memox.cached("b_cache")
    def b(self):
        return jnp.tanh(self.a)


def _matrix_loss(scan):
    """A body whose backward pass reads each `x` (a matrix), with a small cached value."""

    def loss(theta, m, xs):
        def body(carry, x):
            m, h = carry
            b, m = memox.call(m, _Scaled.b)
            return (m, jnp.tanh(x @ (h * b * theta))), None

        (_, h), _ = scan(body, (m, jnp.ones_like(theta)), xs)
        return jnp.sum(h**2)

    return loss


def _grad_temp_bytes(loss, *args):
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_vjp_forwards_xs_as_lax_scan():
    # Issue 32: the hoisted loop read each `x` from `xs` by index, a new value that JAX
    # saved per step for the backward pass (a copy of `xs`), where `lax.scan` forwards
    # `xs` itself. (`tests/test_grad_memory.py` measures it at 12.5 MiB.)
    n, steps = 64, 16
    rng = np.random.default_rng(0)
    m = memox.init(_Scaled(jnp.asarray(rng.normal(size=n), jnp.float32)))
    theta = jnp.asarray(rng.normal(size=n), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(steps, n, n)) / n, jnp.float32)
    got = _grad_temp_bytes(_matrix_loss(memox.scan), theta, m, xs)
    assert got <= _grad_temp_bytes(_matrix_loss(lax.scan), theta, m, xs)
    assert got < xs.nbytes / 2
