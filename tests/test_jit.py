"""`jax.jit`, `eqx.filter_jit` and `memox.jit` around `memox.call`: compiled once, fills
reach the caller through the returned module, a hit skips the computation at run time;
`memox.jit`'s own guarantees: no copies across the boundary (its donation, which leaves
every array the caller holds usable: test_donation.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, Spectral, Traces, foo, hits_and_misses, reference

import memox
from memox import Memo


def _scaled_b(m, x):
    return m.b() * x


def _compile(wrapper, fn):
    """`fn(module, x)` run by `memox.call`, compiled by `wrapper`: `(module, x) -> (y, module)`."""
    if wrapper == "memox.jit":
        return memox.jit(fn)
    jit = jax.jit if wrapper == "jax.jit" else eqx.filter_jit
    return jit(lambda m, x: memox.call(m, fn, x))


WRAPPERS = ["jax.jit", "eqx.filter_jit", "memox.jit"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_fill_reaches_the_caller_and_traces_once(wrapper):
    c = Counter()
    traces = Traces()

    def fn(m, x):
        traces.tick()
        return _scaled_b(m, x)

    step = _compile(wrapper, fn)
    f = memox.init(foo(c))
    b = np.asarray(f.a).sum()
    for i in range(4):
        y, f = step(f, jnp.float32(i))
        assert y == b * i
    # `memox.jit` compiles a second program once the host knows the slot hits (the
    # unchanged `f.a`): its read has no check (`_decided.Hits`).
    programs = 2 if wrapper == "memox.jit" else 1
    assert (traces.n, c.n) == (programs, 1)
    assert hits_and_misses(f) == (3, 1)
    # The fill made inside the compiled function is the caller's: an eager call hits.
    _, f = memox.call(f, Foo.b)
    assert c.n == 1
    # A dependency change recomputes, without a retrace.
    f = eqx.tree_at(lambda t: t.a, f, f.a.at[1, 2].add(1.0))
    y, f = step(f, jnp.float32(2))
    assert y == 2 * (b + 1)
    _, f = step(f, jnp.float32(2))
    assert (traces.n, c.n) == (programs, 2)
    assert hits_and_misses(f) == (5, 2)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_two_calls_in_one_trace_compute_once(wrapper):
    c = Counter()
    step = _compile(wrapper, lambda m, x: (m.b() * x, m.b() + x))
    (y1, y2), f = step(memox.init(foo(c)), jnp.float32(3))
    b = jnp.sum(f.a)
    np.testing.assert_array_equal(y1, 3 * b)
    np.testing.assert_array_equal(y2, b + 3)
    assert c.n == 1 and hits_and_misses(f) == (1, 1)


@pytest.mark.parametrize("wrapper", ["eqx.filter_jit", "memox.jit"])
def test_without_init(wrapper):
    # `memox.jit` allocates before it traces: one trace, and one more for the program
    # reading the slot with no check once the host knows it hits. `eqx.filter_jit` sees
    # the empty markers as static and the allocated slots it returns as arrays: two
    # traces.
    c = Counter()
    traces = Traces()

    def fn(m, x):
        traces.tick()
        return _scaled_b(m, x)

    step = _compile(wrapper, fn)
    f = foo(c)
    for i in range(3):
        y, f = step(f, jnp.float32(i))
    np.testing.assert_array_equal(y, 2 * jnp.sum(f.a))
    assert c.n == 1 and hits_and_misses(f) == (2, 1)
    assert traces.n == 2


def test_memox_jit_inside_jax_jit():
    c = Counter()
    traces = Traces()
    inner = memox.jit(_scaled_b)

    @jax.jit
    def outer(m, x):
        traces.tick()
        y, m = inner(m, x)
        z, m = inner(m, 2 * x)
        return y + z, m

    f = memox.init(foo(c))
    for _ in range(3):
        y, f = outer(f, jnp.float32(1))
    np.testing.assert_array_equal(y, 3 * jnp.sum(f.a))
    assert (traces.n, c.n) == (1, 1)
    assert hits_and_misses(f) == (5, 1)


def test_unallocated_module_under_jax_jit_names_init():
    # An empty slot passed to `jax.jit` is a traced 0-d integer: memox cannot allocate it
    # there without changing its type, and says what to do.
    with pytest.raises(TypeError, match=r"Allocate it first with `module = memox.init\(module\)`"):
        jax.jit(lambda m: memox.call(m, Foo.b))(foo(Counter()))


def test_hit_inside_jit_opened_inside_call_is_refused_and_the_advice_works():
    # Even a hit updates the slot (its counters) from inside the inner trace: refused.
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)
    with pytest.raises(ValueError, match=r"or read the value before it"):
        memox.call(f, lambda m: jax.jit(lambda: m.b())())

    def read_first(m):
        b = m.b()
        return jax.jit(lambda b: 2 * b)(b)

    y, f = memox.call(f, read_first)
    assert y == 2 * jnp.sum(f.a) and c.n == 1


def test_fill_inside_jit_opened_inside_call_is_refused():
    # The fill belongs to the inner trace: it cannot be written back to the module.
    f = memox.init(foo(Counter()))
    with pytest.raises(
        ValueError, match=r"`Foo.b` updates slot `b_cache` with values that belong to a JAX"
    ):
        memox.call(f, lambda m: jax.jit(lambda: m.b())())


# -- the ordinary Equinox + optax loop, every documented placement ----------------------


def _adam_loop(placement, trainable, steps=4):
    """The ordinary loop: `opt_state` made from the model as constructed (slots never
    allocated), a step taking and returning `(model, opt_state)`, `memox.call` inside
    `eqx.filter_value_and_grad`'s loss. Returns the losses, the traces of the step and the
    computations of the cached value."""
    import optax

    counter, traces = Counter(), Traces()
    a = jax.random.normal(jax.random.key(0), (6, 6))
    model = Spectral(a @ a.T, jnp.ones(6) / 6, counter)
    x = jax.random.normal(jax.random.key(1), (8, 6))
    y = jnp.sin(jnp.arange(8.0))
    if trainable == "head":  # the Laplacian frozen: computed once
        spec = eqx.tree_at(lambda m: m.head, jax.tree.map(lambda _: False, model), True)
    else:  # everything trains: computed at every step
        spec = eqx.is_inexact_array
    opt = optax.adam(1e-2)
    opt_state = opt.init(eqx.filter(model, spec))  # `Memo` mirrors with `None` leaves

    def loss(diff, static):
        model = eqx.combine(diff, static)
        if placement == "unmemoized":
            return jnp.mean((jax.vmap(model)(x) - y) ** 2), model
        pred, model = memox.call(model, lambda m: jax.vmap(m)(x))
        return jnp.mean((pred - y) ** 2), model

    def step(model, opt_state):
        traces.tick()
        diff, static = eqx.partition(model, spec)
        (value, model), grads = eqx.filter_value_and_grad(loss, has_aux=True)(diff, static)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, spec))
        return eqx.apply_updates(model, updates), opt_state, value

    if placement == "memox.filter_jit":
        step = memox.filter_jit(step)
    elif placement == "memox.jit":
        compiled = memox.jit(step)
        step = lambda model, opt_state: compiled(model, opt_state)[0]  # noqa: E731
    else:  # `eqx.filter_jit` (and the unmemoized loop): `memox.init` first, the rule
        model = memox.init(model)
        step = eqx.filter_jit(step)
    losses = []
    for _ in range(steps):
        model, opt_state, value = step(model, opt_state)
        losses.append(value)
    jax.effects_barrier()
    return np.array(losses), traces.n, counter.n


@pytest.mark.parametrize("trainable", ["head", "all"])
@pytest.mark.parametrize("placement", ["memox.filter_jit", "memox.jit", "eqx.filter_jit"])
def test_adam_loop_unallocated_model_first_try(placement, trainable):
    # Regression (issue 21): `memox.filter_jit` allocated the `Memo` mirrors inside adam's
    # `mu`/`nu` too (`jnp.linalg.eigh` of `None`; with everything trainable, a pytree
    # structure error in `optax.update`).
    with jax.numpy_dtype_promotion("standard"):  # adam mixes int32 counts and floats
        with reference():
            expected, _, plain_runs = _adam_loop("unmemoized", trainable)
        losses, traces, runs = _adam_loop(placement, trainable)
    np.testing.assert_array_equal(losses, expected)
    assert traces == 1
    assert runs == (1 if trainable == "head" else plain_runs)


# -- `memox.jit`: what crosses the boundary ---------------------------------------------


def test_unchanged_leaves_are_the_callers_arrays():
    c = Counter()
    f = foo(c)
    use_b = memox.jit(lambda t: t.b())
    _, f1 = use_b(f)
    _, f2 = use_b(f1)
    assert f2.a is f.a  # the parameter never crossed the jit boundary
    assert memox.stats(f2)["b_cache"].hits == 1  # the slot did (hit counted)
    # The module passed in was given the returned slot (its own was donated).
    assert f1.b_cache.value is f2.b_cache.value and f1.b_cache.counts is f2.b_cache.counts


class Two(eqx.Module):
    a: jax.Array
    counter: Counter = eqx.field(static=True)
    first: Memo[jax.Array] = Memo()
    second: Memo[jax.Array] = Memo()

    @memox.cached("first")
    def one(self):
        self.counter.tick()
        return self.a + 1

    @memox.cached("second")
    def two(self):
        return self.a + 2


def test_untouched_slots_pass_through_and_the_module_passed_in_stays_usable():
    c = Counter()
    m = Two(jnp.ones(3), c)
    _, m1 = memox.call(m, Two.two)
    stored = jnp.array(m1.second.value)
    _, m2 = memox.jit(Two.one)(m1)
    assert m2.a is m1.a  # parameters never cross the boundary
    assert jnp.array_equal(m2.second.value, stored)  # an untouched slot keeps its value
    # The slots of m1 were donated to m2, and m1 was given m2's: calling on m1 again
    # hits (its parameters are those the slot was filled for), without a warning.
    assert not m1.second.value.is_deleted() and not m1.first.value.is_deleted()
    _, m3 = memox.jit(Two.one)(m1)
    assert c.n == 1 and jnp.array_equal(m3.first.value, m2.first.value)


def test_without_donation_the_old_module_keeps_its_slots():
    c = Counter()
    m = Two(jnp.ones(3), c)
    step = memox.jit(Two.one, donate=False)
    _, m1 = step(m)
    _, m2 = step(m1)
    _, m3 = step(m1)  # the old module still holds its filled slot: a hit
    assert c.n == 1 and not m1.first.value.is_deleted()
    assert m3.second.value is m1.second.value  # an untouched slot is not even returned


def test_result_and_module_match_call():
    c = Counter()
    f = foo(c)
    b_call, f_call = memox.call(f, Foo.b)
    b_jit, f_jit = memox.jit(Foo.b)(f)
    assert b_call == b_jit
    assert jax.tree.structure(f_call) == jax.tree.structure(f_jit)
    assert memox.stats(f_call) == memox.stats(f_jit)


def test_keyword_and_static_arguments():
    c = Counter()
    traces = Traces()

    def fn(f, x, *, power):
        traces.tick(power)
        return f.b() * x**power

    step = memox.jit(fn)
    f = foo(c)
    y, f = step(f, jnp.float32(2), power=2)
    y, f = step(f, jnp.float32(3), power=2)
    assert y == 9 * jnp.sum(f.a)
    y, f = step(f, jnp.float32(3), power=3)  # a static argument: retraces
    # (the second trace: the program for the hit decided on the host)
    assert traces.seen == [2, 2, 3] and c.n == 1


def test_non_array_results_come_back_as_they_were():
    c = Counter()
    step = memox.jit(lambda f, x: {"b": f.b() * x, "label": "b times x", "n": 3, "none": None})
    out, f = step(foo(c), jnp.float32(2))
    assert (out["label"], out["n"], out["none"]) == ("b times x", 3, None)
    assert out["b"] == 2 * jnp.sum(f.a)
    out, f = step(f, jnp.float32(2))
    assert out["label"] == "b times x" and c.n == 1


def test_unchanged_dependencies_are_fingerprinted_outside_once(monkeypatch):
    from memox import _prehash
    from memox._fingerprint import known

    monkeypatch.setattr(_prehash, "PREHASH_MIN_BYTES", 0)  # (this test's arrays are small)
    c = Counter()
    step = memox.jit(lambda f: f.b())
    f = foo(c)
    for _ in range(3):
        _, f = step(f)
    # Seen unchanged twice: fingerprinted once outside the compiled code, by identity.
    assert id(f.a) in known._entries and known._entries[id(f.a)][2] is not None
    # A new array with the same values is not trusted by identity: hashed in-graph, a hit.
    f = eqx.tree_at(lambda t: t.a, f, jnp.array(f.a))
    _, f = step(f)
    assert c.n == 1
    # Different values: a miss, whatever was fingerprinted before.
    f = eqx.tree_at(lambda t: t.a, f, f.a.at[0, 0].add(1.0))
    for _ in range(3):
        y, f = step(f)
    assert c.n == 2 and y == jnp.sum(f.a)


# -- `memox.jit` after a donation it did not make ---------------------------------------


def test_slots_deleted_by_a_donation_elsewhere_recompute_with_a_hint():
    # Only a donation the user asks for (`jax.jit`'s `donate_argnums`, a `donate=` option)
    # deletes a slot's arrays; memox then recomputes and says why.
    c = Counter()
    _, f = memox.call(foo(c), Foo.b)
    jax.jit(lambda s: s, donate_argnums=0)(f.b_cache)
    with pytest.warns(
        UserWarning, match=r"slots b_cache were deleted: donated by a call you asked"
    ):
        b, f = memox.jit(Foo.b)(f)
    assert c.n == 2 and b == jnp.sum(f.a)


# -- `memox.jit`'s forms: `memox.jit(fn)`, `memox.jit(fn, donate=...)`, and as a decorator --
#
# Issue 22: `@memox.jit(donate=False)` (a decorator factory, as `memox.filter_jit(donate=...)`
# is) raised, `fn` being required.


def _donated(step) -> bool:
    """Whether `step`, a `memox.jit` of a function `(Two, x)` that fills `first`,
    donates: the caller's array of an untouched slot comes back as itself only without
    donation (with it, a copy is donated, since the caller holds it)."""
    m = memox.call(Two(jnp.ones(3), Counter()), Two.two)[1]
    before = m.second.value
    _, m = step(m, jnp.float32(1))
    return m.second.value is not before


def _forms(fn):
    @memox.jit
    def bare(m, x):
        return fn(m, x)

    @memox.jit(donate=False)
    def without_donation(m, x):
        return fn(m, x)

    @memox.jit()
    def empty_call(m, x):
        return fn(m, x)

    return {
        "memox.jit(fn)": (memox.jit(fn), True),
        "memox.jit(fn, donate=False)": (memox.jit(fn, donate=False), False),
        "memox.jit(fn, donate=True)": (memox.jit(fn, donate=True), True),
        "@memox.jit": (bare, True),
        "@memox.jit(donate=False)": (without_donation, False),
        "@memox.jit()": (empty_call, True),
        "memox.jit(donate=False)(fn)": (memox.jit(donate=False)(fn), False),
    }


FORMS = list(_forms(lambda m, x: x))


@pytest.mark.parametrize("form", FORMS)
def test_every_form_compiles_once_and_computes_once(form):
    c = Counter()
    traces = Traces()

    def fn(m, x):
        traces.tick()
        return m.one() * x

    step, donate = _forms(fn)[form]
    m = Two(jnp.arange(3.0), c)
    for i in range(4):
        y, m = step(m, jnp.float32(i))
        np.testing.assert_array_equal(y, (jnp.arange(3.0) + 1) * i)
    # Two programs (the second: the hit decided on the host), one computation.
    assert (traces.n, c.n) == (2, 1)
    assert memox.stats(m)["first"] == memox.SlotStats(hits=3, misses=1)
    assert callable(step.lower)  # pyright: ignore[reportFunctionMemberAccess]
    # `donate=` is honoured in every form.
    assert _donated(_forms(lambda m, x: m.one())[form][0]) is donate


def test_the_decorated_function_keeps_its_name():
    @memox.jit(donate=False)
    def step(m):
        """Doc."""
        return m.one()

    assert (step.__name__, step.__doc__) == ("step", "Doc.")


class _Stepping(Two):
    @memox.jit
    def step(self, x):
        return self.one() * x


def test_as_a_method_it_receives_its_instance_as_the_module():
    c = Counter()
    m = _Stepping(jnp.arange(3.0), c)
    for i in range(3):
        y, m = m.step(jnp.float32(i))
        np.testing.assert_array_equal(y, (jnp.arange(3.0) + 1) * i)
    assert c.n == 1
    assert memox.stats(m)["first"] == memox.SlotStats(hits=2, misses=1)


class _Named(eqx.Module):
    donate: bool = True
    lower: int = 0

    def __call__(self, m, x):
        return m.one() * x


def test_a_callable_s_own_fields_do_not_replace_the_wrappers():
    # A callable module whose fields share names with the wrapper's attributes.
    step = memox.jit(_Named(), donate=False)
    assert callable(step.lower)  # pyright: ignore[reportAttributeAccessIssue]
    assert _donated(step) is False
    assert _donated(memox.jit(_Named(donate=False))) is True
