"""Floating-point operation counts of one evaluation of a JAX computation.

The count is read off the jaxpr, never off a compiled executable: it does not depend on
the backend, on XLA's fusion decisions, or on anything running. memox prices every
primitive itself, from one table keyed by primitive *name* (`_RULES`), and touches no
table of JAX's: counting has no effect on `jax.experimental.roofline` or anything else
in the process, and a primitive this JAX does not have is simply never met.

- Elementwise operations (arithmetic, comparisons, `select_n`, `clamp`, transcendental
  and special functions, bitwise and logical operations): one operation per element of
  the output, as `jax.experimental.roofline` counts them. `polynomial` (Horner): two
  per coefficient after the first, per element.
- `dot_general`: `2 * m * n * k` per batch element (one multiply-add is two FLOPs).
- `conv_general_dilated`: two per multiply-add, `2 * out.size * (in_features / groups)
  * prod(kernel spatial size)`, padding positions included.
- Reductions (`reduce_sum`, `_max`, `_min`, `_prod`, `_and`, `_or`, `_xor`, `argmax`,
  `argmin`): `n - 1` per output element, `n` the number of elements reduced; a generic
  `lax.reduce` multiplies that by the FLOPs of its reducer. Window reductions
  (pooling): `window size - 1` per output element. Cumulative ones (`cumsum`, ...):
  `n - 1` along the axis per lane; `cumlogsumexp` also an `exp` and a `log` per element.
- Scatters: the FLOPs of their update function (`add` for `scatter-add`, none for
  `.at[].set`) once per element of the updates.
- The LAPACK-style linear-algebra primitives, by the standard operation counts listed
  above `_LINALG`. Batch dimensions multiply the count; complex dtypes are counted as if
  they were real (as for `dot_general`).

Control flow:

- `scan` (and so `fori_loop` with static bounds): `length` times its body;
- `cond`/`switch`: the most expensive branch, an upper bound on the branch that runs;
- `while_loop`: ONE iteration (condition + body). Its trip count is only known at run
  time, so the count is per iteration, not per evaluation;
- `jit`, `checkpoint`, `custom_jvp`, `custom_vjp`, `shard_map` (per shard) and other
  calls: their body, once; `custom_linear_solve`: its `solve` jaxpr, the one that runs.

Counted zero on purpose: data movement and layout (`reshape`, `transpose`, `slice`,
`gather`, `broadcast_in_dim`, `convert_element_type`, sharding constraints, ...),
collectives (communication), the bits of random-number generation, and debug
callbacks. Any other primitive has no rule: it counts zero and is reported in
`FlopCount.unknown` (e.g. `fft`, `sort`, `top_k`, `pure_callback`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.extend


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """The FLOPs of one evaluation of a computation, and what they leave out: what
    `memox.flops` returns (and what `memox.SlotStats.flops` is counted from).

    - `flops`: the floating-point operations counted (the rules: `memox.flops`).
    - `unknown`: primitive name -> number of equations of that primitive in the jaxpr
      that no rule prices (each counted zero), e.g. `{"sort": 1}`. Equations inside
      loop bodies and every branch of a `cond` are included, each once.
    - `exact`: whether every equation was priced (`unknown` is empty).

    A pytree without leaves: the count is known when the computation is traced (it is
    read off shapes), so `flops` and `unknown` are static, and a `FlopCount` returned
    from `jax.jit` or `jax.vmap` comes back as it was, its count a Python int (as an
    array of JAX's default 32-bit integers, it would overflow past 2**31 FLOPs).

    !!! Example

        ```python
        count = memox.flops(lambda x: jnp.sort(jnp.tanh(x)), jnp.ones(4))
        assert count == memox.FlopCount(flops=4, unknown={"sort": 1})
        assert not count.exact  # the sort is not priced
        ```
    """

    flops: int
    unknown: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return not self.unknown


# Static fields are compared and hashed as JAX's cache keys: `unknown` goes into the tree
# structure as a tuple of its items.
jax.tree_util.register_pytree_node(
    FlopCount,
    lambda count: ((), (count.flops, tuple(count.unknown.items()))),
    lambda static, _: FlopCount(static[0], dict(static[1])),
)


def count_jaxpr(closed: jax.extend.core.ClosedJaxpr) -> FlopCount:
    """The FLOPs of one evaluation of `closed` (a closed or open jaxpr)."""
    walk = _Walk()
    total = walk(closed)
    return FlopCount(total, dict(sorted(walk.unknown.items())))


def flops(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> FlopCount:
    """Count the floating-point operations of one call `fn(*args, **kwargs)`.

    The call is traced with `jax.make_jaxpr` (through `eqx.filter_make_jaxpr`); nothing
    runs. Elementwise operations count one per element, a matrix product `2 * m * n * k`,
    linear-algebra primitives (Cholesky, LU, QR, eigh, SVD, triangular solves, ...) their
    standard LAPACK operation counts; a `lax.scan` body counts once per step, a
    `lax.cond` its costliest branch and a `lax.while_loop` one iteration.

    **Arguments:**

    - `fn`: the function to count, e.g. a function, an `eqx.Module` or an unbound
      method such as `Foo.b`.
    - `*args`, `**kwargs`: its arguments. Arrays and `jax.ShapeDtypeStruct`s are traced;
      every other leaf (a Python number, a function held by a module) is static, as
      under `eqx.filter_jit`.

    **Returns:**

    A `FlopCount`: `flops`, the count, and `unknown`, the primitives it found no rule for
    (counted zero), by name with their number of equations; `exact` says it is empty.

    !!! Example

        ```python
        x = jax.ShapeDtypeStruct((3, 4), jnp.float32)
        w = jax.ShapeDtypeStruct((4, 5), jnp.float32)
        count = memox.flops(lambda x, w: jnp.tanh(x @ w), x, w)
        # FlopCount(flops=135, unknown={}): 2 * 3 * 5 * 4 for the product, 15 tanh
        partial = memox.flops(lambda x: jnp.sort(x * 2.0), x)
        # FlopCount(flops=12, unknown={'sort': 1}): the sort itself is not priced
        ```
    """
    # `fn` goes in as an argument, not as the traced function: the arrays of an Equinox
    # module are then traced too, and Equinox does not warn about a `jax.vmap`-wrapped
    # module being held by its `filter_make_jaxpr` wrapper.
    closed, _, _ = eqx.filter_make_jaxpr(_call)(fn, args, kwargs)
    return count_jaxpr(closed)


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


#
# The walk. The only JAX structure read is a jaxpr's `eqns` (an equation's `primitive.name`,
# `params`, and its variables' `aval.shape`), and the parameter names of the control-flow
# primitives below. In jax < 0.12 a `ClosedJaxpr` wraps a `Jaxpr`, in jax >= 0.12 they are
# one class: both have `eqns`, so sub-jaxprs, closed or not, are walked alike.
#


class _Walk:
    """Counts jaxprs, collecting the names of primitives without a rule."""

    def __init__(self) -> None:
        self.unknown: collections.Counter[str] = collections.Counter()

    def __call__(self, jaxpr: Any) -> int:
        return sum(self.eqn(eqn) for eqn in jaxpr.eqns)

    def eqn(self, eqn: Any) -> int:
        name = eqn.primitive.name
        if name in _ZERO:
            return 0
        rule = _RULES.get(name)
        if rule is not None:
            return rule(eqn, self)
        for key in _CALL_KEYS:  # `jit`, `checkpoint`, `custom_jvp_call`, `shard_map`, ...
            body = eqn.params.get(key)
            if hasattr(body, "eqns"):
                return self(body)
        self.unknown[name] += 1
        return 0


_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_Rule = Callable[[Any, _Walk], int]


def _shape(var: Any) -> tuple[int, ...]:
    return tuple(getattr(var.aval, "shape", ()))


def _size(var: Any) -> int:
    return math.prod(_shape(var))


#
# Control flow and primitives with a body.
#


def _scan(eqn: Any, walk: _Walk) -> int:
    return eqn.params["length"] * walk(eqn.params["jaxpr"])


def _cond(eqn: Any, walk: _Walk) -> int:
    return max((walk(branch) for branch in eqn.params["branches"]), default=0)


def _while(eqn: Any, walk: _Walk) -> int:
    return walk(eqn.params["cond_jaxpr"]) + walk(eqn.params["body_jaxpr"])


def _linear_solve(eqn: Any, walk: _Walk) -> int:
    return walk(eqn.params["jaxprs"].solve)


def _scatter(eqn: Any, walk: _Walk) -> int:
    update = eqn.params.get("update_jaxpr")
    return 0 if update is None else _size(eqn.invars[2]) * walk(update)


#
# Elementwise operations, reductions, products.
#


def _elementwise(eqn: Any, walk: _Walk) -> int:
    return _size(eqn.outvars[0])


def _polynomial(eqn: Any, walk: _Walk) -> int:
    degree = len(eqn.invars) - 2  # invars: x, a_0, ..., a_degree
    return 2 * degree * _size(eqn.outvars[0])


def _reduction(eqn: Any, walk: _Walk) -> int:
    shape = _shape(eqn.invars[0])
    n = math.prod(shape[axis] for axis in eqn.params["axes"])
    return max(n - 1, 0) * _size(eqn.outvars[0])


def _reduce(eqn: Any, walk: _Walk) -> int:
    shape = _shape(eqn.invars[0])
    n = math.prod(shape[axis] for axis in eqn.params["dimensions"])
    return max(n - 1, 0) * _size(eqn.outvars[0]) * walk(eqn.params["jaxpr"])


def _window(eqn: Any, walk: _Walk) -> int:
    window = math.prod(eqn.params["window_dimensions"])
    return max(window - 1, 0) * _size(eqn.outvars[0])


def _reduce_window(eqn: Any, walk: _Walk) -> int:
    return _window(eqn, walk) * walk(eqn.params["jaxpr"])


def _cumulative(eqn: Any, walk: _Walk) -> int:
    shape = _shape(eqn.invars[0])
    n = shape[eqn.params["axis"]]
    return 0 if n == 0 else math.prod(shape) // n * (n - 1)


def _cumlogsumexp(eqn: Any, walk: _Walk) -> int:
    return _cumulative(eqn, walk) + 2 * _size(eqn.invars[0])


def _dot_general(eqn: Any, walk: _Walk) -> int:
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    rhs = _shape(eqn.invars[1])
    rhs_free = math.prod(d for i, d in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch))
    # lhs.size = batch * m * k, so this is 2 * batch * m * k * n.
    return 2 * _size(eqn.invars[0]) * rhs_free


def _conv(eqn: Any, walk: _Walk) -> int:
    rhs = _shape(eqn.invars[1])
    out_features = eqn.params["dimension_numbers"].rhs_spec[0]
    # Every output element is a sum over the kernel's input features (already divided
    # by `feature_group_count`) and spatial positions.
    per_output = math.prod(d for i, d in enumerate(rhs) if i != out_features)
    return 2 * _size(eqn.outvars[0]) * per_output


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


def _linalg(count: Callable[..., int], operand: int = 0) -> _Rule:
    """A rule from `count(m, n, eqn)`, the FLOPs for one matrix of `invars[operand]`."""

    def rule(eqn: Any, walk: _Walk) -> int:
        *batch, m, n = _shape(eqn.invars[operand])
        return math.prod(batch) * count(m, n, eqn)

    return rule


def _qr(m: int, n: int, eqn: Any) -> int:
    q_cols = _shape(eqn.outvars[0])[-1]
    return _geqrf(m, n) + _orgqr(m, q_cols, min(m, n))


def _householder_product(m: int, q: int, eqn: Any) -> int:
    return _orgqr(m, q, _shape(eqn.invars[1])[-1])


def _ormqr(length: int, _: int, eqn: Any) -> int:
    r = _shape(eqn.invars[1])[-1]
    *_batch, c_rows, c_cols = _shape(eqn.invars[2])
    other = c_cols if eqn.params["left"] else c_rows
    return 4 * length * other * r - 2 * other * r**2


def _triangular_solve(b_rows: int, b_cols: int, eqn: Any) -> int:
    n = _shape(eqn.invars[0])[-1]
    return n**2 * (b_cols if eqn.params["left_side"] else b_rows)


def _eig(n: int, _: int, eqn: Any) -> int:
    p = eqn.params
    vectors = p["compute_left_eigenvectors"] or p["compute_right_eigenvectors"]
    return (25 if vectors else 10) * n**3


def _schur(n: int, _: int, eqn: Any) -> int:
    return (25 if eqn.params["compute_schur_vectors"] else 10) * n**3


def _svd_rule(m: int, n: int, eqn: Any) -> int:
    return _svd(m, n, eqn.params["compute_uv"], eqn.params["full_matrices"])


_LINALG: dict[str, _Rule] = {
    "cholesky": _linalg(lambda n, _, eqn: n**3 // 3),
    "cholesky_update": _linalg(lambda n, _, eqn: 3 * n**2),
    "lu": _linalg(lambda m, n, eqn: _getrf(m, n)),
    "geqrf": _linalg(lambda m, n, eqn: _geqrf(m, n)),
    "geqp3": _linalg(lambda m, n, eqn: _geqrf(m, n)),
    "qr": _linalg(_qr),
    "householder_product": _linalg(_householder_product),
    "ormqr": _linalg(_ormqr),
    "triangular_solve": _linalg(_triangular_solve, operand=1),
    "eigh": _linalg(lambda n, _, eqn: 9 * n**3),
    "eig": _linalg(_eig),
    "schur": _linalg(_schur),
    "svd": _linalg(_svd_rule),
    "hessenberg": _linalg(lambda n, _, eqn: 10 * n**3 // 3),
    "tridiagonal": _linalg(lambda n, _, eqn: 4 * n**3 // 3),
    "tridiagonal_solve": _linalg(lambda n, rhs, eqn: 3 * n + 5 * n * rhs, operand=3),
    "symmetric_product": _linalg(lambda n, p, eqn: p * n * (n + 1)),
}

#
# The table. Names, not primitive objects: a name this JAX lacks is never met, and a
# primitive of a newer JAX that no rule names is reported in `unknown`.
#

_ELEMENTWISE = """
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt
    ceil clamp clz complex conj cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt igamma igamma_grad_a igammac imag integer_pow is_finite le lgamma log log1p
    log2 logistic lt max min mul mulhi ne neg nextafter not one_minus_square or polygamma
    population_count pow real regularized_incomplete_beta rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
    sub tan tanh xor zeta
""".split()

_REDUCTIONS = """
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
""".split()

_ZERO = frozenset(
    """
    broadcast_in_dim concatenate copy device_put dynamic_slice dynamic_update_slice gather
    iota pad reshape rev slice split squeeze transpose tile stack unstack empty empty2
    zeros_like convert_element_type bitcast_convert_type reduce_precision stop_gradient stage
    sharding_constraint layout_constraint reshard relayout
    with_memory_space_constraint pvary reduced_vary_cast reduced_vary_cast_p
    vary_unreduced_cast vary_unreduced_cast_p optimization_barrier tie name dce_sink
    program_order xla_metadata_value inspect_sharding
    create_token after_all debug_callback debug_print check
    lu_pivots_to_permutation axis_index platform_index dimension_size dim_as_value
    shape_assertion iota_2x32_shape
    random_seed random_wrap random_unwrap random_bits random_split random_fold_in
    random_clone threefry2x32 threefry4x32 philox2x32 philox4x32 rng_bit_generator
    rng_uniform
    psum pmax pmin all_gather all_gather_invariant all_to_all ppermute reduce_scatter
    psum_invariant pbroadcast ragged_all_to_all unreduced_psum unreduced_pmax
    unreduced_pmin
    """.split()
)

_RULES: dict[str, _Rule] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(_REDUCTIONS, _reduction),
    **dict.fromkeys(("cumsum", "cumprod", "cummax", "cummin"), _cumulative),
    **dict.fromkeys(("reduce_window_sum", "reduce_window_max", "reduce_window_min"), _window),
    **dict.fromkeys(
        ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"),
        _scatter,
    ),
    **_LINALG,
    "polynomial": _polynomial,
    "cumlogsumexp": _cumlogsumexp,
    "reduce": _reduce,
    "reduce_window": _reduce_window,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "scan": _scan,
    "cond": _cond,
    "while": _while,
    "custom_linear_solve": _linear_solve,
}
