"""`memox.jit`: compiled once, hits inside, and no copies across the boundary."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import Counter, Foo, foo

import memox
from memox import Memo


def test_canonical_loop_traces_once_without_init():
    c = Counter()
    traces = []

    def step(f, x):
        traces.append(None)
        return f.b() * x

    step = memox.jit(step)
    f = foo(c)  # never init-ed: memox.jit allocates before it traces
    for i in range(4):
        y, f = step(f, jnp.float32(i))
    assert len(traces) == 1
    assert c.n == 1
    assert y == 3 * jnp.sum(f.a)
    assert memox.stats(f)["b_cache"] == memox.SlotStats(hits=3, misses=1)


def test_dependency_change_recomputes_without_retrace():
    c = Counter()
    traces = []

    def b(f):
        traces.append(None)
        return f.b()

    step = memox.jit(b)
    f = foo(c)
    _, f = step(f)
    f = eqx.tree_at(lambda t: t.a, f, f.a.at[0, 0].add(1.0))
    out, f = step(f)
    assert out == jnp.sum(f.a)
    assert (c.n, len(traces)) == (2, 1)


def test_unchanged_leaves_are_the_callers_arrays():
    c = Counter()
    f = foo(c)
    use_b = memox.jit(lambda t: t.b())
    _, f1 = use_b(f)
    _, f2 = use_b(f1)
    assert f2.a is f.a  # the parameter never crossed the jit boundary
    assert memox.stats(f2)["b_cache"].hits == 1  # the slot did (hit counted)
    # The module passed in was given the returned slot (its own was donated).
    assert f1.b_cache.value is f2.b_cache.value and f1.b_cache.hits is f2.b_cache.hits


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
    traces = []

    def fn(f, x, *, power):
        traces.append(power)
        return f.b() * x**power

    step = memox.jit(fn)
    f = foo(c)
    y, f = step(f, jnp.float32(2), power=2)
    y, f = step(f, jnp.float32(3), power=2)
    assert y == 9 * jnp.sum(f.a)
    y, f = step(f, jnp.float32(3), power=3)  # a static argument: retraces
    assert traces == [2, 3] and c.n == 1


def test_non_array_results_come_back_as_they_were():
    c = Counter()
    step = memox.jit(lambda f, x: {"b": f.b() * x, "label": "b times x", "n": 3, "none": None})
    out, f = step(foo(c), jnp.float32(2))
    assert (out["label"], out["n"], out["none"]) == ("b times x", 3, None)
    assert out["b"] == 2 * jnp.sum(f.a)
    out, f = step(f, jnp.float32(2))
    assert out["label"] == "b times x" and c.n == 1


def test_unchanged_dependencies_are_fingerprinted_outside_once():
    from memox._fingerprint import known

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


# -- nothing the caller holds loses its arrays (issue 18) --------------------------------


def _usable(tree, tmp_path):
    """Everything a user does with a module they kept works: serialise, fetch, compile."""
    eqx.tree_serialise_leaves(tmp_path / "kept.eqx", tree)
    jax.device_get(tree)
    return eqx.filter_jit(lambda t: jax.tree.map(jnp.copy, eqx.filter(t, eqx.is_array)))(tree)


def test_a_module_kept_across_steps_stays_usable(tmp_path):
    # Regression: an early-stopping `best = model` lost its slot buffers to the next
    # `memox.jit` step (donated): serialising, `jax.device_get` and `eqx.filter_jit` of
    # it raised JAX's "Array has been deleted".
    c = Counter()
    step = memox.jit(lambda f, x: f.b() * x)
    f = foo(c)
    _, f = step(f, jnp.float32(1))
    best = f
    for i in range(3):
        _, f = step(f, jnp.float32(i))
        f = eqx.tree_at(lambda t: t.a, f, f.a + 1.0)  # the parameters move: recomputes
    _usable(best, tmp_path)
    assert not any(x.is_deleted() for x in jax.tree.leaves(best))
    jax.effects_barrier()
    assert c.n == 3  # one computation per parameter value
    # Its slot is the one the step after it left: filled for its parameters, a hit.
    b, best2 = memox.call(best, Foo.b)  # no warning (pytest: warnings are errors)
    jax.effects_barrier()
    assert b == jnp.sum(best.a) and best2.a is best.a and c.n == 3


def test_the_module_passed_in_stays_usable_and_keeps_what_the_call_stored(tmp_path):
    c = Counter()
    step = memox.jit(Foo.b)
    f = memox.init(foo(c))
    b1, g = step(f)  # f, not threaded: it still works, and holds the value computed
    b2, h = step(f)
    assert c.n == 1 and b1 == b2 == jnp.sum(f.a)
    _usable(f, tmp_path)
    _usable(g, tmp_path)
    _, h = step(h)
    assert c.n == 1 and memox.stats(h)["b_cache"].hits == 2


@pytest.mark.parametrize("holder", ["leaves", "tree_map", "the slot", "the value"])
def test_arrays_held_elsewhere_are_not_donated(holder, tmp_path):
    c = Counter()
    step = memox.jit(Foo.b)
    _, f = step(foo(c))
    kept = {
        "leaves": lambda: jax.tree.leaves(f),
        "tree_map": lambda: jax.tree.map(lambda x: x, f),  # new nodes, the same arrays
        "the slot": lambda: f.b_cache,
        "the value": lambda: [f.b_cache.value],
    }[holder]()
    for _ in range(2):
        _, f = step(f)
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
    _usable(kept, tmp_path)
    assert c.n == 1


@jax.tree_util.register_pytree_node_class
class Checked:
    """A pytree node that checks its leaves: `memox.jit` cannot rebuild the module from
    placeholders, and finds its slots node by node (the general path)."""

    def __init__(self, x):
        if not isinstance(x, jax.Array):
            raise TypeError("an array, please")
        self.x = x

    def tree_flatten(self):
        return (self.x,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class Holder(eqx.Module):
    extra: jax.Array | Checked
    f: Foo


@pytest.mark.parametrize("extra", ["array", "node that checks its leaves"])
def test_a_hit_in_the_threaded_loop_copies_no_table(extra):
    # The threaded loop donates the slot's buffers: the table stays where it is (a hit
    # copies nothing), also after the one step that copies because an old module was kept.
    c = Counter()
    step = memox.jit(lambda h, x: h.f.b() * x)
    h = Holder(jnp.ones(2) if extra == "array" else Checked(jnp.ones(2)), foo(c))
    _, h = step(h, jnp.float32(1))
    pointer = h.f.b_cache.value.unsafe_buffer_pointer()
    for i in range(3):
        _, h = step(h, jnp.float32(i))
        assert h.f.b_cache.value.unsafe_buffer_pointer() == pointer
    best = h  # kept: the next step leaves it readable (one copy), then donates again
    _, h = step(h, jnp.float32(1))
    _, h = step(h, jnp.float32(2))
    pointer = h.f.b_cache.value.unsafe_buffer_pointer()
    for i in range(3):
        _, h = step(h, jnp.float32(i))
        assert h.f.b_cache.value.unsafe_buffer_pointer() == pointer
    assert not any(x.is_deleted() for x in jax.tree.leaves(best)) and c.n == 1


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
