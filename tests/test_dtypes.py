"""Every dtype JAX has, sub-byte ones included: one fingerprint on the host and on the
device, bit for bit, and cached values of that dtype, eagerly and compiled.

The dtypes are enumerated from what the installed `jax.numpy` and `ml_dtypes` export
(no list of names), plus a typed PRNG key per implementation: a dtype added to JAX is
tested here without a change. A dtype the backend cannot compute on (XLA:CPU has no
arithmetic for `float6_*`, and does not even copy `int1`) is skipped with the reason.
"""

import contextlib
import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import Counter

import memox
from memox import Memo
from memox._fingerprint import HOST_HASH_MAX_SIZE, array_fingerprint, host_fingerprint, known


def _jax_dtypes() -> list[np.dtype]:
    found = {}
    for module in (jnp, ml_dtypes, np):
        for name in dir(module):
            t = getattr(module, name)
            if not (isinstance(t, type) and issubclass(t, np.generic)):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    dtype = np.dtype(t)
                except TypeError:
                    continue
            if dtype.type is not t or dtype in found:  # abstract types, aliases
                continue
            if dtype.kind not in "biufcV" or not (
                dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)
            ):
                continue
            try:
                with jax.enable_x64(True):
                    jax.eval_shape(lambda: jnp.zeros((), dtype))
            except TypeError:  # not a JAX dtype (np.longdouble, ...)
                continue
            found[dtype] = name
    return sorted(found, key=lambda d: (d.kind, jax.dtypes.itemsize_bits(d), d.name))


DTYPES = [d.name for d in _jax_dtypes()] + [f"key<{impl}>" for impl in ("threefry2x32", "rbg")]
_SUB_BYTE = {"int2", "uint2", "int4", "uint4", "float4_e2m1fn"}
# One below and one above the size from which a concrete array is hashed on the device.
SIZES = {"small": (3, 5), "large": (HOST_HASH_MAX_SIZE // 256 + 1, 256)}


def test_the_enumeration_finds_the_sub_byte_dtypes():
    names = set(DTYPES)
    assert {"bool", "int4", "uint4", "int2", "uint2", "float4_e2m1fn"} <= names
    assert {"float8_e4m3fn", "float8_e5m2", "bfloat16", "complex128", "uint64"} <= names


def _x64(name):
    wide = not name.startswith("key") and np.dtype(getattr(ml_dtypes, name, name)).itemsize >= 8
    return jax.enable_x64(True) if wide else contextlib.nullcontext()


def _random_bits(name, shape, seed):
    """An array of `name` with random bit patterns (NaN payloads included), in NumPy;
    a key array as its `key_data` and implementation."""
    rng = np.random.default_rng(seed)
    if name.startswith("key<"):
        impl = name[4:-1]
        data_shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
        data = rng.integers(0, 2**32, (*shape, *data_shape.shape), dtype=np.uint32)
        return data, impl
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    raw = rng.integers(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=np.uint8)
    bits = 1 if dtype == np.bool_ else jax.dtypes.itemsize_bits(dtype)
    if bits < 8:
        raw &= np.uint8((1 << bits) - 1)
    return raw.view(dtype).reshape(shape), None


def _device(host):
    data, impl = host
    x = jnp.asarray(data)
    return jax.random.wrap_key_data(x, impl=impl) if impl is not None else x


def _bits(x):
    """The bits of `x` (a key: of its data) as unsigned integers, a NaN's as 0 with the
    NaN positions apart: XLA keeps no NaN payload through computations (on CPU a float8
    array is moved in wider floats), so only where the NaNs are is compared."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = np.asarray(x)
    if np.iscomplexobj(x):
        x = np.stack([x.real, x.imag], axis=-1)
    with np.errstate(invalid="ignore"):
        nan = np.isnan(x) if x.dtype != np.bool_ else np.zeros(x.shape, bool)
    u = np.ascontiguousarray(x).view(f"uint{8 * x.dtype.itemsize}")
    return np.where(nan, 0, u).tobytes(), nan.tobytes()


def _changed(host, index):
    """`host` with the element at flat `index` given another bit pattern: the lowest bit
    of its first byte flipped (a bit of every width, on a little-endian host)."""
    data, impl = host
    data = data.copy()
    size = data.dtype.itemsize * (data.shape[-1] if impl is not None else 1)
    data.reshape(-1).view(np.uint8)[index * size] ^= np.uint8(1)
    return data, impl


@functools.cache
def _computable(name):
    """Why the backend cannot move or convert dtype `name`, or None where it can."""
    if name.startswith("key<"):
        return None
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    try:
        with _x64(name):
            x = jnp.asarray(np.zeros((4,), dtype))
            jax.block_until_ready(jax.jit(lambda x: (x[::-1], jnp.real(x).astype(jnp.float32)))(x))
    except Exception as e:  # XLA's own error, whatever its type
        return f"{jax.default_backend()} cannot compute on {name}: {str(e)[:80]}"
    return None


def _supported(name):
    reason = _computable(name)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize(
    "name, size",
    [
        pytest.param(
            name, size, marks=() if size == "small" or name in _SUB_BYTE else pytest.mark.heavy
        )
        for name in DTYPES
        for size in SIZES
    ],
)
def test_host_and_device_fingerprints_agree_and_see_one_element(name, size):
    _supported(name)
    shape = SIZES[size]
    with _x64(name):
        host = _random_bits(name, shape, seed=len(name))
        x = _device(host)
        data = jax.random.key_data(x) if host[1] is not None else x
        fp_host = host_fingerprint(np.asarray(data))
        fp_device = np.asarray(array_fingerprint(x))  # traced: the device hash
        np.testing.assert_array_equal(fp_host, fp_device)
        np.testing.assert_array_equal(host_fingerprint(host[0]), fp_device)  # as made
        np.testing.assert_array_equal(np.asarray(known(x)), fp_device)  # host or device
        n = int(np.prod(shape))
        for index in (0, n // 2 + 1, n - 1):
            y = _device(_changed(host, index))
            data_y = jax.random.key_data(y) if host[1] is not None else y
            fp_y = np.asarray(array_fingerprint(y))
            assert not np.array_equal(fp_y, fp_device), index
            np.testing.assert_array_equal(host_fingerprint(np.asarray(data_y)), fp_y)


class Holder(eqx.Module):
    w: jax.Array
    counter: Counter = eqx.field(static=True)
    one: Memo[jax.Array] = Memo()
    two: Memo[tuple[jax.Array, jax.Array]] = Memo()

    @memox.cached("one")
    def flipped(self):  # a single array: stored with its shape
        self.counter.tick()
        return jnp.flip(self.w, 0)

    @memox.cached("two")
    def pair(self):  # a tuple: packed into bytes
        self.counter.tick()
        return self.w[1:], jnp.flip(self.w[0])

    def both(self):
        return self.flipped(), self.pair()


def _plain(host):
    """`Holder.both`, unmemoized, in NumPy (on a key's data): the exact bits."""
    w, _ = host
    return np.flip(w, 0), (w[1:], np.flip(w[0], 0))


def _exact(out, host, dtype):
    """Whether `out` is `_plain(host)` with `dtype`: shapes and bits (NaN payloads aside:
    see `_bits`)."""
    leaves, want = jax.tree.leaves(out), jax.tree.leaves(_plain(host))
    return all(
        u.dtype == dtype and _bits(u) == _bits(v) for u, v in zip(leaves, want, strict=True)
    )


# The default suite runs the cached-method matrix on the dtypes that once broke and one
# of each other kind; every dtype at every size runs with the heavy suites.
_CORE = {"small": {"bool", "int2", "uint2", "int4", "uint4", "float4_e2m1fn", "float8_e4m3fn"}}
_CORE["large"] = {"uint2", "int4", "float4_e2m1fn"}  # (the device hash's sub-byte cases)
_CASES = [
    pytest.param(name, size, marks=() if name in _CORE[size] else pytest.mark.heavy)
    for name in DTYPES
    for size in SIZES
]


@pytest.mark.parametrize("mode", ["eager", "memox.jit", "jax.jit"])
@pytest.mark.parametrize("name, size", _CASES)
def test_cached_values_and_dependencies_of_every_dtype(name, size, mode):
    # Regression (issue 18): int4/uint4/float4_e2m1fn dependencies crashed the device
    # hash (above 65,536 elements), a float4 value crashed its storage, int2/uint2
    # fingerprints differed between the host and the device.
    _supported(name)
    with _x64(name):
        host = _random_bits(name, SIZES[size], seed=1)
        counter = Counter()
        model = Holder(_device(host), counter)
        dtype = model.w.dtype
        if mode == "eager":
            step = lambda m: memox.call(m, Holder.both)  # noqa: E731
        elif mode == "memox.jit":
            step = memox.jit(Holder.both, donate=False)
        else:
            model = memox.init(model, Holder.both)
            step = jax.jit(lambda m: memox.call(m, Holder.both))
        runs = []
        for w in (host, host, _changed(host, 3)):  # new arrays: equal, one element off
            model = eqx.tree_at(lambda m: m.w, model, _device(w))
            out, model = step(model)
            jax.effects_barrier()
            assert _exact(out, w, dtype)
            runs.append(counter.n)
        assert runs == [2, 2, 4]  # both methods: miss, hit, miss
        stats = memox.stats(model)
        assert (stats["one"].hits, stats["one"].misses) == (1, 2)


class Packed(eqx.Module):
    t: jax.Array
    both: Memo[tuple[jax.Array, jax.Array]] = Memo()

    @memox.cached("both")
    def value(self):  # a slice of `t` and a float32, packed into one byte vector
        return self.t[1:], jnp.max(self.t.astype(jnp.float32))


@pytest.mark.parametrize("name", sorted(_SUB_BYTE))
def test_a_sub_byte_slice_stored_in_a_loop_body(name):
    # Regression (issue 18, found by the fuzzer): a `float4_e2m1fn` slice stored in a
    # `lax.scan` body failed to compile on XLA:CPU ("Invalid bitcast i8 to i4": XLA
    # slices a sub-byte array through `float16` and the bit-cast of that conversion's
    # result to `uint4` is miscompiled). memox bit-casts no sub-byte type (`Bits`).
    _supported(name)
    # (No callback counts executions here: it changes what XLA fuses, and the crash
    # needs the fusion; `memox.stats` counts the decisions.)
    host, _ = _random_bits(name, (4,), seed=2)
    model = memox.init(Packed(jnp.asarray(host)), Packed.value)

    def body(m, _):
        y, m = memox.call(m, Packed.value)
        return m, y

    model, (tails, tops) = jax.jit(lambda m: jax.lax.scan(body, m, length=2))(model)
    assert memox.stats(model)["both"] == memox.SlotStats(hits=1, misses=1)
    for i in range(2):
        assert _bits(tails[i]) == _bits(host[1:])
        assert float(tops[i]) == float(np.max(host.astype(np.float32)))
