import importlib
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import roofline

import memox._flops as flops_module
from memox._flops import flops_of, flops_of_jaxpr


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.mark.parametrize("m,k,n", [(3, 4, 5), (1, 7, 2)])
def test_matmul(m, k, n):
    assert flops_of(jnp.matmul, _f32(m, k), _f32(k, n)) == 2 * m * n * k


def test_batched_matmul():
    b, m, k, n = 3, 4, 5, 6
    assert flops_of(jnp.matmul, _f32(b, m, k), _f32(b, k, n)) == 2 * b * m * n * k


def test_elementwise_add():
    assert flops_of(jnp.add, _f32(7, 3), _f32(7, 3)) == 21
    assert flops_of(jnp.add, _f32(7, 3), _f32(1, 3)) == 21  # broadcast output size


def test_composition_is_sum():
    m, k, n = 3, 4, 5

    def f(a, b, c):
        return jnp.tanh(a @ b + c).sum()

    args = (_f32(m, k), _f32(k, n), _f32(m, n))
    expected = 2 * m * n * k + m * n + m * n + (m * n - 1)  # matmul, add, tanh, sum
    assert flops_of(f, *args) == expected
    assert flops_of(f, *args) == sum(
        flops_of(g, *a)
        for g, a in [
            (jnp.matmul, args[:2]),
            (jnp.add, (_f32(m, n), _f32(m, n))),
            (jnp.tanh, (_f32(m, n),)),
            (jnp.sum, (_f32(m, n),)),
        ]
    )


def test_accepts_arrays_and_modules():
    linear = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    # Weight matmul (2 * 3 * 4) plus the bias add (3).
    assert flops_of(linear, jnp.ones(4)) == 2 * 3 * 4 + 3
    assert flops_of(jax.vmap(linear), jnp.ones((2, 4))) == 2 * (2 * 3 * 4 + 3)
    assert flops_of(lambda x, *, y: x * y, jnp.ones(5), y=jnp.ones(5)) == 5


def test_flops_of_jaxpr():
    closed = jax.make_jaxpr(lambda a, b: jnp.sin(a @ b))(_f32(3, 4), _f32(4, 2))
    assert flops_of_jaxpr(closed) == 2 * 3 * 2 * 4 + 3 * 2


@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
def test_cholesky(batch):
    n = 6
    count = flops_of(lax.linalg.cholesky_p.bind, _f32(*batch, n, n))
    assert count == (n**3 // 3) * math.prod(batch)


@pytest.mark.parametrize("left_side", [True, False])
def test_triangular_solve(left_side):
    n, k = 5, 3
    b = _f32(n, k) if left_side else _f32(k, n)

    def f(a, b):
        return lax.linalg.triangular_solve(a, b, left_side=left_side, lower=True)

    assert flops_of(f, _f32(n, n), b) == n**2 * k


@pytest.mark.parametrize("m,n", [(6, 6), (7, 4), (4, 7)])
def test_lu(m, n):
    big, small = max(m, n), min(m, n)
    assert flops_of(lax.linalg.lu, _f32(m, n)) == (3 * big * small**2 - small**3) // 3


def test_lu_square_is_two_thirds_n_cubed():
    n = 6
    assert flops_of(lax.linalg.lu, _f32(n, n)) == 2 * n**3 // 3


def test_eigh():
    n = 5
    count = flops_of(lambda a: lax.linalg.eigh(a, symmetrize_input=False), _f32(2, n, n))
    assert count == 2 * 9 * n**3


@pytest.mark.parametrize("full_matrices", [False, True])
def test_qr(full_matrices):
    m, n = 7, 4
    q_cols = m if full_matrices else n
    geqrf = (6 * m * n**2 - 2 * n**3) // 3
    orgqr = (12 * m * q_cols * n - 6 * (m + q_cols) * n**2 + 4 * n**3) // 3
    count = flops_of(lambda a: lax.linalg.qr(a, full_matrices=full_matrices), _f32(m, n))
    assert count == geqrf + orgqr


def test_qr_square():
    n = 6  # factorisation 4n^3/3 plus forming Q 4n^3/3
    assert flops_of(lax.linalg.qr, _f32(n, n)) == 2 * (4 * n**3 // 3)


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

    assert flops_of(f, _f32(*shape)) == expected


def test_scan_multiplies_by_length():
    n, length = 4, 5
    step = 2 * n**3

    def f(a):
        return lax.scan(lambda c, _: (c @ c, None), a, None, length=length)[0]

    assert flops_of(f, _f32(n, n)) == length * step
    # `fori_loop` with static bounds is a scan; each step also increments the counter.
    count = flops_of(lambda a: lax.fori_loop(0, length, lambda i, c: c @ c, a), _f32(n, n))
    assert count == length * (step + 1)


def test_cond_takes_costliest_branch():
    n = 4

    def f(p, a):
        return lax.cond(p, lambda x: x @ x, lambda x: x + 1.0, a)

    assert flops_of(f, jax.ShapeDtypeStruct((), jnp.bool_), _f32(n, n)) == 2 * n**3


def test_while_counts_one_iteration():
    n = 4

    def f(a):
        return lax.while_loop(lambda c: c[0, 0] < 10.0, lambda c: c @ c, a)

    assert flops_of(f, _f32(n, n)) == 2 * n**3 + 1  # body matmul + the `lt` in cond


def test_calls_count_their_body_once():
    def f(a):
        a = jax.jit(jnp.sin)(a)
        return jax.checkpoint(jnp.cos)(a)

    assert flops_of(f, _f32(3, 4)) == 2 * 12


def test_rules_live_in_roofline_and_are_registered_once():
    n = 6
    _, result = roofline.roofline(lax.linalg.cholesky_p.bind)(_f32(n, n))
    assert result.unfused_flops == n**3 // 3
    rules = flops_module._ROOFLINE_RULES
    before = {p: rules[p] for p in (lax.linalg.cholesky_p, lax.tanh_p)}
    importlib.reload(flops_module)
    assert all(rules[p] is rule for p, rule in before.items())
