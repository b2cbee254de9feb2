"""Slots in the containers JAX and checkpointers hand back: an empty slot whose markers came
back as 0-d arrays, and a value the method puts on another device than its slot's."""

import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, foo, run_on_devices

import memox
from memox import Memo


def _orbax_round_trip(m, tmp_path):
    ocp = pytest.importorskip(
        "orbax.checkpoint",
        reason="orbax-checkpoint is not installed (`pip install memox[checkpoint]`)",
    )
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "ckpt", m)
        ck.wait_until_finished()
    with ocp.StandardCheckpointer() as ck:
        return ck.restore(tmp_path / "ckpt", jax.eval_shape(lambda: m))  # the documented target


def _in_slots(f, m):
    """`m` with `f` applied to its slots' leaves only."""
    is_slot = lambda x: isinstance(x, Memo)  # noqa: E731
    return jax.tree.map(lambda x: jax.tree.map(f, x) if is_slot(x) else x, m, is_leaf=is_slot)


MARKERS = {
    "device_put": lambda m, _: jax.device_put(m),
    "jnp_asarray": lambda m, _: jax.tree.map(jnp.asarray, m),
    "np_asarray": lambda m, _: _in_slots(np.asarray, m),  # (0-d NumPy markers)
    "orbax_eval_shape": _orbax_round_trip,
}


def _step(how):
    if how == "call":
        return lambda m: memox.call(m, Foo.b)
    if how == "jit":
        return memox.jit(lambda m: m.b())
    return memox.filter_jit(lambda m: memox.call(m, Foo.b))


# Regression guard (issue 31 case 9): markers that came back as 0-d arrays were taken for
# an allocated slot by `memox.jit` and `memox.filter_jit` (which then raised "An empty
# `memox.Memo` slot reached memox through a trace"); eager `memox.call` worked.
@pytest.mark.parametrize("how", ["call", "jit", "filter_jit"])
@pytest.mark.parametrize("markers", list(MARKERS))
def test_empty_slot_with_0d_markers_fills_then_hits(markers, how, tmp_path):
    c = Counter()
    m = MARKERS[markers](foo(c), tmp_path)
    assert isinstance(m.b_cache.value, (jax.Array, np.ndarray)) and np.ndim(m.b_cache.value) == 0
    with c.paused():
        want = Foo.b.fn(m)  # the unmemoized method
    step = _step(how)
    for _ in range(3):
        b, m = step(m)
        np.testing.assert_array_equal(b, want)
    jax.effects_barrier()
    assert c.n == 1  # computed once, then two hits
    assert memox.stats(m)["b_cache"] == memox.SlotStats(hits=2, misses=1)


class Keyed(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    table: Memo[jax.Array] = Memo(size=2)

    @memox.cached("table")
    def scaled(self, s):
        self.counter.tick()
        return self.w * s


def _keyed_step(how):
    if how == "call":
        return lambda m, s: memox.call(m, Keyed.scaled, s)
    if how == "jit":
        return memox.jit(lambda m, s: m.scaled(s))
    return memox.filter_jit(lambda m, s: memox.call(m, Keyed.scaled, s))


# Regression guard (issue 31 case 9): a slot keyed by arguments is not allocated before
# the trace; with 0-d markers it was a traced argument, which cannot be allocated there.
@pytest.mark.parametrize("how", ["call", "jit", "filter_jit"])
@pytest.mark.parametrize("markers", list(MARKERS))
def test_empty_keyed_slot_with_0d_markers_fills_then_hits(markers, how, tmp_path):
    c = Counter()
    m = MARKERS[markers](Keyed(jnp.arange(3.0), c), tmp_path)
    step = _keyed_step(how)
    for s in (2.0, 3.0, 2.0, 3.0):
        y, m = step(m, jnp.asarray(s))
        with c.paused():
            np.testing.assert_array_equal(y, Keyed.scaled.fn(m, jnp.asarray(s)))
    jax.effects_barrier()
    assert c.n == 2
    assert memox.stats(m)["table"] == memox.SlotStats(hits=2, misses=2)


# Regression guard (issue 31 case 9): the lifecycle functions read the same rule.
@pytest.mark.parametrize("markers", ["device_put", "np_asarray"])
def test_lifecycle_of_an_empty_slot_with_0d_markers(markers, tmp_path):
    m = MARKERS[markers](foo(Counter()), tmp_path)
    assert not m.b_cache.allocated
    assert memox.stats(m)["b_cache"] == memox.SlotStats(hits=0, misses=0, flops=8)
    assert memox.init(m).b_cache.allocated
    assert not memox.clear(m).b_cache.allocated
    assert memox.strip(m).b_cache.value is Memo().value


# Regression guard (issue 31 case 9): a 0-d marker that is traced (through `jax.jit`, or a
# loop's carry) still cannot be allocated in place, and says to call `memox.init`.
@pytest.mark.parametrize("how", ["call", "jit"])
def test_traced_0d_markers_name_init(how):
    m = jax.device_put(foo(Counter()))
    step = jax.jit(_step(how))
    with pytest.raises(TypeError, match=r"Allocate it first with `module = memox.init\(module\)`"):
        step(m)

    def body(m, _):
        return memox.call(m, Foo.b)[1], None

    with pytest.raises(TypeError, match=r"Allocate it first with `module = memox.init\(module\)`"):
        jax.lax.scan(body, m, length=2)


# Issue 31 case 10: 2 CPU devices, in a subprocess (the device count is fixed when JAX
# starts; see test_sharding.py). Each check reports where the unmemoized method and the
# memoized one put the value, at the miss and at the hits, and where the slot stays.
CHILD = textwrap.dedent(
    r"""
    import json

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from helpers import Counter  # (the child runs in tests/)

    import memox
    from memox import Memo

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    d0, d1 = jax.devices()[:2]


    class Model(eqx.Module):
        a: jax.Array
        counter: Counter = eqx.field(static=True)
        c: Memo[jax.Array] = Memo()
        k: Memo[jax.Array] = Memo(size=2)
        t: Memo[tuple] = Memo()

        @memox.cached("c")
        def b(self):
            self.counter.tick()
            return jax.device_put(self.a * 2, d1)

        @memox.cached("k")
        def scaled(self, s):
            self.counter.tick()
            return jax.device_put(self.a * s, d1)

        @memox.cached("t")
        def pair(self):
            self.counter.tick()
            return jax.device_put(self.a + 1, d1), self.a - 1


    def devices(tree):
        return [sorted(d.id for d in x.devices()) for x in jax.tree.leaves(tree)]


    def slot_devices(m):
        return sorted({d.id for s in (m.c, m.k, m.t) for x in jax.tree.leaves(s)
                       for d in x.devices()})


    def check(placement, how):
        c = Counter()
        m = Model(jnp.arange(3.0), c)
        if placement == "init_then_d0":  # the slots' tables committed to device 0
            m = jax.device_put(memox.init(m, lambda m: m.scaled(2.0)), d0)
        elif placement == "d0":
            m = jax.device_put(m, d0)
        fns = [lambda m: m.b(), lambda m: m.scaled(2.0), lambda m: m.scaled(3.0),
               lambda m: m.scaled(2.0), lambda m: m.pair()]
        plain = [Model.b.fn, lambda m: Model.scaled.fn(m, 2.0), lambda m: Model.scaled.fn(m, 3.0),
                 lambda m: Model.scaled.fn(m, 2.0), Model.pair.fn]
        out = {"got": [], "want": [], "err": 0.0}
        for fn, ref in zip(fns, plain):
            for _ in range(2):  # a miss (the first time), then a hit
                if how == "call":
                    y, m = memox.call(m, fn)
                    with c.paused():
                        y0 = ref(m)
                else:
                    y, m = memox.jit(fn)(m)
                    with c.paused():
                        y0 = jax.jit(ref)(m)
                out["got"].append(devices(y))
                out["want"].append(devices(y0))
                out["err"] = max([out["err"]] + [
                    float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
                    for u, v in zip(jax.tree.leaves(y), jax.tree.leaves(y0))])
        jax.effects_barrier()
        out["runs"] = c.n
        out["stats"] = {k: [s.hits, s.misses] for k, s in memox.stats(m).items()}
        out["slots_on"] = slot_devices(m)
        return out


    results = {}
    for placement in ("default", "d0", "init_then_d0"):
        for how in ("call", "jit"):
            try:
                results[f"{placement}-{how}"] = check(placement, how)
            except Exception as e:  # reported, not raised: every check runs
                results[f"{placement}-{how}"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print("RESULT " + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def two_devices():
    return run_on_devices(CHILD, 2)


# Regression guard (issue 31 case 10): eagerly, storing a value the method put on device 1
# into a slot whose tables are committed to device 0 raised "Received incompatible
# devices". The value is now copied onto the slot's device for the store, and returned
# where the method put it, at the miss and at every later hit (keyed entries too); under
# `memox.jit` it is where `jax.jit` of the unmemoized method puts it.
@pytest.mark.parametrize("how", ["call", "jit"])
@pytest.mark.parametrize("placement", ["default", "d0", "init_then_d0"])
def test_value_on_another_device(two_devices, placement, how):
    part = two_devices[f"{placement}-{how}"]
    assert "error" not in part, part["error"]
    assert part["got"] == part["want"]
    if how == "call":
        assert [[1]] in part["got"]  # (the case under test: a value on device 1)
    assert part["err"] == 0.0
    # b: miss, hit; scaled: 2.0 miss, hit, 3.0 miss, hit, 2.0 hit, hit; pair: miss, hit.
    assert part["runs"] == 4
    assert part["stats"] == {"c": [1, 1], "k": [4, 2], "t": [1, 1]}
    assert part["slots_on"] == [0]  # the slots stay on the module's device
