"""Differential fuzzing: random op sequences, each result compared with the same
sequence run without memox. No sequence may serve a stale value or a wrong gradient,
nor a value of another type (dtype, weak type, shape).

Each class of input that once returned another input's value (issue 18), and each
element of the key (issue 31, tests/test_key_matrix.py), has an op that makes the change
between two calls on the same slots, so that a regression is found by construction, not
by the chance of two ops meeting (the parts are in tests/fuzz_parts.py): `config` (x64,
the PRNG flags, matmul precision, dtype promotion switched around calls of a method they
change), `parts` (C callables, NumPy generators, devices, signed zeros, NaN payloads,
partials with their keywords reordered or of a `functools.partial` subclass overriding
`__call__`, chains `1 -> True -> 1.0` and `0.0 -> -0.0` alone, in tuples and in
dataclasses, as a static field, a non-array argument and a non-array leaf), `dtype`
(sub-byte and 8-bit dependencies and values, one element changed), `types` (the shape,
dtype and weak type of an array a method reads, `o`, and of one it reads only for its
type, `r`; the weak type of `s`), `notebook` (a function and a config object held as
static fields, redefined or rebound under the same names by a module's source executed
again, as a notebook cell run again), `shard` (an array split or replicated over an
Explicit mesh of one device, `f32[4@x]` or `f32[4]`), `ensemble` (variants of one
`memox.init`ed template, one at two paths, `Exact` and `Manual`), `batched`
(`eqx.filter_vmap(memox.call)` over a batch of modules), `refresh` (`memox.clear` or
`memox.invalidate` inside `fn`: one miss, then a hit) and `threads` (two threads
sharing one compiled wrapper). The calls run eagerly, under `memox.jit`,
`memox.filter_jit`, the user's `eqx.filter_jit` and `jax.jit` around `memox.call`, and
in the body of a `lax.scan` and a `memox.scan` with the module as the carry. Static
parts equal by `==` (`1`, `True`) would share one program under `eqx.filter_jit`,
`memox.filter_jit` and `jax.jit`, with or without memox: the compiled functions take the
part's index as a static argument (`_tag`), so the unmemoized value stays the reference
everywhere. Warnings are errors (pyproject), except memox's `UncachedWarning` for a
batched predicate under `vmap`, which the semantics call for.

CI runs `MEMOX_FUZZ_EXAMPLES` sequences (default 200), under the leak checker on the
oldest JAX; the nightly size is 10,000 sequences, e.g. as two processes

    MEMOX_FUZZ_EXAMPLES=5000 MEMOX_CHECK_LEAKS=0 python -m pytest -m heavy -s \
        tests/test_fuzz.py --hypothesis-seed=1   # and =2

(the leak checker disables JAX's cache of compiled primitives: eager ops would compile
every time). From 1000 sequences, a line every 100 says how many have run, and a
failing sequence is printed at once, before hypothesis shrinks it.
"""

import dataclasses
import functools
import io
import itertools
import operator
import os
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fuzz_parts import (
    CHAINS,
    CONFIG_CASES,
    CONFIGS,
    DTYPES,
    MESH,
    PAIRS,
    PARTS,
    Ensemble,
    Layer,
    Leafy,
    Sharded,
    assert_same,
    batched_warnings_allowed,
    computable,
    ensemble,
    notebook_cell,
    one_element_changed,
    part_index,
    random_bits,
    sharded,
    use_part,
)
from helpers import reference, run_threads
from hypothesis import HealthCheck, given, settings, strategies as st
from jax import lax

import memox
from memox import Memo


EXAMPLES = int(os.environ.get("MEMOX_FUZZ_EXAMPLES", "200"))
# A long run (`-s` shows it) prints a line every this many sequences.
PROGRESS_EVERY = 100 if EXAMPLES >= 1000 else 0
# JAX's caches keep the programs a run compiles, each holding memory maps of its own: a
# run passed the kernel's limit on them (vm.max_map_count, 65,530) after about 700
# sequences and crashed. Clearing JAX's caches this often keeps it under a thousand;
# each sequence builds its own state, so no sequence depends on them.
CLEAR_JAX_CACHES_EVERY = 50
_sequences = itertools.count(1)


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
# C callables compare by identity and are not stateless: `itemgetter(0)` is not
# `itemgetter(1)`.
ACTIVATIONS = {
    "sin": _sin,
    "tanh": _tanh,
    "closure 2": _scaled_by(2.0),
    "closure 3": _scaled_by(3.0),
    "itemgetter 0": operator.itemgetter(0),
    "itemgetter 1": operator.itemgetter(1),
    "methodcaller sum": operator.methodcaller("sum"),
    "methodcaller prod": operator.methodcaller("prod"),
}
SHAPES = [(3,), (4,), (2, 2)]
FLOATS = [jnp.float32, jnp.float16, jnp.bfloat16]
T_SHAPES = [(4,), (2, 3)]


def _typed(shape, dtype, weak):
    """Halves of shape `SHAPES[shape]` and dtype `FLOATS[dtype]`, or weakly typed (a
    weak type is the default float's: `dtype` is then not used)."""
    if weak:
        return jnp.full(SHAPES[shape], 0.5)
    return jnp.full(SHAPES[shape], 0.5, FLOATS[dtype])


# Above `memox.filter_jit`'s prehash threshold (256 KiB): fingerprinted outside.
BIGS = [
    jnp.asarray(np.random.default_rng(i).normal(size=(257, 256)), jnp.float32) for i in range(2)
]


class Model(eqx.Module):
    """A small family: methods reading different arrays, a static field, an
    argument-keyed table, a cached method calling two others, and the inputs that once
    broke the key: an array read only for its shape, dtype and weak type (`r`), one
    whose type the value has (`o`), a weakly or strongly typed scalar (`s`), a callable
    static field (`act`), a typed PRNG key, a static dataclass whose `repr` hides a
    field, a static part (`aux`) and a non-array argument (`v`) from `PARTS`, an array
    of any dtype (`t`), an array fingerprinted outside `memox.filter_jit` (`big`), and
    methods whose values depend on JAX's configuration (`x`: x64, `y`: the PRNG flags,
    `k`). Its `__init__` is custom and leaves the slots to their defaults, as Equinox
    modules usually do."""

    # `act` is a static field here (a callable leaf is covered by test_soundness.py and
    # `Leafy`): the model is a `lax.scan` carry and a `vmap` argument, which take arrays
    # only.

    p: jax.Array  # (3,)
    q: jax.Array  # (3, 3)
    r: jax.Array
    s: jax.Array
    o: jax.Array
    key: jax.Array
    t: jax.Array
    big: jax.Array
    act: Callable = eqx.field(static=True)  # static: the model is a carry
    mode: int = eqx.field(static=True, default=1)
    cfg: Config = eqx.field(static=True, default=Config())
    aux: object = eqx.field(static=True, default=PARTS[0])
    a_cache: Memo[jax.Array] = Memo()
    b_cache: Memo[jax.Array] = Memo()
    c_table: Memo[jax.Array] = Memo(size=2)
    d_cache: Memo[jax.Array] = Memo()
    e_cache: Memo[jax.Array] = Memo()
    g_cache: Memo[jax.Array] = Memo()
    h_cache: Memo[jax.Array] = Memo()
    k_cache: Memo[jax.Array] = Memo()
    f_cache: Memo[jax.Array] = Memo()
    t_cache: Memo[jax.Array] = Memo()
    w_cache: Memo[tuple[jax.Array, jax.Array]] = Memo()
    u_cache: Memo[tuple[jax.Array, jax.Array, jax.Array]] = Memo()
    v_table: Memo[tuple[jax.Array, jax.Array, jax.Array]] = Memo(size=2)
    x_cache: Memo[jax.Array] = Memo()
    y_cache: Memo[jax.Array] = Memo()
    n_cache: Memo[jax.Array] = Memo()

    def __init__(self, p, q):
        self.p, self.q = p, q
        self.r = jnp.ones(3)
        self.s = jnp.asarray(2.0)  # weakly typed
        self.o = _typed(0, 0, True)
        self.key = jax.random.key(0)
        self.t = jnp.arange(4, dtype=jnp.int8)
        self.big = BIGS[0]
        self.act = _sin  # (a function as a class default would be bound as a method)

    @memox.cached("e_cache")
    def e(self):
        # `r` read for its shape, its dtype and its weak type only.
        eye = jnp.eye(self.r.shape[0], dtype=self.r.dtype)
        weak = 2.0 if jax.typeof(self.r).weak_type else 0.0
        return eye * jnp.finfo(self.r.dtype).eps * self.cfg.scale + self.cfg.shift + weak

    @memox.cached("g_cache")
    def g(self):
        return self.p * self.s

    @memox.cached("h_cache")
    def h(self):
        return self.act(self.p)

    @memox.cached("k_cache")
    def k(self):
        return jax.random.normal(self.key, (3,), self.p.dtype) + self.p

    @memox.cached("a_cache")
    def a(self):
        return jnp.sin(self.p) * self.mode

    @memox.cached("b_cache")
    def b(self):
        return self.q @ self.q.T + jnp.eye(3, dtype=self.q.dtype)

    @memox.cached("c_table")
    def c(self, x):
        return jnp.tanh(self.q @ x)

    @memox.cached("d_cache")
    def d(self):
        return jnp.linalg.solve(self.b(), self.a())

    @memox.cached("f_cache")
    def f(self):
        return self.p * jnp.mean(self.big)

    @memox.cached("t_cache")
    def tv(self):  # a value of `t`'s dtype, stored with its shape
        return jnp.flip(self.t, 0)

    @memox.cached("w_cache")
    def w(self):  # a tuple: packed into bytes
        return self.t[1:], jnp.max(self.t.astype(jnp.float32))

    @memox.cached("u_cache")
    def u(self):
        return use_part(self.aux, self.p)

    @memox.cached("v_table")
    def v(self, part):
        return use_part(part, self.p)

    @memox.cached("x_cache")
    def x(self):  # float64 under x64
        return jnp.arange(3.0) + self.p.astype(float)

    @memox.cached("y_cache")
    def y(self):  # the seed offset applies to a key made inside
        return jax.random.uniform(jax.random.key(7), (3,), self.p.dtype) + self.p

    @memox.cached("n_cache")
    def n(self):  # a value of `o`'s type: shape, dtype, weak type
        return self.o * 2.0 + 1.0


METHODS = {
    "a": "a_cache",
    "b": "b_cache",
    "c": "c_table",
    "d": "d_cache",
    "e": "e_cache",
    "g": "g_cache",
    "h": "h_cache",
    "k": "k_cache",
    "f": "f_cache",
    "tv": "t_cache",
    "w": "w_cache",
    "u": "u_cache",
    "v": "v_table",
    "x": "x_cache",
    "y": "y_cache",
    "n": "n_cache",
}
NAMES = list(METHODS)
GRAD_NAMES = [n for n in NAMES if n not in ("tv", "w", "u", "v")]  # one float array
XS = [jnp.array([0.1, 0.2, 0.3]), jnp.array([1.0, -1.0, 0.5]), jnp.array([0.0, 2.0, 0.0])]
ARGS = st.integers(0, len(PARTS) - 1)  # the argument: `XS[i % 3]` for `c`, `PARTS[i]` for `v`


def _plain(model, name, args):
    """The unmemoized value: a cached method called outside `memox.call` computes (under
    a trace, with the `UncachedWarning` that says so: expected here)."""
    with reference():
        return getattr(model, name)(*args)


def _args(name, arg):
    if name == "c":
        return (XS[arg % len(XS)],)
    return (PARTS[arg],) if name == "v" else ()


def _tag(model, name, arg):
    """A static argument for compiled functions, so that their caches tell apart the
    parts that `==` confuses (`(1,) == (True,)`): `jax.jit` itself would run a program
    traced for one on the other, with or without memox."""
    return part_index(model.aux), arg if name == "v" else -1


REFRESH = {
    None: lambda m, name: m,
    "clear": lambda m, name: memox.clear(m),
    "invalidate": lambda m, name: memox.invalidate(m, getattr(Model, name)),
}
PLACEMENTS = ["eager", "memox.jit", "memox.jit donate=False", "memox.filter_jit", "eqx.filter_jit"]
# Where a call may run besides: memox's code under the user's own `jax.jit` (the module's
# arrays traced, the rest static) and in the body of a scan with the module as the carry.
CALL_PLACEMENTS = [*PLACEMENTS, "jax.jit", "lax.scan", "memox.scan"]


@functools.cache
def _compiled(placement, name, refresh=None):
    """`getattr(model, name)(*args)` (after a refresh inside `fn`) under `placement`;
    one wrapper per placement, shared by every op, example and thread."""

    def fn(m, args, tag):
        return getattr(REFRESH[refresh](m, name), name)(*args)

    if placement.startswith("memox.jit"):
        return memox.jit(fn, donate=placement == "memox.jit")
    wrap = memox.filter_jit if placement == "memox.filter_jit" else eqx.filter_jit
    return wrap(lambda m, args, tag: memox.call(m, fn, args, tag))


def _run(placement, model, name, arg, refresh=None):
    args = _args(name, arg)
    if placement not in PLACEMENTS:
        assert refresh is None, placement
        return _place(placement, model, _method(name), args, _tag(model, name, arg))
    if placement == "eager":
        return memox.call(model, lambda m: getattr(REFRESH[refresh](m, name), name)(*args))
    return _compiled(placement, name, refresh)(model, args, _tag(model, name, arg))


SCANS = {"lax": jax.lax.scan, "memox": memox.scan}


@functools.cache
def _method(name):
    return lambda m, *args: getattr(m, name)(*args)


@functools.cache
def _jax_jitted(fn):
    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def run(arrays, treedef, statics, tag):
        module, args = eqx.combine(arrays, jax.tree.unflatten(treedef, statics))
        got, out = memox.call(module, fn, *args)
        return got, eqx.filter(out, eqx.is_array)

    return run


@functools.cache
def _scanned(fn, scan):
    def body(m, args):
        y, m = memox.call(m, fn, *args)
        return m, y

    return eqx.filter_jit(
        lambda m, args, tag: SCANS[scan](lambda m, _: body(m, args), m, length=2)
    )


@functools.cache
def _wrapped(placement, fn):
    if placement.startswith("memox.jit"):
        return memox.jit(lambda m, args, tag: fn(m, *args), donate=placement == "memox.jit")
    wrap = memox.filter_jit if placement == "memox.filter_jit" else eqx.filter_jit
    return wrap(lambda m, args, tag: memox.call(m, fn, *args))


def _place(placement, module, fn, args, tag):
    """`memox.call(module, fn, *args)` under any of `CALL_PLACEMENTS`; `tag`: a static
    argument of compiled functions (see `_tag`). Under `jax.jit` and in a scan the
    module's slots are allocated for the current types first (a program's outputs and a
    carry keep their structure)."""
    if placement == "eager":
        return memox.call(module, fn, *args)
    if placement == "jax.jit":
        module = memox.init(module, fn, *args)
        arrays, static = eqx.partition((module, args), eqx.is_array)
        statics, treedef = jax.tree.flatten(static)
        got, out = _jax_jitted(fn)(arrays, treedef, tuple(statics), tag)
        return got, eqx.combine(out, static[0])
    if placement in ("lax.scan", "memox.scan"):
        module = memox.init(module, fn, *args)
        module, ys = _scanned(fn, placement.split(".")[0])(module, args, tag)
        return _element(ys, 1), module
    return _wrapped(placement, fn)(module, args, tag)


@functools.cache
def _scan(name, length, scan):
    def body(m, args):
        y, m = memox.call(m, lambda m: getattr(m, name)(*args))
        return m, y

    return eqx.filter_jit(
        lambda m, args, tag: SCANS[scan](lambda m, _: body(m, args), m, length=length)
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

    def both(model, args, tag):
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

    def both(model, args, tag):
        grad = jax.grad(loss, argnums=(0, 1))
        return grad(model.p, model.q, model, args, True), grad(
            model.p, model.q, model, args, False
        )

    return eqx.filter_jit(both)


@eqx.filter_jit
def _vmapped(model, xs, tag):
    got, _ = jax.vmap(lambda x: memox.call(model, Model.c, x))(xs)
    return got, jax.vmap(lambda x: _plain(model, "c", (x,)))(xs)


def _replace(model, **changes):
    """`model` with some static fields changed (`dataclasses.replace` would call the
    custom `__init__`)."""
    new = object.__new__(type(model))
    for name, value in {**model.__dict__, **changes}.items():
        object.__setattr__(new, name, value)
    return new


def _stack(models):
    """The models stacked leaf by leaf, each leaf of one type in every model (checked,
    naming the leaf), with `lax` (no dtype promotion). `jnp.stack` under this suite's
    `strict` promotion and x64 makes two weakly typed float32 scalars one weakly typed
    float64 (JAX's rule): the batched op inside an x64 configuration then left a 64-bit
    `s` in the model, which later ops outside x64 met (a warning, or a promotion error);
    found twice in ~20 000 sequences, located by `_no_wide_float_outside_x64`."""

    def stack(path, *xs):
        if not eqx.is_array(xs[0]):
            return xs[0]
        types = {jax.typeof(x) for x in xs}
        assert len(types) == 1, f"batched: leaf {jax.tree_util.keystr(path)} has types {types}"
        return lax.concatenate([lax.expand_dims(x, (0,)) for x in xs], 0)

    return jax.tree_util.tree_map_with_path(stack, *models)


def _element(tree, i):
    return jax.tree.map(lambda x: x[i] if eqx.is_array(x) else x, tree)


@dataclasses.dataclass
class State:
    """What a sequence acts on: the model, an ensemble built from one template with
    the `Manual` values it must return (per path; None: computes at its next call),
    and a part held as a non-array leaf."""

    model: Model
    template: Layer
    ensemble: Ensemble
    manual: list
    leafy: Leafy
    sharded: Sharded

    @classmethod
    def new(cls):
        # New nodes around the first example's arrays (allocating every slot afresh cost
        # seconds per example under the leak checker, which compiles every eager op): no
        # example sees another's slots, and `memox.jit` donates none of these arrays.
        model, template, shard = jax.tree.map(lambda x: x, _initial())
        ens = ensemble(template, 0)
        leafy = Leafy(XS[0], PARTS[0])
        return cls(model, template, ens, [None] * len(ens.layers), leafy, shard)


@functools.cache
def _initial():
    model = Model(jnp.array([0.3, -0.2, 0.9]), jnp.arange(9.0).reshape(3, 3) / 10)
    # Every slot allocated (the tables through calls with an argument), so that the model
    # is a valid scan carry.
    model = memox.init(model, lambda m: (m.c(XS[0]), m.v(PARTS[0])))
    with jax.set_mesh(MESH):
        shard = memox.init(Sharded(sharded(None, 0.0)))
    return model, memox.init(Layer(jnp.zeros(2))), shard


OPS = {}


def op(kind, *params):
    """Register an op `kind`; `params` are the strategies of its parameters."""

    def register(apply):
        OPS[kind] = (apply, st.tuples(st.just(kind), *params))
        return apply

    return register


# -- the model: calls, changes, transformations -------------------------------------------


@op("call", st.sampled_from(NAMES), ARGS, st.sampled_from(CALL_PLACEMENTS))
def _call(state, name, arg, placement):
    got, state.model = _run(placement, state.model, name, arg)
    assert_same(got, _plain(state.model, name, _args(name, arg)), f"{placement} {name}")


@op("bump", st.sampled_from("pq"), st.integers(0, 8), st.sampled_from([1e-3, -0.5, 1.0, 0.0]))
def _bump(state, field, index, delta):
    arr = getattr(state.model, field)
    new = arr.reshape(-1).at[index % arr.size].add(delta).reshape(arr.shape)
    state.model = eqx.tree_at(lambda m: getattr(m, field), state.model, new)


@op("mode", st.integers(1, 3))
def _mode(state, mode):
    state.model = _replace(state.model, mode=mode)


@op("clear")
def _clear(state):
    state.model = memox.clear(state.model)


@op("invalidate", st.sampled_from(NAMES))
def _invalidate(state, name):
    state.model = memox.invalidate(state.model, getattr(Model, name))


@op("scan", st.sampled_from(NAMES), st.integers(1, 4), ARGS, st.sampled_from(["lax", "memox"]))
def _scan_op(state, name, length, arg, scan):
    args = _args(name, arg)
    # A loop carry keeps its structure: slots are allocated for the current types first.
    model = memox.init(state.model, lambda m: getattr(m, name)(*args))
    state.model, ys = _scan(name, length, scan)(model, args, _tag(model, name, arg))
    for i in range(length):
        assert_same(_element(ys, i), _plain(state.model, name, args), f"{scan} scan {name}")


@op("grad scan", st.sampled_from(GRAD_NAMES), st.integers(1, 4), ARGS, st.booleans())
def _grad_scan(state, name, length, arg, frozen):
    args = _args(name, arg)
    state.model = memox.init(state.model, lambda m: getattr(m, name)(*args))
    tag = _tag(state.model, name, arg)
    got, want = _grads_through_scan(name, length, frozen)(state.model, args, tag)
    assert_same(got, want, f"grad through memox.scan {name}")


@op("grad", st.sampled_from(GRAD_NAMES), ARGS)
def _grad(state, name, arg):
    args = _args(name, arg)
    got, want = _grads(name)(state.model, args, _tag(state.model, name, arg))
    assert_same(got, want, f"grad {name}")


@op("serialise")
def _serialise(state):
    # Equinox serialises arrays, not typed PRNG keys nor sub-byte dtypes: those travel
    # as their data.
    model = state.model
    as_data = eqx.tree_at(
        lambda m: (m.key, m.t),
        model,
        (jax.random.key_data(model.key), jnp.asarray(np.asarray(model.t).view(np.uint8))),
    )
    # A 64-bit leaf (made by an op under x64) is written as 32 bits outside x64 mode, and
    # Equinox then refuses to read it back (with or without memox).
    wide = any(x.dtype.itemsize == 8 for x in jax.tree.leaves(as_data) if eqx.is_array(x))
    buffer = io.BytesIO()
    with jax.enable_x64(wide or jax.config.jax_enable_x64):
        eqx.tree_serialise_leaves(buffer, as_data)
        buffer.seek(0)
        loaded = eqx.tree_deserialise_leaves(buffer, as_data)
    t = jnp.asarray(np.asarray(loaded.t).view(model.t.dtype))
    state.model = eqx.tree_at(
        lambda m: (m.key, m.t), loaded, (jax.random.wrap_key_data(loaded.key), t)
    )


@op("vmap")
def _vmap(state):
    # `memox.call` inside `vmap` over arguments: a batched predicate (warned).
    with batched_warnings_allowed():
        got, want = _vmapped(state.model, jnp.stack(XS), _tag(state.model, "c", 0))
    assert_same(got, want, "vmap c")


@op("retype", st.integers(0, 2), st.integers(0, 2), st.booleans())
def _retype(state, shape, dtype, weak):
    state.model = eqx.tree_at(lambda m: m.r, state.model, _typed(shape, dtype, weak))


@op("reread", st.integers(0, 2), st.integers(0, 2), st.booleans())
def _reread(state, shape, dtype, weak):
    state.model = eqx.tree_at(lambda m: m.o, state.model, _typed(shape, dtype, weak))


@op("weak", st.booleans())
def _weak(state, weak):
    s = jnp.asarray(2.0) if weak else jnp.float32(2.0)
    state.model = eqx.tree_at(lambda m: m.s, state.model, s)


@op("act", st.sampled_from([*ACTIVATIONS, "fresh lambda"]))
def _act(state, name):
    act = ACTIVATIONS.get(name) or (lambda x: x + 0.5)  # a new lambda each time
    state.model = _replace(state.model, act=act)


@op("rekey", st.integers(0, 2))
def _rekey(state, seed):
    state.model = eqx.tree_at(lambda m: m.key, state.model, jax.random.key(seed))


@op("cfg", st.sampled_from([0.0, 1.0]))
def _cfg(state, shift):
    state.model = _replace(state.model, cfg=Config(1.0, shift))


@op("aux", st.integers(0, len(PARTS) - 1))
def _aux(state, i):
    state.model = _replace(state.model, aux=PARTS[i])


@op("big", st.integers(0, 1))
def _big(state, i):
    state.model = eqx.tree_at(lambda m: m.big, state.model, BIGS[i])


# -- issue 18, one op per class of defect, each found by construction: the change made
# -- between two calls on the same slots ---------------------------------------------------


def _config(state, case, arg, placement, inner):
    """1. A configuration `jax.jit` keys on, switched between calls of a method whose
    value or type it changes (before, inside, after), with another op inside."""
    config, name = case
    _call(state, name, arg, placement)
    with CONFIGS[config][0]():
        _call(state, name, arg, placement)
        _apply(state, inner)
    _call(state, name, arg, placement)


@functools.cache
def _leafy(placement):
    if placement == "jax.jit":
        return lambda leafy, tag: _place(placement, leafy, Leafy.use, (), tag)
    if placement.startswith("memox.jit"):
        return memox.jit(lambda leafy, tag: leafy.use())
    wrap = memox.filter_jit if placement == "memox.filter_jit" else eqx.filter_jit
    return wrap(lambda leafy, tag: memox.call(leafy, Leafy.use))


def _use_part(state, i, where, placement):
    """Call the method that reads part `PARTS[i]`, held `where` (a leaf is not in a
    scan: a carry holds arrays; there it runs under `jax.jit`)."""
    if where == "static field":
        state.model = _replace(state.model, aux=PARTS[i])
        _call(state, "u", 0, placement)
    elif where == "argument":
        _call(state, "v", i, placement)
    else:
        leafy = Leafy(state.leafy.x, PARTS[i], cache=state.leafy.cache)
        if placement == "eager":
            got, state.leafy = memox.call(leafy, Leafy.use)
        else:
            placement = "jax.jit" if placement.endswith("scan") else placement
            got, state.leafy = _leafy(placement)(leafy, i)
        assert_same(got, leafy.use(), f"{placement} leaf {PARTS[i]!r}")


@op(
    "parts",
    st.sampled_from(PAIRS + CHAINS),
    st.sampled_from(["static field", "argument", "leaf"]),
    st.sampled_from(CALL_PLACEMENTS),
)
def _parts(state, chain, where, placement):
    """2, 3. Two or three non-array parts a key could confuse, one after the other (C
    callables, generators, devices, partials with their keywords reordered or of a
    subclass overriding `__call__`; `==` but not the same: signed zeros, NaN payloads,
    `1 -> True -> 1.0`, in tuples and dataclasses) as a static field, an argument (the
    table then holds them; back to the first) or a non-array leaf. Under
    `memox.filter_jit` and `eqx.filter_jit` (and `jax.jit`), which compile once for
    static parts equal by `==`, the part's index is a static argument of the compiled
    function (`_tag`): each compiles its own program, the unmemoized reference holds."""
    for i in (*chain, chain[0]) if where == "argument" else chain:
        _use_part(state, i, where, placement)


@op(
    "dtype",
    st.sampled_from(DTYPES),
    st.integers(0, 3),
    st.integers(0, len(T_SHAPES) - 1),
    st.sampled_from(["tv", "w"]),
    st.sampled_from(CALL_PLACEMENTS),
)
def _dtype(state, name, seed, shape, method, placement):
    """5. A dependency of a sub-byte or 8-bit dtype, then the same with one element
    changed; values of that dtype (with its shape, and packed in a tuple)."""
    if not computable(name):  # the installed jax or the backend lacks it
        return
    t = random_bits(name, T_SHAPES[shape], seed)
    for new in (t, one_element_changed(t, seed)):
        state.model = eqx.tree_at(lambda m: m.t, state.model, new)
        _call(state, method, 0, placement)


@functools.cache
def _batched_call(name):
    """Stacks the models, calls, and takes the first element of the returned batch (in
    one compiled function: under the leak checker every eager op compiles)."""

    def run(models, args, tag):
        call = eqx.filter_vmap(memox.call)
        got, out = call(_stack(models), lambda m: getattr(m, name)(*args))
        return got, _element(out, 0)

    return eqx.filter_jit(run)


@op("batched", st.sampled_from(NAMES), ARGS, st.sampled_from([0.5, -1.0]))
def _batched(state, name, arg, delta):
    """6. `eqx.filter_vmap(memox.call)` over a batch of two modules whose slots hold the
    first one's value (a batched predicate: warned, computed); the first element goes
    on with the slots it filled."""
    _call(state, name, arg, "eager")
    args = _args(name, arg)
    changed = eqx.tree_at(
        lambda m: (m.p, m.q), state.model, (state.model.p + delta, state.model.q + delta)
    )
    models = [state.model, changed]
    with batched_warnings_allowed():
        got, state.model = _batched_call(name)(models, args, _tag(state.model, name, arg))
    for i, m in enumerate(models):
        assert_same(_element(got, i), _plain(m, name, args), f"batched {name} [{i}]")


@op(
    "refresh",
    st.sampled_from(["clear", "invalidate"]),
    st.sampled_from(NAMES),
    ARGS,
    st.sampled_from(PLACEMENTS),
)
def _refresh(state, refresh, name, arg, placement):
    """7. `memox.clear` or `memox.invalidate` inside `fn`: the method recomputes (one
    miss) and the returned module holds the refreshed value (the next call hits)."""
    slot = METHODS[name]
    misses = int(getattr(state.model, slot).misses)
    got, model = _run(placement, state.model, name, arg, refresh)
    want = _plain(model, name, _args(name, arg))
    assert_same(got, want, f"{placement} {refresh} then {name}")
    assert int(getattr(model, slot).misses) == misses + 1, (placement, refresh, name)
    hits = int(getattr(model, slot).hits)
    again, state.model = _run("eager", model, name, arg)
    assert_same(again, want, f"{name} after {refresh}")
    assert int(getattr(state.model, slot).hits) == hits + 1, (placement, refresh, name)


@op(
    "threads",
    st.sampled_from(["memox.jit donate=False", "memox.filter_jit"]),
    st.sampled_from(NAMES),
    ARGS,
)
def _threads(state, wrapper, name, arg):
    """8. Two threads calling one compiled wrapper at once, on different models (other
    values, `big` included: fingerprinted outside, per thread)."""
    model = state.model
    other = next(b for b in BIGS if b is not model.big)
    models = [model, eqx.tree_at(lambda m: (m.p, m.big), model, (2.0 * model.p + 0.5, other))]
    args = _args(name, arg)
    wants = [_plain(m, name, args) for m in models]
    step = _compiled(wrapper, name)
    finals = [None, None]

    def work(i, barrier):
        m = models[i]
        for n in range(3):
            barrier.wait()
            got, m = step(m, args, _tag(m, name, arg))
            assert_same(got, wants[i], f"thread {i} call {n}: {wrapper} {name}")
        finals[i] = m

    run_threads(work)
    state.model = finals[0]


TYPE_CHANGES = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 2), st.booleans()), min_size=1, max_size=3
)


@op("types", st.sampled_from(["r", "o", "s"]), TYPE_CHANGES, st.sampled_from(CALL_PLACEMENTS))
def _types(state, field, changes, placement):
    """9. The type of an array changed between calls of a method, one to three times:
    one it reads (`o`, read by `n`: shape, dtype, weak type; `s`, read by `g`: its weak
    type only, the shape and dtype drawn are not used) or one it reads only for its type
    (`r`, read by `e`: `r.shape[0]`, `jnp.finfo(r.dtype).eps`, its weak type)."""
    name = {"r": "e", "o": "n", "s": "g"}[field]
    _call(state, name, 0, placement)
    for shape, dtype, weak in changes:
        if field == "s":
            _weak(state, weak)
        else:
            (_retype if field == "r" else _reread)(state, shape, dtype, weak)
        _call(state, name, 0, placement)


@op(
    "notebook",
    st.lists(
        st.tuples(st.sampled_from([2.0, 3.0]), st.sampled_from([0.0, 1.0]), st.booleans()),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from(["h", "e"]),
    st.sampled_from(CALL_PLACEMENTS),
)
def _notebook(state, cells, name, placement):
    """10. A function (`act`, read by `h`) and a config object (`cfg`, read by `e`) held
    as static fields, then redefined under the same names by a notebook cell run again
    (a module in `sys.modules` whose source is executed again with another body, the
    name `act` maybe rebound to another function of the cell) and set again, between
    calls on the same slots."""
    _call(state, name, 0, placement)
    for factor, shift, rebind in cells:
        user = notebook_cell(factor, shift, rebind)
        state.model = _replace(state.model, act=user.act, cfg=user.cfg)
        _call(state, name, 0, placement)


# Not in a scan: `memox.init` keeps a slot allocated for a replicated value when the
# value becomes split (`u32[1,4]` for `u32[1,4@x]`), and the carry then changes type.
SHARD_PLACEMENTS = [p for p in CALL_PLACEMENTS if not p.endswith("scan")]


@op(
    "shard",
    st.lists(
        st.tuples(st.sampled_from([None, "x"]), st.sampled_from([0.0, 1.0])),
        min_size=2,
        max_size=3,
    ),
    st.sampled_from(SHARD_PLACEMENTS),
)
def _shard(state, steps, placement):
    """11. The sharding of a read array changed between calls (replicated or split over
    the axis of an Explicit mesh of one device: `f32[4]` or `f32[4@x]`, a type), with
    or without its value, inside `jax.set_mesh` (a module of its own: the model is used
    off the mesh)."""
    with jax.set_mesh(MESH):
        for spec, value in steps:
            module = eqx.tree_at(lambda s: s.o, state.sharded, sharded(spec, value))
            got, state.sharded = _place(placement, module, Sharded.n, (), 0)
            assert_same(got, module.n(), f"{placement} sharded n, P({spec!r})")


# -- 4. an ensemble of variants of one template, one of them at two paths ------------------


def _layers(method, refresh, e):
    if refresh == "clear":
        e = memox.clear(e)
    elif refresh == "invalidate":
        e = memox.invalidate(e, getattr(Layer, method))
    elif refresh == "rebuild":  # new module objects around the same arrays
        e = eqx.combine(*eqx.partition(e, eqx.is_array))
    return jnp.stack([getattr(layer, method)() for layer in e.layers])


@functools.cache
def _ensemble_compiled(placement, method, refresh):
    fn = functools.partial(_layers, method, refresh)
    if placement.startswith("memox.jit"):
        return memox.jit(fn, donate=placement == "memox.jit")
    wrap = memox.filter_jit if placement == "memox.filter_jit" else eqx.filter_jit
    return wrap(lambda e: memox.call(e, fn))


def _ensemble_call(state, method, placement, refresh):
    if refresh == "clear" or (refresh == "invalidate" and method == "manual"):
        state.manual = [None] * len(state.manual)
    if placement == "eager":
        fn = functools.partial(_layers, method, refresh)
        got, state.ensemble = memox.call(state.ensemble, fn)
    else:
        got, state.ensemble = _ensemble_compiled(placement, method, refresh)(state.ensemble)
    want = []
    for i, layer in enumerate(state.ensemble.layers):
        value = getattr(layer, method)()
        if method == "manual":  # `Manual`: the value of the path's last computation
            if state.manual[i] is None:
                state.manual[i] = value
            value = state.manual[i]
        want.append(value)
    assert_same(got, jnp.stack(want), f"{placement} ensemble {method} ({refresh})")


@op(
    "ensemble",
    st.sampled_from(["manual", "exact"]),
    st.sampled_from(PLACEMENTS),
    st.integers(0, 3),
    st.sampled_from([0.0, 0.5]),
    st.sampled_from([None, "clear", "invalidate", "rebuild"]),
)
def _ensemble(state, method, placement, path, delta, refresh):
    """4. Paths that share one slot's arrays: a call, a change of one path's
    parameters, a second call (with a refresh or a rebuild of the module inside `fn`),
    with `Exact` and `Manual`."""
    _ensemble_call(state, method, placement, None)
    new = state.ensemble.layers[path].w + delta
    state.ensemble = eqx.tree_at(lambda e: e.layers[path].w, state.ensemble, new)
    _ensemble_call(state, method, placement, refresh)


@op("ensemble rebuild", st.integers(0, 3))
def _ensemble_rebuild(state, seed):
    state.ensemble = ensemble(state.template, seed)
    state.manual = [None] * len(state.manual)


@op("ensemble refresh", st.sampled_from(["clear", "invalidate"]))
def _ensemble_refresh(state, refresh):
    if refresh == "clear":
        state.ensemble = memox.clear(state.ensemble)
    else:
        state.ensemble = memox.invalidate(state.ensemble, Layer.manual)
    state.manual = [None] * len(state.manual)


# The op run inside a configuration: one that reads the model (and may fill its slots)
# but makes no array that would outlive the configuration (an x64 array in a model used
# after x64 is off is not what a configuration change means), or another configuration.
_READS = ["call", "refresh", "scan", "grad scan", "grad", "vmap", "batched", "parts", "dtype"]
_reads = st.one_of([OPS[kind][1] for kind in _READS])
_config_params = [st.sampled_from(CONFIG_CASES), ARGS, st.sampled_from(CALL_PLACEMENTS)]
OPS["config"] = (
    _config,
    st.tuples(
        st.just("config"),
        *_config_params,
        st.one_of(_reads, st.tuples(st.just("config"), *_config_params, _reads)),
    ),
)


def _no_wide_float_outside_x64(model, step):
    """No op leaves a 64-bit float in the model outside x64 mode: ops under x64 make no
    array that outlives it (a harness that did would test JAX's promotion, not memox)."""
    if jax.config.jax_enable_x64:
        return
    wide = [
        f"{jax.tree_util.keystr(path)}: {jax.typeof(x)}"
        for path, x in jax.tree_util.tree_leaves_with_path(model)
        if eqx.is_array(x) and x.dtype in (np.float64, np.complex128)
    ]
    assert not wide, f"after {step!r}, 64-bit floats outside x64: {wide}"


def _apply(state, step):
    """Run one op with memox, comparing with the unmemoized result."""
    OPS[step[0]][0](state, *step[1:])


# `one_of` draws its branches about evenly: the plain call and the ops that check by
# construction count several times.
WEIGHTS = {"call": 3, "config": 2, "parts": 2, "ensemble": 2}
ops = st.one_of(
    [s.map(tuple) for kind, (_, s) in OPS.items() for _ in range(WEIGHTS.get(kind, 1))]
)


@pytest.mark.heavy
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(ops, min_size=1, max_size=12))
def test_random_sequences_match_unmemoized(sequence):
    state = State.new()
    try:
        for step in sequence:
            _apply(state, step)
            _no_wide_float_outside_x64(state.model, step)
    except Exception:
        if PROGRESS_EVERY:  # (a long run: say so now, before hypothesis shrinks it)
            print(f"fuzz: a sequence failed: {sequence!r}", flush=True)
        raise
    n = next(_sequences)
    if n % CLEAR_JAX_CACHES_EVERY == 0:
        jax.clear_caches()
    if PROGRESS_EVERY and n % PROGRESS_EVERY == 0:
        print(f"fuzz: {n} sequences run, {time.strftime('%H:%M:%S')}", flush=True)
