"""`memox.flops`: FLOPs of one evaluation, counted from the jaxpr (`memox/_flops.py`); and
the FLOPs `memox.stats` reports per slot: of one computation, and saved by hits."""

import dataclasses
import math
import re
import textwrap
import types
import warnings

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memox
import memox._flops as flops_module
from memox import Memo
from memox._flops import FlopCount, count_jaxpr, flops


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _count(fn, *args, **kwargs) -> int:
    """The count of an exact FlopCount (one with no unpriced primitive)."""
    result = flops(fn, *args, **kwargs)
    assert result.exact, result.unknown
    return result.flops


#
# The API.
#


def test_flop_count():
    result = flops(jnp.sin, _f32(3, 4))
    assert result == FlopCount(12, {})
    assert result.exact
    inexact = FlopCount(5, {"sort": 1})
    assert not inexact.exact
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.flops = 0  # type: ignore[misc]


def test_count_jaxpr_and_flops_agree():
    closed = jax.make_jaxpr(lambda a, b: jnp.sin(a @ b))(_f32(3, 4), _f32(4, 2))
    expected = 2 * 3 * 2 * 4 + 3 * 2
    assert count_jaxpr(closed) == FlopCount(expected, {})
    assert flops(lambda a, b: jnp.sin(a @ b), _f32(3, 4), _f32(4, 2)).flops == expected


def test_accepts_arrays_and_modules():
    linear = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    # Weight matmul (2 * 3 * 4) plus the bias add (3).
    assert _count(linear, jnp.ones(4)) == 2 * 3 * 4 + 3
    assert _count(jax.vmap(linear), jnp.ones((2, 4))) == 2 * (2 * 3 * 4 + 3)
    assert _count(lambda x, *, y: x * y, jnp.ones(5), y=jnp.ones(5)) == 5
    # A Python number is static: `x * 2.0` multiplies by a literal.
    assert _count(lambda x, c: x * c, jnp.ones(5), 2.0) == 5


def test_docstring_example_runs():
    doc = flops.__doc__ or ""
    (code,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    # `memox.flops` is `memox._flops.flops`, re-exported.
    namespace = {"jax": jax, "jnp": jnp, "memox": types.SimpleNamespace(flops=flops)}
    exec(compile(textwrap.dedent(code), "<memox.flops docstring>", "exec"), namespace)
    assert namespace["count"] == FlopCount(135, {})
    assert namespace["partial"] == FlopCount(12, {"sort": 1})
    assert "FlopCount(flops=135, unknown={})" in doc
    assert "FlopCount(flops=12, unknown={'sort': 1})" in doc
    assert repr(namespace["partial"]) == "FlopCount(flops=12, unknown={'sort': 1})"


#
# Elementwise operations, products, reductions.
#


@pytest.mark.parametrize("m,k,n", [(3, 4, 5), (1, 7, 2)])
def test_matmul(m, k, n):
    assert _count(jnp.matmul, _f32(m, k), _f32(k, n)) == 2 * m * n * k


def test_batched_matmul():
    b, m, k, n = 3, 4, 5, 6
    assert _count(jnp.matmul, _f32(b, m, k), _f32(b, k, n)) == 2 * b * m * n * k
    assert _count(jnp.dot, _f32(k), _f32(k)) == 2 * k
    assert _count(jnp.outer, _f32(m), _f32(n)) == m * n  # one multiply each, no sum
    assert _count(jnp.dot, _f32(m, k), _f32(k, 0)) == 0


def test_elementwise():
    assert _count(jnp.add, _f32(7, 3), _f32(7, 3)) == 21
    assert _count(jnp.add, _f32(7, 3), _f32(1, 3)) == 21  # broadcast output size
    for fn in (jnp.tanh, jnp.exp, jnp.exp2, jnp.arctan, jnp.sqrt, jax.nn.sigmoid, jnp.abs):
        assert _count(fn, _f32(4, 5)) == 20, fn
    assert _count(jnp.arctan2, _f32(4, 5), _f32(4, 5)) == 20
    assert _count(jnp.power, _f32(4, 5), _f32(4, 5)) == 20
    assert _count(lambda x: jnp.clip(x, 0.0, 1.0), _f32(4, 5)) == 40  # max, then min
    assert _count(lambda x: lax.clamp(0.0, x, 1.0), _f32(4, 5)) == 20
    assert _count(jnp.where, jax.ShapeDtypeStruct((6,), jnp.bool_), _f32(6), _f32(6)) == 6
    # Data movement and dtype conversion cost nothing.
    assert _count(lambda x: x.T.reshape(-1)[:5].astype(jnp.float16), _f32(4, 5)) == 0


def test_composition_is_sum():
    m, k, n = 3, 4, 5

    def f(a, b, c):
        return jnp.tanh(a @ b + c).sum()

    args = (_f32(m, k), _f32(k, n), _f32(m, n))
    expected = 2 * m * n * k + m * n + m * n + (m * n - 1)  # matmul, add, tanh, sum
    assert _count(f, *args) == expected
    assert _count(f, *args) == sum(
        _count(g, *a)
        for g, a in [
            (jnp.matmul, args[:2]),
            (jnp.add, (_f32(m, n), _f32(m, n))),
            (jnp.tanh, (_f32(m, n),)),
            (jnp.sum, (_f32(m, n),)),
        ]
    )


@pytest.mark.parametrize("reduce", [jnp.sum, jnp.max, jnp.min, jnp.prod, jnp.argmax, jnp.argmin])
def test_reductions(reduce):
    assert _count(reduce, _f32(4, 5)) == 4 * 5 - 1
    assert _count(lambda x: reduce(x, axis=0), _f32(4, 5)) == (4 - 1) * 5
    assert _count(lambda x: reduce(x, axis=1), _f32(4, 5)) == 4 * (5 - 1)


def test_any_all_count_their_reduction():
    mask = jax.ShapeDtypeStruct((4, 5), jnp.bool_)
    assert _count(lambda m: jnp.any(m, axis=1), mask) == 4 * 4
    assert _count(lambda m: jnp.all(m, axis=1), mask) == 4 * 4


def test_generic_reduce_prices_its_reducer():
    # `n - 1` applications per output element, each a multiply and an add.
    def f(x):
        return lax.reduce(x, 0.0, lambda a, b: a * b + 1.0, (0,))

    assert _count(f, _f32(4, 5)) == (4 - 1) * 5 * 2


def test_cumulative():
    assert _count(lambda x: jnp.cumsum(x, axis=1), _f32(4, 5)) == 4 * (5 - 1)
    assert _count(lambda x: lax.cummax(x, axis=0), _f32(4, 5)) == (4 - 1) * 5
    assert _count(lambda x: lax.cumlogsumexp(x, axis=0), _f32(4, 5)) == (4 - 1) * 5 + 2 * 20


def test_pooling():
    def max_pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID")

    out = 3 * 4
    assert _count(max_pool, _f32(4, 5)) == out * (2 * 2 - 1)

    def product_pool(x):  # a generic reducer: one multiply per application
        return lax.reduce_window(x, 1.0, lambda a, b: a * b, (2, 2), (1, 1), "VALID")

    assert _count(product_pool, _f32(4, 5)) == out * (2 * 2 - 1)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("padding", ["VALID", "SAME"])
def test_conv(groups, padding):
    batch, c_in, c_out, h, w, kh, kw = 2, 4, 6, 7, 8, 3, 2

    def conv(x, k):
        return lax.conv_general_dilated(
            x, k, (1, 1), padding, feature_group_count=groups
        )  # NCHW, OIHW

    out_h, out_w = (h - kh + 1, w - kw + 1) if padding == "VALID" else (h, w)
    expected = 2 * batch * c_out * out_h * out_w * (c_in // groups) * kh * kw
    x, k = _f32(batch, c_in, h, w), _f32(c_out, c_in // groups, kh, kw)
    assert _count(conv, x, k) == expected

    def conv_nhwc(x, k):
        return lax.conv_general_dilated(
            x,
            k,
            (1, 1),
            padding,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=groups,
        )

    x, k = _f32(batch, h, w, c_in), _f32(kh, kw, c_in // groups, c_out)
    assert _count(conv_nhwc, x, k) == expected


def test_scatter_prices_its_update():
    x, idx = _f32(4, 5), jax.ShapeDtypeStruct((2,), jnp.int32)
    # Negative indices wrapped first (`lt`, `add`, `select_n` per index); `set` is free.
    wrap = 3 * 2
    assert _count(lambda x, i: x.at[i].set(1.0), x, idx) == wrap
    assert _count(lambda x, i: x.at[i].add(1.0), x, idx) == wrap + 2 * 5
    assert _count(lambda x, i: x.at[i].apply(jnp.sin), x, idx) == wrap + 2 * 5
    assert _count(lambda x, i: x[i], x, idx) == wrap  # a gather moves data


#
# Linear algebra.
#


@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
def test_cholesky(batch):
    n = 6
    count = _count(lax.linalg.cholesky_p.bind, _f32(*batch, n, n))
    assert count == (n**3 // 3) * math.prod(batch)


@pytest.mark.parametrize("left_side", [True, False])
def test_triangular_solve(left_side):
    n, k = 5, 3
    b = _f32(n, k) if left_side else _f32(k, n)

    def f(a, b):
        return lax.linalg.triangular_solve(a, b, left_side=left_side, lower=True)

    assert _count(f, _f32(n, n), b) == n**2 * k


@pytest.mark.parametrize("m,n", [(6, 6), (7, 4), (4, 7)])
def test_lu(m, n):
    big, small = max(m, n), min(m, n)
    assert _count(lax.linalg.lu, _f32(m, n)) == (3 * big * small**2 - small**3) // 3


def test_lu_square_is_two_thirds_n_cubed():
    n = 6
    assert _count(lax.linalg.lu, _f32(n, n)) == 2 * n**3 // 3


def test_eigh():
    n = 5
    count = _count(lambda a: lax.linalg.eigh(a, symmetrize_input=False), _f32(2, n, n))
    assert count == 2 * 9 * n**3


@pytest.mark.parametrize("full_matrices", [False, True])
def test_qr(full_matrices):
    m, n = 7, 4
    q_cols = m if full_matrices else n
    geqrf = (6 * m * n**2 - 2 * n**3) // 3
    orgqr = (12 * m * q_cols * n - 6 * (m + q_cols) * n**2 + 4 * n**3) // 3
    count = _count(lambda a: lax.linalg.qr(a, full_matrices=full_matrices), _f32(m, n))
    assert count == geqrf + orgqr


def test_qr_square():
    n = 6  # factorisation 4n^3/3 plus forming Q 4n^3/3
    assert _count(lax.linalg.qr, _f32(n, n)) == 2 * (4 * n**3 // 3)


@pytest.mark.parametrize(
    "compute_uv,full_matrices,expected",
    [
        (False, False, (12 * 7 * 4**2 - 4 * 4**3) // 3),
        (True, False, 14 * 7 * 4**2 + 8 * 4**3),
        (True, True, 4 * 7**2 * 4 + 8 * 7 * 4**2 + 9 * 4**3),
    ],
)
@pytest.mark.parametrize("shape", [(7, 4), (4, 7)])
def test_svd(shape, compute_uv, full_matrices, expected):
    def f(a):
        return lax.linalg.svd(a, full_matrices=full_matrices, compute_uv=compute_uv)

    assert _count(f, _f32(*shape)) == expected


def test_solve_through_jnp_linalg():
    # `jnp.linalg.solve`: LU, then inside `custom_linear_solve` its `solve` jaxpr (the
    # one that runs): the pivots' negative-index wrap (3 per index) and two triangular
    # solves (n^2 each for the one right-hand side).
    n = 5
    assert _count(jnp.linalg.solve, _f32(n, n), _f32(n)) == 2 * n**3 // 3 + 3 * n + 2 * n**2


#
# Control flow and calls.
#


def test_scan_multiplies_by_length():
    n, length = 4, 5
    step = 2 * n**3

    def f(a):
        return lax.scan(lambda c, _: (c @ c, None), a, None, length=length)[0]

    assert _count(f, _f32(n, n)) == length * step
    # `fori_loop` with static bounds is a scan; each step also increments the counter.
    count = _count(lambda a: lax.fori_loop(0, length, lambda i, c: c @ c, a), _f32(n, n))
    assert count == length * (step + 1)


def test_cond_takes_costliest_branch():
    n = 4

    def f(p, a):
        return lax.cond(p, lambda x: x @ x, lambda x: x + 1.0, a)

    assert _count(f, jax.ShapeDtypeStruct((), jnp.bool_), _f32(n, n)) == 2 * n**3

    def g(i, a):
        return lax.switch(i, [lambda x: x + 1.0, lambda x: jnp.sin(x) * 2.0, jnp.cos], a)

    # The index is clamped into range first (one `clamp`).
    assert _count(g, jax.ShapeDtypeStruct((), jnp.int32), _f32(n, n)) == 2 * n * n + 1


def test_while_counts_one_iteration():
    n = 4

    def f(a):
        return lax.while_loop(lambda c: c[0, 0] < 10.0, lambda c: c @ c, a)

    assert _count(f, _f32(n, n)) == 2 * n**3 + 1  # body matmul + the `lt` in cond


def test_calls_count_their_body_once():
    def f(a):
        a = jax.jit(jnp.sin)(a)
        return jax.checkpoint(jnp.cos)(a)

    assert _count(f, _f32(3, 4)) == 2 * 12


def test_custom_jvp_counts_the_primal_once():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x) * 2.0

    f.defjvp(lambda primals, tangents: (f(primals[0]), jnp.cos(primals[0]) * tangents[0]))
    assert _count(f, _f32(3, 4)) == 2 * 12
    assert _count(jax.nn.relu, _f32(3, 4)) == 12  # a custom_jvp inside jax.nn


def test_custom_vjp_counts_the_primal_once():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x) * 2.0

    f.defvjp(lambda x: (f(x), x), lambda x, g: (jnp.cos(x) * g * 2.0,))
    assert _count(f, _f32(3, 4)) == 2 * 12


def test_custom_linear_solve_counts_the_solve():
    n = 3

    def f(a, b):
        def matvec(x):
            return a @ x

        def solve(_, b):  # by hand: 10 elementwise ops per element, no matvec
            return b * 2.0 + b * 3.0 + b * 4.0 + b * 5.0 + b * 6.0

        return lax.custom_linear_solve(matvec, b, solve, symmetric=True)

    assert _count(f, _f32(n, n), _f32(n)) == 9 * n


def test_gradients_are_counted_too():
    # d/dx sum(sin(x)): the forward `sin` (n) and its sum (n - 1), which the jaxpr keeps
    # although nothing reads it, then `cos` and the cotangent multiply (2n).
    n = 6
    assert _count(jax.grad(lambda x: jnp.sin(x).sum()), _f32(n)) == n + (n - 1) + 2 * n


#
# What is not priced.
#


def test_unknown_reports_unpriced_primitives():
    result = flops(lambda x: jnp.sort(jnp.tanh(x)), _f32(8))
    assert result == FlopCount(8, {"sort": 1})
    assert not result.exact
    fft = flops(jnp.fft.fft, _f32(8))
    assert fft.flops == 0
    assert fft.unknown == {"fft": 1}


def test_unknown_counts_equations_once_each():
    # Inside a scan, an unpriced equation is listed once (not once per step), and every
    # branch of a cond is searched.
    def f(p, x):
        y = lax.scan(lambda c, _: (jnp.sort(c), None), x, None, length=7)[0]
        return lax.cond(p, jnp.sort, lambda v: jnp.fft.fft(v).real, y)

    result = flops(f, jax.ShapeDtypeStruct((), jnp.bool_), _f32(8))
    assert result.unknown == {"fft": 1, "sort": 2}
    assert list(result.unknown) == sorted(result.unknown)  # deterministic order


def test_a_primitive_without_a_rule_counts_zero():
    prim = jax.extend.core.Primitive("memox_test_opaque")
    prim.def_abstract_eval(lambda x: x)
    result = flops(lambda x: prim.bind(jnp.exp(x)), _f32(3))
    assert result == FlopCount(3, {"memox_test_opaque": 1})


def test_random_bits_and_debug_callbacks_cost_nothing():
    def f(key):
        jax.debug.callback(lambda: None)
        return jax.random.bits(key, (4,))

    assert flops(f, jax.random.key(0)) == FlopCount(0, {})


def test_table_covers_jax_lax():
    # Pins the primitive names the table is keyed by: every primitive that `jax.lax` and
    # `jax.lax.linalg` export is priced, free, or one of these known unpriced ones. A
    # JAX that renames or adds one fails here, naming it.
    unpriced = {
        "approx_top_k", "fft", "sort", "top_k", "select_and_gather_add",
        "select_and_scatter", "select_and_scatter_add", "eq_to", "le_to", "lt_to",
    }  # fmt: skip
    names = {
        value.name
        for module in (lax, lax.linalg)
        for value in vars(module).values()
        if isinstance(value, jax.extend.core.Primitive)
    }
    known = set(flops_module._RULES) | flops_module._ZERO
    assert sorted(names - known - unpriced) == []
    for prim, name in [(lax.tanh_p, "tanh"), (lax.linalg.cholesky_p, "cholesky")]:
        assert prim.name == name


#
# `memox.stats`: FLOPs per slot.
#


class Linear(eqx.Module):
    w: jax.Array  # (m, k)
    x: jax.Array  # (k, n)
    prod_cache: Memo[jax.Array] = Memo()
    chol_cache: Memo[jax.Array] = Memo()

    @memox.cached("prod_cache")
    def prod(self):
        return self.w @ self.x

    @memox.cached("chol_cache")
    def chol(self, scale):
        return jax.lax.linalg.cholesky(scale * self.w, symmetrize_input=False)


def test_stats_of_a_matmul_report_flops_and_flops_saved():
    m, k, n = 4, 5, 6
    model = Linear(jnp.ones((m, k)), jnp.ones((k, n)))
    for _ in range(3):
        _, model = memox.call(model, Linear.prod)
    s = memox.stats(model)["prod_cache"]
    assert s.flops == 2 * m * n * k
    assert s.flops_saved == 2 * 2 * m * n * k


def test_stats_of_a_method_with_arguments_and_linalg():
    n = 6
    model = Linear(jnp.eye(n), jnp.ones((n, 2)))
    for _ in range(3):
        _, model = memox.call(model, Linear.chol, jnp.float32(2.0))
    s = memox.stats(model)["chol_cache"]
    # The scaling, Cholesky (LAPACK: n^3 / 3), then lax's lower-triangle mask (an add, a
    # compare and a select per element).
    assert s.flops == n * n + n**3 // 3 + 3 * n * n
    assert s.flops_saved == 2 * s.flops


# -- batched modules ---------------------------------------------------------------------
#
# Regression (issue 18): `memox.stats` planned the method on the whole batched module: a
# method that is not batch-polymorphic raised, and an elementwise one reported the batch's
# FLOPs. Counts are per element, and `flops` is the FLOPs of one element's computation.


class Gram(eqx.Module):
    w: jax.Array  # (n, k)
    gram_cache: Memo[jax.Array] = Memo()
    scaled_cache: Memo[jax.Array] = Memo()

    @memox.cached("gram_cache")
    def gram(self):
        return self.w.T @ self.w  # (`.T` reverses every axis: a batched `w` fails)

    @memox.cached("scaled_cache")
    def scaled(self):
        return jnp.tanh(2.0 * self.w)  # elementwise: a batched `w` would count the batch


def _called(model, times):
    for _ in range(times):
        _, model = memox.call(model, lambda m: (m.gram(), m.scaled()))
    return model


def _stack(models):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *models)


@pytest.mark.parametrize("batch", [(3,), (2, 3)])
def test_stats_of_a_batched_module_are_per_element(batch):
    n = math.prod(batch)
    ws = jnp.arange(n * 4 * 3, dtype=jnp.float32).reshape(n, 4, 3)
    singles = [_called(Gram(w), times=1 + i) for i, w in enumerate(ws)]  # i + 1 calls each
    batched = jax.tree.map(lambda x: x.reshape(*batch, *x.shape[1:]), _stack(singles))
    got = memox.stats(batched)
    for name, one in memox.stats(singles[0]).items():
        assert got[name].flops == one.flops  # one element's computation
        assert got[name].flops_unknown == one.flops_unknown
        hits = jnp.stack([memox.stats(s)[name].hits for s in singles]).reshape(batch)
        misses = jnp.stack([memox.stats(s)[name].misses for s in singles]).reshape(batch)
        np.testing.assert_array_equal(got[name].hits, hits)
        np.testing.assert_array_equal(got[name].misses, misses)
        np.testing.assert_array_equal(got[name].flops_saved, hits * one.flops)
    assert got["gram_cache"].flops == 2 * 3 * 3 * 4
    assert got["scaled_cache"].flops == 2 * 4 * 3


@pytest.mark.parametrize("vmap", ["eqx.filter_vmap", "jax.vmap"])
def test_stats_of_vmapped_calls(vmap):
    ws = jnp.arange(5 * 4 * 3, dtype=jnp.float32).reshape(5, 4, 3)
    models = eqx.filter_vmap(lambda w: memox.init(Gram(w)))(ws)
    call = lambda m: memox.call(m, lambda m: (m.gram(), m.scaled()))[1]  # noqa: E731
    call = eqx.filter_vmap(call) if vmap == "eqx.filter_vmap" else jax.vmap(call)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memox.UncachedWarning)  # (batched dependencies)
        for _ in range(2):
            models = call(models)
    got = memox.stats(models)
    one = memox.stats(_called(Gram(ws[0]), times=2))
    for name in ("gram_cache", "scaled_cache"):
        assert got[name].flops == one[name].flops
        assert got[name].hits.shape == got[name].misses.shape == (5,)
        # Each call decided once per element: a hit or a miss.
        np.testing.assert_array_equal(got[name].hits + got[name].misses, 2)


# -- `FlopCount` and `SlotStats` as pytrees -------------------------------------------------
#
# Issue 22: both are returned from `jax.jit`. A count is known when tracing (read off
# shapes), so a `FlopCount` has no leaves: it comes back as it was, its count a Python
# int, also past what JAX's default 32-bit integers hold.


def test_flop_count_is_a_pytree_without_leaves():
    count = FlopCount(5, {"sort": 1})
    assert jax.tree.leaves(count) == []
    assert jax.tree.map(lambda x: x, count) == count
    assert repr(jax.tree.map(lambda x: x, count)) == "FlopCount(flops=5, unknown={'sort': 1})"
    assert hash(jax.tree.structure(count)) is not None  # (a `jax.jit` cache key)
    assert jax.tree.structure(count) != jax.tree.structure(FlopCount(5, {"fft": 1}))
    sorted_tanh = jax.jit(lambda x: memox.flops(lambda y: jnp.sort(jnp.tanh(y)), x))
    assert sorted_tanh(jnp.ones(8)) == FlopCount(8, {"sort": 1})
    n = 2048
    big = jax.jit(lambda: (memox.flops(jnp.matmul, _f32(n, n), _f32(n, n)), jnp.ones(())))
    got, _ = big()
    assert got == FlopCount(2 * n**3, {}) and type(got.flops) is int and got.flops > 2**31


def test_stats_returned_from_jit_keep_their_flops():
    model = Linear(jnp.ones((4, 5)), jnp.ones((5, 6)))
    for _ in range(3):
        _, model = memox.call(model, Linear.prod)
    got = jax.jit(memox.stats)(model)["prod_cache"]
    assert got == memox.stats(model)["prod_cache"] == memox.SlotStats(hits=2, misses=1)
    assert (got.flops, got.flops_unknown) == (2 * 4 * 5 * 6, {})
    assert got.flops_saved == 2 * 2 * 4 * 5 * 6
