"""Parts of the differential fuzzer (tests/test_fuzz.py) for the classes of input that
once returned another input's value (issue 18): JAX configurations, non-array parts
that `==` cannot tell apart, dtypes, slots shared by several paths, threads, and the
checks every op ends with (values and types; which warnings are expected)."""

import contextlib
import dataclasses
import functools
import operator
import struct
import sys
import threading
import traceback
import types
import warnings
import zlib

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from helpers import type_of
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import memox
from memox import Memo


# -- checks ------------------------------------------------------------------------------


def assert_same(got, want, what):
    """Equal types (tree structure; `type_of` every leaf) and values:
    floats to rounding (memox computes inside a `cond`, the reference op by op), the
    rest exactly."""
    assert jax.tree.structure(got) == jax.tree.structure(want), (what, got, want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert type_of(g) == type_of(w), (what, jax.typeof(g), jax.typeof(w))
        if jnp.issubdtype(w.dtype, jnp.inexact):
            np.testing.assert_allclose(
                np.asarray(g, np.float32),
                np.asarray(w, np.float32),
                rtol=2e-3,
                atol=1e-6,
                err_msg=what,
            )
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


# The one warning the semantics call for: under `vmap` with a batched predicate memox
# computes (both branches would run), counts a miss and says so (design.md, "Never
# silent, by accounting").
BATCHED = "runs under `jax.vmap` with batched dependencies or arguments"


@contextlib.contextmanager
def batched_warnings_allowed():
    """Accept memox's batched-predicate `UncachedWarning`; re-raise any other warning,
    with the thread and the stack that issued it (re-raised here, the traceback no
    longer shows them)."""
    origins = []

    def issued(message, category, filename, lineno, file=None, line=None):
        where = "".join(traceback.format_stack(limit=16)[:-1])
        thread = threading.current_thread().name
        origins.append((message, category, filename, lineno, thread, where))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = issued  # called in the issuing thread (restored on exit)
        yield
    for message, category, filename, lineno, thread, where in origins:
        if not (issubclass(category, memox.UncachedWarning) and BATCHED in str(message)):
            detail = f"{message} [issued in thread {thread!r} at:\n{where}]"
            warnings.warn_explicit(detail, category, filename, lineno)


# -- 1. configuration toggles: what `jax.jit` keys on --------------------------------------


@contextlib.contextmanager
def _flag(name, value):
    before = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


# Each configuration with the methods of `test_fuzz.Model` whose values or types it
# changes (where it changes none on this backend, the methods it could change).
CONFIGS = {
    "x64": (lambda: jax.enable_x64(True), ["x", "u", "v"]),
    "x32": (lambda: jax.enable_x64(False), ["x", "u"]),
    "threefry_partitionable flipped": (
        lambda: _flag("jax_threefry_partitionable", not jax.config.jax_threefry_partitionable),
        ["k", "y"],
    ),
    "random_seed_offset 7": (lambda: _flag("jax_random_seed_offset", 7), ["y"]),
    "matmul highest": (lambda: jax.default_matmul_precision("highest"), ["b", "d"]),
    "matmul bfloat16": (lambda: jax.default_matmul_precision("bfloat16"), ["b", "c"]),
    "promotion standard": (lambda: jax.numpy_dtype_promotion("standard"), ["g", "e"]),
}
CONFIG_CASES = [(config, method) for config, (_, methods) in CONFIGS.items() for method in methods]


# -- 2, 3. non-array parts: C callables, stateful objects, parts `==` confuses ------------


@dataclasses.dataclass(frozen=True)
class Cfg:
    flag: object


def nan(payload):
    """A Python float NaN with the given payload."""
    return float(np.array(0x7FF8000000000000 | payload, np.uint64).view(np.float64))


def _ordered(**kwargs):
    """Reads its keywords in order: the first one's value."""
    return float(next(iter(kwargs.values())))


class OwnCall(functools.partial):
    """A `functools.partial` subclass overriding `__call__` (its fields are a partial's)."""

    def __call__(self, *args, **kwargs):
        return 10.0 + super().__call__(*args, **kwargs)


# Partials a key could confuse: the same keywords in another order (`==` dicts), and a
# subclass with the same fields that calls otherwise.
PARTIALS = [
    functools.partial(_ordered, a=1, b=2),
    functools.partial(_ordered, b=2, a=1),
    OwnCall(_ordered, a=1, b=2),
]

# Each part is a static field (`Model.aux`), a non-array argument (`Model.v`) and a
# non-array leaf (`Leafy.part`). Neighbours that `==` (or a guess that "C callables are
# stateless") once confused: they must never share a value.
PARTS = [
    operator.itemgetter(0),
    operator.itemgetter(1),
    operator.attrgetter("real"),
    operator.attrgetter("imag"),
    operator.methodcaller("sum"),
    operator.methodcaller("prod"),
    np.random.default_rng(0),
    np.random.default_rng(1),
    np.random.default_rng(0),  # the same state as the first, another object
    0.0,
    -0.0,
    nan(1),
    nan(2),
    1.0,
    1,
    True,
    (1,),
    (True,),
    (1.0,),
    Cfg(1),
    Cfg(True),
    Cfg(1.0),
    Cfg(0.0),
    Cfg(-0.0),
    *PARTIALS,
    *jax.devices()[:2],  # distinct devices where there are two
]


# The pairs a key could confuse: equal by `==` (`0.0 == -0.0`, `(1,) == (True,)`,
# `Cfg(1) == Cfg(1.0)`), of one type (two `itemgetter`s, two generators, two NaNs), or
# two partials.
PAIRS = [
    (i, j)
    for i, a in enumerate(PARTS)
    for j, b in enumerate(PARTS)
    if i != j
    and (type(a) is type(b) or a == b or all(isinstance(x, functools.partial) for x in (a, b)))
]


def _at(part):
    """The index in `PARTS` of `part`: the same object, or one of its type and `repr`
    (`==` confuses `1`, `True`, `1.0`)."""
    return next(
        i
        for i, p in enumerate(PARTS)
        if p is part or (type(p) is type(part) and repr(p) == repr(part))
    )


# Chains of parts changed one after the other on the same slots (`1 -> True -> 1.0`,
# `0.0 -> -0.0`), alone, in tuples, in dataclasses, and partials.
CHAINS = [
    tuple(map(_at, chain))
    for chain in [
        (1, True, 1.0),
        (1.0, True, 1),
        (True, 1.0, 1),
        (0.0, -0.0, 0.0),
        (-0.0, 0.0),
        ((1,), (True,), (1.0,)),
        (Cfg(1), Cfg(True), Cfg(1.0)),
        (Cfg(0.0), Cfg(-0.0)),
        tuple(PARTIALS),
        tuple(reversed(PARTIALS)),
    ]
]


def part_index(part):
    """The index of `part` in `PARTS`, by identity."""
    return next(i for i, p in enumerate(PARTS) if p is part)


def _exact(part):
    """What makes a canonical part what it is: floats by their bits, types kept."""
    if isinstance(part, float):
        return ("float", struct.pack("<d", part).hex())
    if isinstance(part, bool | int):
        return (type(part).__name__, int(part))
    if isinstance(part, tuple):
        return ("tuple", tuple(map(_exact, part)))
    if dataclasses.is_dataclass(part):
        fields = dataclasses.fields(part)
        return (type(part).__name__, tuple(_exact(getattr(part, f.name)) for f in fields))
    raise TypeError(part)


def _code(part):
    if isinstance(part, np.random.Generator):
        return part.bit_generator.state["state"]["state"]  # its state, not advanced
    if isinstance(part, jax.Device):
        return part.id
    return zlib.crc32(repr(_exact(part)).encode())


def use_part(part, x):
    """What a method computes from a non-array part and an array `x`: values that differ
    wherever the parts behave differently (an applied callable; an exact code of the
    part; the part as an array, whose dtype and weak type differ for `1`, `True`, `1.0`)."""
    if isinstance(part, operator.itemgetter | operator.attrgetter | operator.methodcaller):
        return jnp.broadcast_to(part(x), x.shape), jnp.int32(0), jnp.asarray(0)
    if isinstance(part, functools.partial):  # 1.0, 2.0 (keywords reordered) or 11.0
        return x * part(), jnp.int32(0), jnp.asarray(0)
    scalar = part
    while isinstance(scalar, tuple | Cfg):
        scalar = scalar[0] if isinstance(scalar, tuple) else scalar.flag
    if not isinstance(scalar, bool | int | float):
        scalar = 0
    return x, jnp.int32(_code(part) % 2**31), jnp.asarray(scalar)


class Leafy(eqx.Module):
    """A part as a non-array leaf (not a static field)."""

    x: jax.Array
    part: object
    cache: Memo[tuple[jax.Array, jax.Array, jax.Array]] = Memo()

    @memox.cached("cache")
    def use(self):
        return use_part(self.part, self.x)


# -- 4. one slot's arrays at several paths: an ensemble from one template ------------------


class Layer(eqx.Module):
    w: jax.Array
    m_cache: Memo[jax.Array] = Memo()
    x_cache: Memo[jax.Array] = Memo()

    @memox.cached("m_cache", policy=memox.policies.Manual())
    def manual(self):
        return 2.0 * self.w + 1.0

    @memox.cached("x_cache")
    def exact(self):
        return jnp.sin(self.w)


class Ensemble(eqx.Module):
    layers: list


def ensemble(template, seed):
    """The way an ensemble is built: variants of one `memox.init`ed template (every one
    holds the template's slot arrays), and one of them at a second path."""
    variants = [
        eqx.tree_at(lambda m: m.w, template, jnp.full((2,), seed + i + 1.0)) for i in range(3)
    ]
    return Ensemble([*variants, variants[0]])


# -- 5. dtypes -------------------------------------------------------------------------

DTYPES = [
    "bool",
    "int2",
    "int4",
    "uint4",
    "int8",
    "float4_e2m1fn",
    "float8_e4m3fn",
    "float8_e5m2",
    "bfloat16",
    "float16",
]
_computable: dict[str, bool] = {}


def computable(name):
    """Whether the installed jax has dtype `name` and the backend moves and converts it."""
    if name not in _computable:
        dtype = getattr(jnp, name, None)
        try:
            x = jnp.zeros((4,), dtype)
            jax.block_until_ready(jax.jit(lambda x: (x[::-1], x.astype(jnp.float32)))(x))
            _computable[name] = dtype is not None
        except Exception:  # XLA's own error, whatever its type
            _computable[name] = False
    return _computable[name]


def random_bits(name, shape, seed):
    """An array of dtype `name` with random bit patterns (NaN payloads included)."""
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, (size,), dtype=np.uint8)
    bits = 1 if dtype == np.bool_ else jax.dtypes.itemsize_bits(dtype)
    if bits < 8:
        raw &= np.uint8((1 << bits) - 1)
    return jnp.asarray(raw.view(dtype).reshape(shape))


def one_element_changed(x, index):
    """`x` with its element at flat `index` given another bit pattern (the lowest bit
    flipped: valid for every dtype, sub-byte and bool included)."""
    host = np.array(x)
    host.reshape(-1).view(np.uint8)[(index % host.size) * host.dtype.itemsize] ^= np.uint8(1)
    return jnp.asarray(host)


# -- 10. a function or a config redefined under its name: a notebook cell run again ------

NOTEBOOK_CELL = """
import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float = 1.0
    shift: float = dataclasses.field(default=0.0, repr=False)


def act(x):
    return jnp.sin(x) * {factor}


def _other(x):
    return jnp.cos(x) * {factor}


if {rebind}:
    act = _other  # the name rebound to another function of the cell

cfg = Config(1.0, {shift})
"""


def notebook_cell(factor, shift, rebind):
    """The module `fuzz_notebook` (in `sys.modules`) after its cell ran (again): `act`,
    `Config` and `cfg` defined afresh under the same names, with another body."""
    module = sys.modules.get("fuzz_notebook")
    if module is None:
        module = sys.modules["fuzz_notebook"] = types.ModuleType("fuzz_notebook")
    source = NOTEBOOK_CELL.format(factor=factor, shift=shift, rebind=rebind)
    exec(compile(source, "fuzz_notebook", "exec"), vars(module))
    return module


# -- 11. sharding: an Explicit mesh of one device (`f32[4@x]` is not `f32[4]`) ----------

MESH = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))


def sharded(spec, value):
    """`[0, 1, 2, 3] / 4 + value` on `MESH`, split along `spec` (None: replicated); call
    inside `jax.set_mesh(MESH)`."""
    x = jnp.arange(4.0) / 4 + value
    return jax.device_put(x, NamedSharding(MESH, PartitionSpec(spec)))


class Sharded(eqx.Module):
    """A module whose array's sharding is part of its type."""

    o: jax.Array
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def n(self):
        return self.o * 2.0 + 1.0


# -- 8. threads --------------------------------------------------------------------------
