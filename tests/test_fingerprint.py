"""Fingerprints detect changes; stored values round-trip bit for bit in every dtype."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, Foo, foo
from hypothesis import given, settings, strategies as st

import memox
from memox._fingerprint import (
    HOST_HASH_MAX_SIZE,
    ONE_PASS_WORDS,
    array_fingerprint,
    combine,
    fingerprint,
    host_fingerprint,
    known,
)
from memox._storage import Spec, decode, encode, storage_struct


DTYPES = [
    jnp.float32,
    jnp.float16,
    jnp.bfloat16,
    jnp.int32,
    jnp.int8,
    jnp.uint8,
    jnp.bool_,
    jnp.complex64,
]


def _array(dtype, shape, seed):
    x = jax.random.normal(jax.random.key(seed), shape)
    if dtype == jnp.bool_:
        return x > 0
    if jnp.issubdtype(dtype, jnp.integer):
        return (x * 50).astype(dtype)
    if dtype == jnp.complex64:
        return jax.lax.complex(x, -x)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_element_change_is_detected(dtype):
    x = _array(dtype, (5, 4), 0)
    base = fingerprint([x], (1, 2))
    flat = x.reshape(-1)
    bumped = ~flat if dtype == jnp.bool_ else flat + jnp.ones((), dtype)
    # Row i: x with element i changed.
    changed = jnp.where(jnp.eye(flat.size, dtype=jnp.bool_), bumped[None, :], flat[None, :])
    keys = jax.vmap(lambda y: fingerprint([y.reshape(x.shape)], (1, 2)))(changed)
    assert not jnp.any(jnp.all(keys == base[None, :], axis=1))


_WORDS = st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=16)


@settings(max_examples=100, deadline=None)
@given(_WORDS, _WORDS)
def test_different_contents_give_different_keys(a, b):
    a, b = np.asarray(a, np.uint32), np.asarray(b, np.uint32)
    if (a == b).all():
        return
    key_a, key_b = (fingerprint([jnp.asarray(v)], (0, 0)) for v in (a, b))
    assert not jnp.all(key_a == key_b)


def test_swapping_and_sign_flips_are_detected():
    x = jnp.arange(1.0, 9.0)
    base = fingerprint([x], (0, 0))
    swapped = x.at[2].set(x[5]).at[5].set(x[2])
    flipped = x.at[0].set(-x[0]).at[7].set(-x[7])
    for y in (swapped, flipped, -x, x[::-1]):
        assert not jnp.all(fingerprint([y], (0, 0)) == base)


def test_deterministic_eager_and_jitted():
    x = _array(jnp.float32, (16,), 3)
    y = _array(jnp.int8, (3, 2), 4)
    eager = fingerprint([x, y], (5, 6))
    jitted = jax.jit(lambda x, y: fingerprint([x, y], (5, 6)))(x, y)
    assert eager.dtype == jnp.uint32 and eager.shape == (2,)
    np.testing.assert_array_equal(eager, jitted)
    assert not jnp.all(fingerprint([x, y], (5, 7)) == eager)  # salt matters
    assert not jnp.all(fingerprint([y, x], (5, 6)) == eager)  # so does the order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (3,), (2, 5)])
def test_single_array_round_trips_and_keeps_its_shape(dtype, shape):
    x = _array(dtype, shape, 1)
    spec = Spec.of(x)
    stored = encode(x, spec)
    assert (stored.shape, stored.dtype) == storage_struct(spec)
    assert not jnp.issubdtype(stored.dtype, jnp.inexact)
    if dtype != jnp.complex64:
        assert stored.shape == shape
    back = decode(stored, spec)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_pytree_values_pack_into_bytes():
    value = {
        "a": _array(jnp.float32, (2, 3), 0),
        "b": (
            _array(jnp.bool_, (5,), 1),
            _array(jnp.complex64, (2,), 2),
            _array(jnp.bfloat16, (), 3),
        ),
    }
    spec = Spec.of(value)
    stored = encode(value, spec)
    assert stored.dtype == jnp.uint8 and stored.shape == storage_struct(spec)[0]
    back = decode(stored, spec)
    jax.tree.map(
        lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), back, value
    )
    empty = Spec.of(())
    assert decode(encode((), empty), empty) == ()


@pytest.mark.parametrize(
    "dtype",
    ["float32", "float64", "int8", "uint8", "int16", "bool", "float16", "bfloat16"]
    + ["complex64", "complex128", "int64", "uint32"],
)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4), (257, 515)])
def test_host_and_device_fingerprints_agree_bit_for_bit(dtype, shape):
    # Small concrete arrays are hashed in NumPy (`known`), large ones and tracers by XLA:
    # a slot filled one way must hit when checked the other way. The last shape is past
    # `ONE_PASS_WORDS`: the device sums its rows, then their sums.
    rng = np.random.default_rng(sum(shape) + len(dtype))
    with jax.enable_x64(True):
        x = jnp.asarray((100 * rng.normal(size=shape)).astype(jnp.dtype(dtype)))
        device = np.asarray(array_fingerprint(x))
        host = host_fingerprint(np.asarray(x))
    np.testing.assert_array_equal(host, device)


def test_small_arrays_are_fingerprinted_on_the_host():
    small = jnp.arange(10.0)
    large = jnp.arange(float(HOST_HASH_MAX_SIZE + 1))
    assert isinstance(known(small), np.ndarray)
    assert isinstance(known(large), jax.Array)
    np.testing.assert_array_equal(known(small), np.asarray(array_fingerprint(small)))


# Sizes around the row length of the fused reduction (1024 words): the rows, the tail,
# and both, hashed on the device, must agree with the flat sum on the host.
_ROW_SIZES = [1, 1023, 1024, 1025, 3 * 1024 + 17, 5000]


@pytest.mark.parametrize(
    "dtype", ["float32", "int8", "uint8", "bool", "float16", "bfloat16", "complex64", "int32"]
)
@pytest.mark.parametrize("size", _ROW_SIZES)
def test_host_and_device_agree_across_the_row_layout(dtype, size):
    rng = np.random.default_rng(size)
    x = jnp.asarray((100 * rng.normal(size=(size,))).astype(jnp.dtype(dtype)))
    np.testing.assert_array_equal(host_fingerprint(np.asarray(x)), array_fingerprint(x))


def test_host_and_device_agree_for_float64_under_x64():
    if not jax.config.jax_enable_x64:
        pytest.skip("float64 arrays exist only with jax_enable_x64 on")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 700)))
    np.testing.assert_array_equal(host_fingerprint(np.asarray(x)), array_fingerprint(x))


@pytest.mark.parametrize("dtype", ["float32", "int8", "bool", "bfloat16", "complex64"])
def test_one_element_changes_at_random_positions_are_detected(dtype):
    # Positions in the rows and in the tail of a 3 * 1024 + 17-word array; each change is
    # detected with certainty (a bijection of the one word it touches), on the device and
    # on the host.
    rng = np.random.default_rng(1)
    base = (100 * rng.normal(size=(3 * 1024 + 17,))).astype(jnp.dtype(dtype))
    fp_device = np.asarray(array_fingerprint(jnp.asarray(base)))
    fp_host = host_fingerprint(base)
    np.testing.assert_array_equal(fp_device, fp_host)
    for i in rng.choice(base.size, size=12, replace=False):
        changed = base.copy()
        if dtype == "bool":
            changed[i] = not changed[i]
        else:
            changed[i] = changed[i] + np.ones((), base.dtype)
            if changed[i] == base[i]:  # (a large float16/bfloat16 value absorbs + 1)
                changed[i] = -changed[i] if changed[i] != 0 else np.ones((), base.dtype)
        assert not np.array_equal(host_fingerprint(changed), fp_host), i
        assert not np.array_equal(np.asarray(array_fingerprint(jnp.asarray(changed))), fp_device)


@pytest.mark.parametrize("rows", [64, 256])
def test_the_device_hash_is_one_fused_pass(rows):
    # Guards the throughput (not timed here): both lanes are one variadic reduction that
    # XLA fuses with the bit-cast and the mix; nothing of the array's size is written.
    # (Two `jnp.sum`s became `reduce-window`s over a materialised mixed array on
    # XLA:CPU, ~13x slower at 64 MB.) Up to `ONE_PASS_WORDS` words on one device it
    # reduces every axis; past it, each row, which XLA:CPU splits across threads.
    x = jnp.zeros((rows, 1027), jnp.float32)
    assert (x.size <= ONE_PASS_WORDS) == (rows == 64)
    one_pass = x.size <= ONE_PASS_WORDS and jax.device_count() == 1
    lanes = "(u32[], u32[])" if one_pass else f"(u32[{rows}]{{0}}, u32[{rows}]{{0}})"
    hlo = jax.jit(array_fingerprint).lower(x).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    assert f"[{rows},1027]" not in entry.split("parameter(0)", 1)[1]
    assert f"{lanes} fusion(" in entry


@pytest.mark.parametrize("dtype", ["int2", "uint2", "int4", "uint4", "float4_e2m1fn"])
@pytest.mark.parametrize("shape", [(), (3,), (2, 5), (4, 8)])
def test_sub_byte_values_round_trip_alone_and_packed(dtype, shape):
    # Regression (issue 18): a sub-byte value was bit-cast to `uint8` (two to four
    # elements per byte, or an error). Each element is now held in a byte of its own,
    # alone and packed, and the array keeps its shape.
    dtype = jnp.dtype(dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    rng = np.random.default_rng(len(shape))
    x = jnp.asarray(rng.integers(0, 2**bits, shape, dtype=np.uint8).view(dtype))
    for value in (x, (x, jnp.arange(3, dtype=jnp.int32))):
        spec = Spec.of(value)
        stored = encode(value, spec)
        assert (stored.shape, stored.dtype) == storage_struct(spec)
        for u, v in zip(jax.tree.leaves(decode(stored, spec)), jax.tree.leaves(value)):
            assert u.dtype == v.dtype
            np.testing.assert_array_equal(
                np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8)
            )
    assert encode(x, Spec.of(x)).shape == shape


def test_a_64_bit_array_read_with_x64_off_is_fingerprinted_as_computed():
    # Found by the fuzzer: an array made under x64 and read after x64 is switched off was
    # bit-cast to `uint64` (JAX warned and truncated). Its fingerprint is now that of the
    # value a computation reads (converted as `jax.jit` converts it), on host and device.
    from memox._fingerprint import array_fingerprint, canonical, host_fingerprint

    with jax.enable_x64(True):
        wide = jnp.asarray([1.0 + 2.0**-40, 1.5])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*bitcast_convert_type.*")
        narrow = wide.astype(jnp.float32)
        assert canonical(wide).dtype == jnp.float32
        device = np.asarray(array_fingerprint(wide))
        assert np.array_equal(device, np.asarray(array_fingerprint(narrow)))
        assert np.array_equal(device, host_fingerprint(canonical(np.asarray(wide))))


def test_no_key_is_zeros():
    # A key of zeros marks an entry that holds nothing: `combine` never returns it. With
    # no fingerprint the salt is the key, so a salt of zeros reaches that one case.
    assert np.asarray(combine([], (0, 0))).tolist() == [0, 1]
    assert np.asarray(combine([], (0, 5))).tolist() == [0, 5]
    assert np.asarray(combine([], (7, 0))).tolist() == [7, 0]


def test_an_entry_holds_a_value_exactly_where_its_key_is_not_zeros():
    c = Counter()
    f = memox.init(foo(c))
    assert f.b_cache.key.tolist() == [[0, 0]] and f.b_cache.valid.tolist() == [False]
    _, f = memox.call(f, Foo.b)
    assert f.b_cache.valid.tolist() == [True]
    f = memox.clear(f)
    assert f.b_cache.key.tolist() == [[0, 0]] and f.b_cache.valid.tolist() == [False]
    _, f = memox.call(f, Foo.b)
    assert c.n == 2 and f.b_cache.valid.tolist() == [True]
