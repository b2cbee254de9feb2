"""Differential fuzzing: random op sequences, each result compared with the same
sequence run without memox. No sequence may serve a stale value or a wrong gradient.

CI runs `MEMOX_FUZZ_EXAMPLES` sequences (default 200) under the leak checker; the
nightly size is

    MEMOX_FUZZ_EXAMPLES=10000 MEMOX_CHECK_LEAKS=0 python -m pytest -m heavy tests/test_fuzz.py

(the leak checker disables JAX's cache of compiled primitives: eager ops would compile
every time).
"""

import dataclasses
import functools
import io
import os
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import memox
from memox import Memo


EXAMPLES = int(os.environ.get("MEMOX_FUZZ_EXAMPLES", "200"))


@dataclasses.dataclass(frozen=True)
class Config:
    """A static part whose instances can differ where their `repr`s do not."""

    scale: float = 1.0
    shift: float = dataclasses.field(default=0.0, repr=False)


def _scaled_by(k):
    return lambda x: k * x


def _sin(x):
    return jnp.sin(x)


def _tanh(x):
    return jnp.tanh(x)


# Plain functions: Equinox takes a jitted one (`jnp.sin`) in a static field for an array.
ACTIVATIONS = {
    "sin": _sin,
    "tanh": _tanh,
    "closure 2": _scaled_by(2.0),
    "closure 3": _scaled_by(3.0),
}
SHAPES = [(3,), (4,), (2, 2)]
DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]


class Model(eqx.Module):
    """A small family: methods reading different arrays, a static field, an
    argument-keyed table, a cached method calling two others, and the inputs that once
    broke the key: an array read only for its shape and dtype (`r`), a weakly or
    strongly typed scalar (`s`), a callable leaf (`act`), a typed PRNG key, and a static
    dataclass whose `repr` hides a field. Its `__init__` is custom and leaves the slots
    to their defaults, as Equinox modules usually do."""

    # `act` is a static field here (a callable leaf is covered by test_soundness.py): the
    # model is a `lax.scan` carry and a `vmap` argument, which take arrays only.

    p: jax.Array  # (3,)
    q: jax.Array  # (3, 3)
    r: jax.Array
    s: jax.Array
    key: jax.Array
    act: Callable = eqx.field(static=True)  # static: the model is a carry
    mode: int = eqx.field(static=True, default=1)
    cfg: Config = eqx.field(static=True, default=Config())
    a_cache: Memo[jax.Array] = Memo()
    b_cache: Memo[jax.Array] = Memo()
    c_table: Memo[jax.Array] = Memo(size=2)
    d_cache: Memo[jax.Array] = Memo()
    e_cache: Memo[jax.Array] = Memo()
    g_cache: Memo[jax.Array] = Memo()
    h_cache: Memo[jax.Array] = Memo()
    k_cache: Memo[jax.Array] = Memo()

    def __init__(self, p, q):
        self.p, self.q = p, q
        self.r = jnp.ones(3)
        self.s = jnp.asarray(2.0)  # weakly typed
        self.key = jax.random.key(0)
        self.act = _sin  # (a function as a class default would be bound as a method)

    @memox.cached("e_cache")
    def e(self):
        eye = jnp.eye(self.r.shape[0], dtype=self.r.dtype)
        return eye * jnp.finfo(self.r.dtype).eps * self.cfg.scale + self.cfg.shift

    @memox.cached("g_cache")
    def g(self):
        return self.p * self.s

    @memox.cached("h_cache")
    def h(self):
        return self.act(self.p)

    @memox.cached("k_cache")
    def k(self):
        return jax.random.normal(self.key, (3,)) + self.p

    @memox.cached("a_cache")
    def a(self):
        return jnp.sin(self.p) * self.mode

    @memox.cached("b_cache")
    def b(self):
        return self.q @ self.q.T + jnp.eye(3)

    @memox.cached("c_table")
    def c(self, x):
        return jnp.tanh(self.q @ x)

    @memox.cached("d_cache")
    def d(self):
        return jnp.linalg.solve(self.b(), self.a())


NAMES = "abcdeghk"
XS = [jnp.array([0.1, 0.2, 0.3]), jnp.array([1.0, -1.0, 0.5]), jnp.array([0.0, 2.0, 0.0])]
JITTED = {name: memox.jit(lambda m, x, name=name: getattr(m, name)(*x)) for name in NAMES}


def _plain(model, name, args):
    """The unmemoized value: a cached method called outside `memox.call` computes."""
    return getattr(model, name)(*args)


def _target(name, arg):
    return (name, ()) if name != "c" else ("c", (XS[arg],))


ops = st.one_of(
    st.tuples(st.just("call"), st.sampled_from(NAMES), st.integers(0, 2)),
    st.tuples(st.just("jit"), st.sampled_from(NAMES), st.integers(0, 2)),
    st.tuples(
        st.just("bump"),
        st.sampled_from("pq"),
        st.integers(0, 8),
        st.sampled_from([1e-3, -0.5, 1.0, 0.0]),
    ),
    st.tuples(st.just("mode"), st.integers(1, 3)),
    st.tuples(st.just("clear")),
    st.tuples(st.just("invalidate"), st.sampled_from(NAMES)),
    st.tuples(
        st.just("scan"),
        st.sampled_from(NAMES),
        st.integers(1, 4),
        st.integers(0, 2),
        st.sampled_from(["lax", "memox"]),
    ),
    st.tuples(st.just("grad"), st.sampled_from(NAMES), st.integers(0, 2)),
    st.tuples(
        st.just("grad scan"),
        st.sampled_from(NAMES),
        st.integers(1, 4),
        st.integers(0, 2),
        st.booleans(),
    ),
    st.tuples(st.just("serialise")),
    st.tuples(st.just("vmap")),
    st.tuples(st.just("retype"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("weak"), st.booleans()),
    st.tuples(st.just("act"), st.sampled_from([*ACTIVATIONS, "fresh lambda"])),
    st.tuples(st.just("rekey"), st.integers(0, 2)),
    st.tuples(st.just("cfg"), st.sampled_from([0.0, 1.0]), st.sampled_from(["", "x"])),
)


SCANS = {"lax": jax.lax.scan, "memox": memox.scan}


@functools.cache
def _scan(name, length, scan):
    def body(m, args):
        y, m = memox.call(m, lambda m: getattr(m, name)(*args))
        return m, y

    return eqx.filter_jit(
        lambda m, args: SCANS[scan](lambda m, _: body(m, args), m, length=length)
    )


@functools.cache
def _grads_through_scan(name, length, frozen):
    """Gradients of a loss summed over a `memox.scan` with the model as the carry, with
    respect to a weight `w` (and the model's `p` and `q` unless `frozen`), with memox
    and without."""

    def loss(p, q, w, model, args, cached):
        m = eqx.tree_at(lambda m: (m.p, m.q), model, (p, q))
        if not cached:
            return length * jnp.sum((w * _plain(m, name, args).astype(jnp.float32)) ** 2)

        def body(m, _):
            y, m = memox.call(m, lambda m: getattr(m, name)(*args))
            return m, jnp.sum((w * y.astype(jnp.float32)) ** 2)

        return jnp.sum(memox.scan(body, m, length=length)[1])

    def both(model, args):
        grad = jax.grad(loss, argnums=(2,) if frozen else (0, 1, 2))
        w = jnp.float32(1.5)
        return [grad(model.p, model.q, w, model, args, c) for c in (True, False)]

    return eqx.filter_jit(both)


@functools.cache
def _grads(name):
    """Gradients of a loss through `name`, with memox and without (compiled once)."""

    def loss(p, q, model, args, cached):
        m = eqx.tree_at(lambda m: (m.p, m.q), model, (p, q))
        if cached:
            return jnp.sum(memox.call(m, lambda m: getattr(m, name)(*args))[0] ** 2)
        return jnp.sum(_plain(m, name, args) ** 2)

    def both(model, args):
        grad = jax.grad(loss, argnums=(0, 1))
        return grad(model.p, model.q, model, args, True), grad(
            model.p, model.q, model, args, False
        )

    return eqx.filter_jit(both)


@eqx.filter_jit
def _vmapped(model, xs):
    got, _ = jax.vmap(lambda x: memox.call(model, Model.c, x))(xs)
    return got, jax.vmap(lambda x: _plain(model, "c", (x,)))(xs)


def _assert_close(got, want, what):
    assert jax.typeof(got) == jax.typeof(want), (what, jax.typeof(got), jax.typeof(want))
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        np.asarray(want, np.float32),
        rtol=2e-3,
        atol=1e-6,
        err_msg=what,
    )


def _replace(model, **changes):
    """`model` with some static fields changed (`dataclasses.replace` would call the
    custom `__init__`)."""
    new = object.__new__(type(model))
    for name, value in {**model.__dict__, **changes}.items():
        object.__setattr__(new, name, value)
    return new


def _apply(model, op):
    """Run `op` with memox, compare with the unmemoized result; return the new model."""
    kind = op[0]
    if kind in ("call", "jit"):
        name, args = _target(op[1], op[2])
        if kind == "call":
            got, model = memox.call(model, lambda m: getattr(m, name)(*args))
        else:
            got, model = JITTED[name](model, args)
        _assert_close(got, _plain(model, name, args), f"{kind} {name}")
    elif kind == "bump":
        field, index, delta = op[1], op[2], op[3]
        arr = getattr(model, field)
        new = arr.reshape(-1).at[index % arr.size].add(delta).reshape(arr.shape)
        model = eqx.tree_at(lambda m: getattr(m, field), model, new)
    elif kind == "mode":
        model = _replace(model, mode=op[1])
    elif kind == "clear":
        model = memox.clear(model)
    elif kind == "invalidate":
        model = memox.invalidate(model, getattr(Model, op[1]))
    elif kind == "scan":
        name, length, arg, scan = op[1], op[2], op[3], op[4]
        _, args = _target(name, arg)
        # A loop carry keeps its structure: slots are allocated for the current types first.
        model = memox.init(model, lambda m: getattr(m, name)(*args))
        model, ys = _scan(name, length, scan)(model, args)
        for y in ys:
            _assert_close(y, _plain(model, name, args), f"{scan} scan {name}")
    elif kind == "grad scan":
        name, length, arg, frozen = op[1], op[2], op[3], op[4]
        _, args = _target(name, arg)
        model = memox.init(model, lambda m: getattr(m, name)(*args))
        got, want = _grads_through_scan(name, length, frozen)(model, args)
        for g, w in zip(got, want):
            _assert_close(g, w, f"grad through memox.scan {name}")
    elif kind == "grad":
        name, args = _target(op[1], op[2])
        got, want = _grads(name)(model, args)
        for g, w in zip(got, want):
            _assert_close(g, w, f"grad {name}")
    elif kind == "serialise":
        # Equinox serialises arrays, not typed PRNG keys: the key travels as its data.
        as_data = eqx.tree_at(lambda m: m.key, model, jax.random.key_data(model.key))
        buffer = io.BytesIO()
        eqx.tree_serialise_leaves(buffer, as_data)
        buffer.seek(0)
        loaded = eqx.tree_deserialise_leaves(buffer, as_data)
        model = eqx.tree_at(lambda m: m.key, loaded, jax.random.wrap_key_data(loaded.key))
    elif kind == "vmap":
        got, want = _vmapped(model, jnp.stack(XS))
        _assert_close(got, want, "vmap c")
    elif kind == "retype":
        new = jnp.ones(SHAPES[op[1]], DTYPES[op[2]])
        model = eqx.tree_at(lambda m: m.r, model, new)
    elif kind == "weak":
        model = eqx.tree_at(lambda m: m.s, model, jnp.asarray(2.0) if op[1] else jnp.float32(2.0))
    elif kind == "act":
        act = ACTIVATIONS.get(op[1]) or (lambda x: x + 0.5)  # a new lambda each time
        model = _replace(model, act=act)
    elif kind == "rekey":
        model = eqx.tree_at(lambda m: m.key, model, jax.random.key(op[1]))
    elif kind == "cfg":
        model = _replace(model, cfg=Config(1.0, op[1]))
    return model


@pytest.mark.heavy
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(ops, min_size=1, max_size=12))
def test_random_sequences_match_unmemoized(sequence):
    model = Model(jnp.array([0.3, -0.2, 0.9]), jnp.arange(9.0).reshape(3, 3) / 10)
    # Every slot allocated (the table through a call with an argument), so that the model
    # is a valid scan carry.
    model = memox.init(model, Model.c, XS[0])
    for op in sequence:
        model = _apply(model, op)
