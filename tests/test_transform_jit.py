"""`jax.jit`, `eqx.filter_jit` and `memox.jit` around `memox.call`: compiled once, fills
reach the caller through the returned module, a hit skips the computation at run time."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, foo

import memox


def _scaled_b(m, x):
    return m.b() * x


def _compile(wrapper, fn):
    """`fn(module, x)` run by `memox.call`, compiled by `wrapper`: `(module, x) -> (y, module)`."""
    if wrapper == "memox.jit":
        return memox.jit(fn)
    jit = jax.jit if wrapper == "jax.jit" else eqx.filter_jit
    return jit(lambda m, x: memox.call(m, fn, x))


def _counts(m):
    stats = memox.stats(m)["b_cache"]
    return stats.hits, stats.misses


WRAPPERS = ["jax.jit", "eqx.filter_jit", "memox.jit"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_fill_reaches_the_caller_and_traces_once(wrapper):
    c = Counter()
    traces = 0

    def fn(m, x):
        nonlocal traces
        traces += 1
        return _scaled_b(m, x)

    step = _compile(wrapper, fn)
    f = memox.init(foo(c))
    b = np.asarray(f.a).sum()
    for i in range(4):
        y, f = step(f, jnp.float32(i))
        assert y == b * i
    assert (traces, c.n) == (1, 1)
    assert _counts(f) == (3, 1)
    # The fill made inside the compiled function is the caller's: an eager call hits.
    _, f = memox.call(f, Foo.b)
    assert c.n == 1
    # A dependency change recomputes, without a retrace.
    f = eqx.tree_at(lambda t: t.a, f, f.a.at[1, 2].add(1.0))
    y, f = step(f, jnp.float32(2))
    assert y == 2 * (b + 1)
    _, f = step(f, jnp.float32(2))
    assert (traces, c.n) == (1, 2)
    assert _counts(f) == (5, 2)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_two_calls_in_one_trace_compute_once(wrapper):
    c = Counter()
    step = _compile(wrapper, lambda m, x: (m.b() * x, m.b() + x))
    (y1, y2), f = step(memox.init(foo(c)), jnp.float32(3))
    b = jnp.sum(f.a)
    np.testing.assert_array_equal(y1, 3 * b)
    np.testing.assert_array_equal(y2, b + 3)
    assert c.n == 1 and _counts(f) == (1, 1)


@pytest.mark.parametrize("wrapper", ["eqx.filter_jit", "memox.jit"])
def test_without_init(wrapper):
    # `memox.jit` allocates before it traces: one trace. `eqx.filter_jit` sees the empty
    # markers as static and the allocated slots it returns as arrays: two traces.
    c = Counter()
    traces = 0

    def fn(m, x):
        nonlocal traces
        traces += 1
        return _scaled_b(m, x)

    step = _compile(wrapper, fn)
    f = foo(c)
    for i in range(3):
        y, f = step(f, jnp.float32(i))
    np.testing.assert_array_equal(y, 2 * jnp.sum(f.a))
    assert c.n == 1
    assert traces == (1 if wrapper == "memox.jit" else 2)


def test_memox_jit_inside_jax_jit():
    c = Counter()
    traces = 0
    inner = memox.jit(_scaled_b)

    @jax.jit
    def outer(m, x):
        nonlocal traces
        traces += 1
        y, m = inner(m, x)
        z, m = inner(m, 2 * x)
        return y + z, m

    f = memox.init(foo(c))
    for _ in range(3):
        y, f = outer(f, jnp.float32(1))
    np.testing.assert_array_equal(y, 3 * jnp.sum(f.a))
    assert (traces, c.n) == (1, 1)
    assert _counts(f) == (5, 1)


def test_unallocated_module_under_jax_jit_is_refused():
    # An empty slot's markers are not arrays: `jax.jit` refuses them (memox.init first).
    with pytest.raises(TypeError, match=r"passed to the function at path m\.b_cache"):
        jax.jit(lambda m: memox.call(m, Foo.b))(foo(Counter()))


def test_unallocated_module_under_jax_jit_names_init():
    # JAX names only the type of the argument it refuses: the marker's type says what to do.
    with pytest.raises(TypeError, match=r"memox\.init"):
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


class Spectral(eqx.Module):
    """A graph Laplacian whose eigenbasis is cached, and a head."""

    laplacian: jax.Array
    head: jax.Array
    counter: Counter = eqx.field(static=True)
    eig_cache: memox.Memo[tuple[jax.Array, jax.Array]] = memox.Memo()

    @memox.cached("eig_cache")
    def basis(self):
        self.counter.tick()
        return jnp.linalg.eigh(self.laplacian)

    def __call__(self, x):
        _, vecs = self.basis()
        return jnp.tanh(x @ vecs) @ self.head


def _adam_loop(placement, trainable, steps=4):
    """The ordinary loop: `opt_state` made from the model as constructed (slots never
    allocated), a step taking and returning `(model, opt_state)`, `memox.call` inside
    `eqx.filter_value_and_grad`'s loss. Returns the losses, the traces of the step and the
    computations of the cached value."""
    import optax

    counter, traces = Counter(), []
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
        traces.append(None)
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
    return np.array(losses), len(traces), counter.n


@pytest.mark.parametrize("trainable", ["head", "all"])
@pytest.mark.parametrize("placement", ["memox.filter_jit", "memox.jit", "eqx.filter_jit"])
def test_adam_loop_unallocated_model_first_try(placement, trainable):
    # Regression (issue 21): `memox.filter_jit` allocated the `Memo` mirrors inside adam's
    # `mu`/`nu` too (`jnp.linalg.eigh` of `None`; with everything trainable, a pytree
    # structure error in `optax.update`).
    with jax.numpy_dtype_promotion("standard"):  # adam mixes int32 counts and floats
        expected, _, plain_runs = _adam_loop("unmemoized", trainable)
        losses, traces, runs = _adam_loop(placement, trainable)
    np.testing.assert_array_equal(losses, expected)
    assert traces == 1
    assert runs == (1 if trainable == "head" else plain_runs)
