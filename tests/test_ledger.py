"""The accounting (memox/_ledger.py): every evaluation of a cached method inside memox
ends as a hit, a store that reaches what the call returns, or an `UncachedWarning`
(issue 18, items 7-10). Each test counts real executions and checks the warning."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PLACEMENTS, Counter, call_in

import memox
from memox import Memo


class Rot(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    c: Memo[jax.Array] = Memo()

    @memox.cached("c")
    def q(self):
        self.counter.tick()
        return jnp.tanh(self.w - self.w.T)

    def __call__(self, t, y, args):  # a diffrax vector field
        return self.q() @ y


def _rot(counter):
    return Rot(jnp.eye(3, dtype=jnp.float32) * 0.1 + jnp.arange(9.0).reshape(3, 3) / 50, counter)


def _silent():
    """No warning at all may escape (pyproject turns warnings into errors)."""
    return warnings.catch_warnings()


# -- stores that do not reach the caller -----------------------------------------------


@pytest.mark.parametrize("wrapper", ["eager", "memox.jit", "jax.jit"])
def test_a_call_in_a_while_loop_condition_is_reported(wrapper):
    # Regression: a cached method read through `memox.call` in a `while_loop` condition
    # ran at every test, 0 hits and 0 misses, no warning: a condition returns only its
    # predicate, so what the nested call stores is dropped.
    counter = Counter()

    def loop(m):
        def cond(c):
            value, _ = memox.call(c[0], Rot.q)
            return (jnp.sum(value) < 100.0) & (c[1] < 3)

        def body(c):
            return c[0], c[1] + 1

        return jax.lax.while_loop(cond, body, (m, 0))[1]

    model = memox.init(_rot(counter))
    step = {
        "eager": lambda m: memox.call(m, loop),
        "memox.jit": memox.jit(loop),
        "jax.jit": jax.jit(lambda m: memox.call(m, loop)),
    }[wrapper]
    with pytest.warns(memox.UncachedWarning, match="the value is dropped"):
        n, _ = step(model)
    jax.effects_barrier()
    assert int(n) == 3 and counter.n == 4  # computed at every test: and said so


@pytest.mark.parametrize("wrapper", ["memox.jit", "eqx.filter_jit"])
def test_a_vector_field_reading_a_filled_slot_in_a_reused_solve_is_reported(wrapper):
    # Regression: with the slot filled beforehand and diffrax's compiled solve reused
    # from JAX's cache (no Python ran inside it), the field computed at every evaluation
    # (601 per solve) without a word. The staged program holds the marker.
    diffrax = pytest.importorskip("diffrax")
    counter = Counter()
    model = _rot(counter)
    _, model = memox.call(model, Rot.q)

    def solve(m, y0):
        term = diffrax.ODETerm(m)
        sol = diffrax.diffeqsolve(term, diffrax.Euler(), 0.0, 0.2, 0.05, y0)
        return jnp.sum(sol.ys)

    # Compile the solve once, warned, then again in a fresh wrapper: JAX reuses it.
    # (diffrax 0.7.2 itself trips JAX's leak checker: a plain `diffeqsolve` does.)
    with jax.check_tracer_leaks(False):
        with pytest.warns(memox.UncachedWarning):
            memox.call(model, solve, jnp.ones(3))
        if wrapper == "memox.jit":
            step = memox.jit(solve)
        else:
            step = eqx.filter_jit(lambda m, y: memox.call(m, solve, y))
        with pytest.warns(memox.UncachedWarning, match="computes without its slot"):
            step(model, jnp.ones(3))


def test_a_returned_store_is_silent():
    # The module as a loop's carry: every store reaches the caller; nothing to say.
    counter = Counter()

    def loop(m, xs):
        def body(m, x):
            value, m = memox.call(m, Rot.q)
            return m, jnp.sum(value) * x

        return jax.lax.scan(body, m, xs)

    model = memox.init(_rot(counter))
    with _silent():
        warnings.simplefilter("error")
        (model, ys), _ = memox.jit(loop)(model, jnp.arange(4.0))
    jax.effects_barrier()
    assert counter.n == 1 and ys.shape == (4,)


# -- calls under a batched predicate ---------------------------------------------------


def test_a_batched_predicate_counts_misses_and_says_so():
    # Regression: `eqx.filter_vmap(memox.call)` over batched modules ran the method on
    # every call (both `cond` branches) while `memox.stats` reported hits.
    counter = Counter()
    batch = eqx.filter_vmap(lambda w: memox.init(Rot(w, counter)))(
        jnp.stack([jnp.eye(3), 2 * jnp.eye(3)])
    )
    call = eqx.filter_vmap(lambda m: memox.call(m, Rot.q))
    for _ in range(2):
        with pytest.warns(memox.UncachedWarning, match="batched"):
            values, batch = call(batch)
    expected = jax.vmap(lambda w: jnp.tanh(w - w.T))(batch.w)
    np.testing.assert_allclose(np.asarray(values), np.asarray(expected), rtol=1e-6)
    stats = memox.stats(batch)["c"]
    assert np.all(np.asarray(stats.hits) == 0) and np.all(np.asarray(stats.misses) == 2)


def test_an_unbatched_predicate_under_vmap_still_hits():
    counter = Counter()
    model = memox.init(_rot(counter))
    _, model = memox.call(model, Rot.q)
    with _silent():
        warnings.simplefilter("error")
        values, _ = jax.vmap(lambda x: memox.call(model, lambda m: m.q() @ x))(jnp.ones((4, 3)))
    jax.effects_barrier()
    assert counter.n == 1 and values.shape == (4, 3)


# -- invalidate and clear inside fn ---------------------------------------------------


class Held(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    c: Memo[jax.Array] = Memo()

    @memox.cached("c", policy=memox.policies.Manual())
    def q(self):
        self.counter.tick()
        return 2.0 * self.w


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "refresh", [lambda m: memox.invalidate(m, Held.q), memox.clear], ids=["invalidate", "clear"]
)
def test_invalidate_and_clear_inside_fn_take_effect(placement, refresh):
    # Regression: inside `fn` they were ignored; with `Manual` the old value came back.
    counter = Counter()
    module = memox.init(Held(jnp.ones(2), counter))
    _, module = call_in(placement, module, Held.q)
    moved = eqx.tree_at(lambda m: m.w, module, 3 * jnp.ones(2))  # Manual: still a hit
    value, moved = call_in(placement, moved, Held.q)
    jax.effects_barrier()
    assert counter.n == 1 and np.allclose(value, 2.0)
    value, moved = call_in(placement, moved, lambda m: refresh(m).q())
    jax.effects_barrier()
    assert counter.n == 2 and np.allclose(value, 6.0)
    value, moved = call_in(placement, moved, Held.q)  # the refreshed value reached the caller
    jax.effects_barrier()
    assert counter.n == 2 and np.allclose(value, 6.0)


# -- a cached method under a memox wrapper but outside memox.call -----------------------


def test_a_method_in_memox_filter_jit_without_memox_call_warns():
    counter = Counter()
    model = memox.init(_rot(counter))
    step = memox.filter_jit(lambda m: jnp.sum(m.q()))
    with pytest.warns(memox.UncachedWarning, match="outside `memox.call`"):
        step(model)


# -- a nested store under a transformation opened in fn ---------------------------------

TRANSFORMS = ["vmap", "grad", "jvp", "checkpoint", "cond"]


def _under(transform, passed_on):
    """`fn(m, x)` that opens `transform`, inside which a nested `memox.call` fills `m`'s
    slot; `fn` returns the module that call returned (`passed_on`) or drops it."""

    def inner(m, x):
        value, m = memox.call(m, Rot.q)
        return jnp.sum(value) * x, m

    def fn(m, x):
        if transform == "vmap":
            ys, m = jax.vmap(lambda x: inner(m, x), out_axes=(0, None))(jnp.stack([x, x]))
            y = jnp.sum(ys)
        elif transform == "grad":
            y, m = jax.grad(lambda x: inner(m, x), has_aux=True)(x)
        elif transform == "jvp":
            (y, m), _ = jax.jvp(lambda x: inner(m, x), (x,), (x,))
        elif transform == "checkpoint":
            y, m = jax.checkpoint(lambda x: inner(m, x))(x)
        else:
            y, m = jax.lax.cond(x > 0, lambda x: inner(m, x), lambda x: inner(m, -x), x)
        return y, m if passed_on else None

    return fn


def _wrapped(wrapper, fn):
    if wrapper == "memox.jit":
        return memox.jit(fn)
    if wrapper == "memox.filter_jit":
        return memox.filter_jit(lambda m, x: memox.call(m, fn, x))
    return jax.jit(lambda m, x: memox.call(m, fn, x))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("wrapper", ["memox.jit", "memox.filter_jit", "jax.jit"])
def test_a_dropped_store_under_a_transformation_is_reported(wrapper, transform):
    # Regression (issue 31 case 6): the ledger looked for its markers by their rendered
    # names (`memox_read_3`), which a transformation re-stages as `vmap(memox_read_3)`,
    # `jvp(...)`, `transpose(jvp(...))`: under `vmap`, `grad` or `jvp`, a dropped store
    # recomputed at every call without a word.
    counter = Counter()
    model = memox.init(_rot(counter))
    step = _wrapped(wrapper, _under(transform, passed_on=False))
    with pytest.warns(memox.UncachedWarning, match="the value is dropped"):
        step(model, jnp.float32(1.0))
    with warnings.catch_warnings():  # (the program is reused: said once, at its trace)
        warnings.simplefilter("ignore")
        step(model, jnp.float32(1.0))
    jax.effects_barrier()
    assert counter.n == 2  # computed at every call: and said so


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("wrapper", ["memox.jit", "memox.filter_jit", "jax.jit"])
def test_a_store_passed_on_under_a_transformation_is_silent(wrapper, transform):
    # (issue 31 case 6) The same, with the nested call's module returned: a hit next time.
    counter = Counter()
    model = memox.init(_rot(counter))
    step = _wrapped(wrapper, _under(transform, passed_on=True))
    with _silent():
        warnings.simplefilter("error")
        for _ in range(3):
            (_, model), _ = step(model, jnp.float32(1.0))
    jax.effects_barrier()
    assert counter.n == 1
