"""Floating-point operation counts of one evaluation of a JAX computation.

The count is read off the jaxpr, never off a compiled executable: it does not depend on
the backend, on XLA's fusion decisions, or on anything running. Each leaf primitive is
priced by the rules of `jax.experimental.roofline` (its "unfused" FLOPs):

- elementwise operations (`add`, `mul`, `exp`, comparisons, `select_n`, ...): one FLOP
  per element of the (broadcast) output;
- `dot_general`: `2 * m * n * k` per batch element (one multiply-add is two FLOPs);
- `reduce_sum`: `n - 1` per output element; convolutions, gathers and scatters by
  roofline's own rules.

This module adds rules where roofline registers only a zero placeholder:

- elementwise primitives roofline misses (`tanh`, `exp2`, `pow`, `atan2`, `clamp`,
  `add_any` from gradients, ...) and the reductions `reduce_max`/`reduce_min`/
  `reduce_prod`/`argmax`/`argmin`, priced exactly like the sibling roofline already
  prices (`exp`, `add`, `select_n`, `reduce_sum`);
- the LAPACK-style linear-algebra primitives, priced by the standard operation counts
  listed at `_LINALG_RULES`. Batch dimensions multiply the count; complex dtypes are
  counted as if they were real (as roofline does for `dot_general`).

Control flow is walked by this module itself, not by roofline (which counts a `scan`
body once, whatever its length, and counts nothing inside `cond` or `while_loop`):

- `scan` (and so `fori_loop` with static bounds): `length` times its body;
- `cond`/`switch`: the most expensive branch, an upper bound on the branch that runs;
- `while_loop`: ONE iteration (condition + body). Its trip count is only known at run
  time, so the count is per iteration, not per evaluation;
- `jit`, `checkpoint`, `custom_jvp`, `custom_vjp`, `shard_map` (per shard) and other
  calls: their body, once; `custom_linear_solve`: its `solve` jaxpr, the one that runs.

Not counted (zero): primitives with no rule (e.g. `fft`, `sort`, window reductions such
as pooling, special functions like `igamma`, random-number generation), the reducer of a
generic `lax.reduce`/`reduce_window` beyond one application, and data movement
(`transpose`, `reshape`, `slice`, `broadcast_in_dim`, ...), which performs no arithmetic.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend
import jax.extend.core.primitives as prims
import jax.lax.linalg as lax_linalg
from jax._src.lax import linalg as _linalg
from jax.experimental import roofline


# roofline's rule table. It is private, but it is the least fragile way to price a single
# equation: roofline's public entry point only takes a Python function, which it retraces
# and walks with control-flow semantics we must replace (see the module docstring). The
# submodule is imported by name because `jax.experimental.roofline.roofline` is shadowed
# by the function of the same name.
_ROOFLINE_RULES: dict[jax.extend.core.Primitive, Any] = importlib.import_module(
    "jax.experimental.roofline.roofline"
)._rooflines

_Rule = Callable[..., roofline.RooflineResult]


def _is_placeholder(rule: _Rule | None) -> bool:
    """Whether roofline prices this primitive at zero (no rule, or its standard one)."""
    placeholder = "register_standard_roofline.<locals>.standard_rule"
    return rule is None or getattr(rule, "__qualname__", "") == placeholder


def _register(prim: jax.extend.core.Primitive, rule: _Rule) -> None:
    # Only over roofline's zero placeholder: a real rule from a newer JAX wins, and a
    # second import of this module (e.g. `importlib.reload`) finds ours and keeps it.
    if _is_placeholder(_ROOFLINE_RULES.get(prim)):
        roofline.register_roofline(prim)(rule)


#
# Elementwise primitives and reductions roofline misses: priced like a sibling.
#

_LIKE_SIBLING = {
    prims.tanh_p: prims.exp_p,
    prims.acosh_p: prims.exp_p,
    prims.asinh_p: prims.exp_p,
    prims.atanh_p: prims.exp_p,
    prims.exp2_p: prims.exp_p,
    prims.atan2_p: prims.add_p,
    prims.pow_p: prims.add_p,
    prims.nextafter_p: prims.add_p,
    prims.add_jaxvals_p: prims.add_p,
    prims.clamp_p: prims.select_n_p,
    prims.reduce_max_p: prims.reduce_sum_p,
    prims.reduce_min_p: prims.reduce_sum_p,
    prims.reduce_prod_p: prims.reduce_sum_p,
    prims.argmax_p: prims.reduce_sum_p,
    prims.argmin_p: prims.reduce_sum_p,
}

#
# Linear algebra. Per-matrix counts, leading terms, integer-rounded down; `m x n` is the
# operand's matrix shape, `M = max(m, n)`, `k = min(m, n)`. Sources:
# - LAWN 41 (Blackford & Dongarra, "Installation Guide for LAPACK", operation counts):
#   potrf n^3/3; getrf M k^2 - k^3/3 (2n^3/3 square); geqrf 2 M k^2 - 2 k^3/3;
#   orgqr (Q m x q from r reflectors) 4 m q r - 2 (m + q) r^2 + 4 r^3/3;
#   ormqr (C of c rows/cols the reflectors of length l act on, r reflectors)
#   4 l c r - 2 c r^2; trsm (triangle n x n, p right-hand sides) n^2 p;
#   gehrd 10 n^3/3; sytrd 4 n^3/3; syrk (A n x p) p n (n + 1).
# - Golub & Van Loan, "Matrix Computations" (3rd ed.): symmetric QR algorithm (§8.3)
#   9 n^3 with eigenvectors; Francis QR to real Schur form (§7.5) 10 n^3 without and
#   25 n^3 with Schur vectors, used for `schur` and, as a lower bound, for `eig`;
#   Golub-Reinsch SVD (§5.4.5 table), with m >= n: 4 m n^2 - 4 n^3/3 values only,
#   14 m n^2 + 8 n^3 with thin U and V, 4 m^2 n + 8 m n^2 + 9 n^3 with full U and V.
# - Derived here: tridiagonal solve (Thomas algorithm) 3 n to eliminate plus 5 n per
#   right-hand side; rank-1 Cholesky update 3 n^2 (n Givens rotations of <= n column
#   pairs at 6 FLOPs per pair).
# `eigh` counts vectors (the primitive always computes them) and the whole spectrum even
# with `subset_by_index`; `qr` counts the factorisation plus forming Q, as it lowers.
#


def _getrf(m: int, n: int) -> int:
    big, k = max(m, n), min(m, n)
    return (3 * big * k**2 - k**3) // 3


def _geqrf(m: int, n: int) -> int:
    big, k = max(m, n), min(m, n)
    return (6 * big * k**2 - 2 * k**3) // 3


def _orgqr(m: int, q: int, r: int) -> int:
    return (12 * m * q * r - 6 * (m + q) * r**2 + 4 * r**3) // 3


def _svd(m: int, n: int, compute_uv: bool, full_matrices: bool) -> int:
    m, n = max(m, n), min(m, n)
    if not compute_uv:
        return (12 * m * n**2 - 4 * n**3) // 3
    if full_matrices and m > n:
        return 4 * m**2 * n + 8 * m * n**2 + 9 * n**3
    return 14 * m * n**2 + 8 * n**3


def _per_matrix(aval: Any) -> tuple[int, tuple[int, ...]]:
    """The batch size and the matrix shape of a (batched) linear-algebra operand."""
    *batch, m, n = aval.shape
    return math.prod(batch), (m, n)


def _linalg_rule(count: Callable[..., int]) -> _Rule:
    """A roofline rule from `count(ctx, **params)`: the FLOPs of the whole equation."""

    def rule(
        ctx: roofline.RooflineRuleContext, *args: roofline.RooflineShape, **params: Any
    ) -> roofline.RooflineResult:
        flops = count(ctx, **params)
        return roofline.RooflineResult(flops=flops, unfused_flops=flops)

    return rule


def _cholesky(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (n, _n) = _per_matrix(ctx.avals_in[0])
    return batch * (n**3 // 3)


def _cholesky_update(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (n, _n) = _per_matrix(ctx.avals_in[0])
    return batch * 3 * n**2


def _lu(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (m, n) = _per_matrix(ctx.avals_in[0])
    return batch * _getrf(m, n)


def _geqrf_count(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (m, n) = _per_matrix(ctx.avals_in[0])
    return batch * _geqrf(m, n)


def _qr(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (m, n) = _per_matrix(ctx.avals_in[0])
    q_cols = ctx.avals_out[0].shape[-1]
    return batch * (_geqrf(m, n) + _orgqr(m, q_cols, min(m, n)))


def _householder_product(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (m, q) = _per_matrix(ctx.avals_in[0])
    r = ctx.avals_in[1].shape[-1]
    return batch * _orgqr(m, q, r)


def _ormqr(ctx: roofline.RooflineRuleContext, *, left: bool, **_: Any) -> int:
    batch, (length, _) = _per_matrix(ctx.avals_in[0])
    r = ctx.avals_in[1].shape[-1]
    _, (c_rows, c_cols) = _per_matrix(ctx.avals_in[2])
    other = c_cols if left else c_rows
    return batch * (4 * length * other * r - 2 * other * r**2)


def _triangular_solve(ctx: roofline.RooflineRuleContext, *, left_side: bool, **_: Any) -> int:
    batch, (b_rows, b_cols) = _per_matrix(ctx.avals_in[1])
    n = ctx.avals_in[0].shape[-1]
    return batch * n**2 * (b_cols if left_side else b_rows)


def _eigh(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (n, _n) = _per_matrix(ctx.avals_in[0])
    return batch * 9 * n**3


def _eig(
    ctx: roofline.RooflineRuleContext,
    *,
    compute_left_eigenvectors: bool,
    compute_right_eigenvectors: bool,
    **_: Any,
) -> int:
    batch, (n, _n) = _per_matrix(ctx.avals_in[0])
    vectors = compute_left_eigenvectors or compute_right_eigenvectors
    return batch * (25 if vectors else 10) * n**3


def _schur(ctx: roofline.RooflineRuleContext, *, compute_schur_vectors: bool, **_: Any) -> int:
    batch, (n, _n) = _per_matrix(ctx.avals_in[0])
    return batch * (25 if compute_schur_vectors else 10) * n**3


def _svd_count(
    ctx: roofline.RooflineRuleContext, *, compute_uv: bool, full_matrices: bool, **_: Any
) -> int:
    batch, (m, n) = _per_matrix(ctx.avals_in[0])
    return batch * _svd(m, n, compute_uv, full_matrices)


def _hessenberg(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (n, _n) = _per_matrix(ctx.avals_in[0])
    return batch * (10 * n**3 // 3)


def _tridiagonal(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (n, _n) = _per_matrix(ctx.avals_in[0])
    return batch * (4 * n**3 // 3)


def _tridiagonal_solve(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (n, rhs) = _per_matrix(ctx.avals_in[3])
    return batch * (3 * n + 5 * n * rhs)


def _symmetric_product(ctx: roofline.RooflineRuleContext, **_: Any) -> int:
    batch, (n, p) = _per_matrix(ctx.avals_in[0])
    return batch * p * n * (n + 1)


_LINALG_RULES: dict[jax.extend.core.Primitive, Callable[..., int]] = {
    lax_linalg.cholesky_p: _cholesky,
    lax_linalg.cholesky_update_p: _cholesky_update,
    lax_linalg.lu_p: _lu,
    _linalg.geqrf_p: _geqrf_count,
    _linalg.geqp3_p: _geqrf_count,
    lax_linalg.qr_p: _qr,
    lax_linalg.householder_product_p: _householder_product,
    lax_linalg.ormqr_p: _ormqr,
    lax_linalg.triangular_solve_p: _triangular_solve,
    lax_linalg.eigh_p: _eigh,
    lax_linalg.eig_p: _eig,
    lax_linalg.schur_p: _schur,
    lax_linalg.svd_p: _svd_count,
    lax_linalg.hessenberg_p: _hessenberg,
    lax_linalg.tridiagonal_p: _tridiagonal,
    lax_linalg.tridiagonal_solve_p: _tridiagonal_solve,
    lax_linalg.symmetric_product_p: _symmetric_product,
}

for _prim, _sibling in _LIKE_SIBLING.items():
    _register(_prim, _ROOFLINE_RULES[_sibling])
for _prim, _count_fn in _LINALG_RULES.items():
    _register(_prim, _linalg_rule(_count_fn))
del _prim, _sibling, _count_fn

#
# The walk.
#


def _open(jaxpr: jax.extend.core.Jaxpr | jax.extend.core.ClosedJaxpr) -> jax.extend.core.Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, jax.extend.core.ClosedJaxpr) else jaxpr


def _leaf(eqn: jax.extend.core.JaxprEqn) -> int:
    rule = _ROOFLINE_RULES.get(eqn.primitive)
    if rule is None:
        return 0
    ctx = roofline.RooflineRuleContext(
        name_stack=eqn.source_info.name_stack,
        primitive=eqn.primitive,
        avals_in=[v.aval for v in eqn.invars],
        avals_out=[v.aval for v in eqn.outvars],
        jaxpr_eqn_ctx=eqn.ctx,
        mesh=None,
        pin_lhs_in_vmem=False,
        pin_rhs_in_vmem=False,
    )
    shapes = [roofline.RooflineShape.from_aval(v.aval) for v in eqn.invars]
    return int(rule(ctx, *shapes, **eqn.params).unfused_flops)


def _eqn(eqn: jax.extend.core.JaxprEqn) -> int:
    prim, params = eqn.primitive, eqn.params
    if prim is prims.scan_p:
        return params["length"] * _count(_open(params["jaxpr"]))
    if prim is prims.cond_p:
        return max(_count(_open(branch)) for branch in params["branches"])
    if prim is prims.while_p:
        return _count(_open(params["cond_jaxpr"])) + _count(_open(params["body_jaxpr"]))
    if prim is prims.linear_solve_p:
        return _count(_open(params["jaxprs"].solve))
    for key in ("jaxpr", "call_jaxpr"):
        if key in params:
            return _count(_open(params[key]))
    return _leaf(eqn)


def _count(jaxpr: jax.extend.core.Jaxpr) -> int:
    return sum(_eqn(eqn) for eqn in jaxpr.eqns)


def flops_of_jaxpr(closed_jaxpr: jax.extend.core.ClosedJaxpr) -> int:
    """The floating-point operations of one execution of `closed_jaxpr`.

    See the module docstring for what is counted; in short, arithmetic as roofline
    prices it, LAPACK-style primitives by their standard counts, `scan` bodies times
    their length, the costliest `cond` branch, and one iteration of a `while_loop`.
    """
    return _count(closed_jaxpr.jaxpr)


def flops_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """The floating-point operations of one call `fn(*args, **kwargs)`.

    Arrays and `jax.ShapeDtypeStruct`s among the arguments are traced (nothing runs);
    every other leaf, e.g. a Python number or a function held by an Equinox module, is
    static, as under `eqx.filter_jit`.
    """
    # `fn` goes in as an argument, not as the traced function: the arrays of an Equinox
    # module are then traced too, and Equinox does not warn about a `jax.vmap`-wrapped
    # module being held by its `filter_make_jaxpr` wrapper.
    closed_jaxpr, _, _ = eqx.filter_make_jaxpr(_call)(fn, args, kwargs)
    return flops_of_jaxpr(closed_jaxpr)


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)
