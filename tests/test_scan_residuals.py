"""Under `jax.grad`, `memox.scan` keeps a cached value once for the backward pass, not once
per step: no array in the differentiated program stacks it along the loop's steps.

`tests/test_grad_memory.py` measures the memory this saves (heavy, compiled); these tests
read the programs' jaxprs instead, so they are fast and fail on any JAX version where the
guarantee is lost (jax 0.12 lost what jax 0.10's partial evaluation used to hoist: see
`memox/_scan.py`). Sizes are chosen so that no other array has the stacked shape:
`(T - 1, N, N)` or `(T, N, N)`, floating point.
"""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memox
from memox import Memo


N, T = 5, 7


class Model(eqx.Module):
    a: jax.Array  # (N, N)
    cache: Memo[jax.Array] = Memo()

    @memox.cached("cache")
    def chol(self):
        return jnp.linalg.cholesky(self.a @ self.a.T + N * jnp.eye(N))


def _loss(scan):
    def loss(theta, m, xs):
        def body(carry, x):
            m, h = carry
            L, m = memox.call(m, Model.chol)
            h = jnp.tanh(jax.scipy.linalg.cho_solve((L, True), h * theta + x))
            return (m, h), jnp.sum(h)

        (_, h), ys = scan(body, (m, jnp.zeros(N)), xs)
        return jnp.sum(h**2) + jnp.sum(ys)

    return loss


def _differentiated_model(scan):
    """The loss as a function of the model's `a` too: the factor's dependency carries a
    tangent, and the value is the method's (`jax.jvp` of it)."""
    loss = _loss(scan)
    return lambda theta, a, m, xs: loss(theta, eqx.tree_at(lambda m: m.a, m, a), xs)


def _setup():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(N, N)), jnp.float32)
    theta = jnp.asarray(rng.normal(size=N), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(T, N)), jnp.float32)
    return theta, a, memox.init(Model(a)), xs


def _programs(scan):
    """The jaxprs of the differentiated loss: `jax.grad` (frozen model and differentiated
    dependency), and the residuals `jax.vjp` and `jax.linearize` keep."""
    theta, a, m, xs = _setup()
    loss, loss_a = _loss(scan), _differentiated_model(scan)
    return {
        "grad": jax.make_jaxpr(jax.grad(loss))(theta, m, xs),
        "grad, differentiated dependency": jax.make_jaxpr(jax.grad(loss_a, (0, 1)))(
            theta, a, m, xs
        ),
        "vjp": jax.make_jaxpr(lambda t: jax.vjp(lambda t: loss(t, m, xs), t))(theta),
        "linearize": jax.make_jaxpr(lambda t: jax.linearize(lambda t: loss(t, m, xs), t))(theta),
        "jit(grad)": jax.make_jaxpr(jax.jit(jax.grad(loss)))(theta, m, xs),
    }


def _stacked_factors(closed):
    """The arrays of `closed` (every equation's outputs, nested jaxprs included) that hold
    one `(N, N)` floating-point value per step of the loop."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                aval = v.aval
                shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
                if (
                    shape is not None
                    and tuple(shape) in {(T - 1, N, N), (T, N, N)}
                    and jnp.issubdtype(dtype, jnp.floating)
                ):
                    found.append((eqn.primitive.name, aval))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return found


_PROGRAMS = ["grad", "grad, differentiated dependency", "vjp", "linearize", "jit(grad)"]


@pytest.fixture(scope="module")
def programs():
    return {scan: _programs(scan) for scan in (lax.scan, memox.scan)}


@pytest.mark.parametrize("program", _PROGRAMS)
def test_memox_scan_keeps_the_value_once(programs, program):
    assert _stacked_factors(programs[memox.scan][program]) == []


@pytest.mark.parametrize("program", [p for p in _PROGRAMS if "differentiated" not in p])
def test_the_check_finds_the_value_stacked_by_lax_scan(programs, program):
    # The same loop through `lax.scan`, the module in its carry, saves the frozen factor
    # once per step (the documented limit): the check above can fail. (With the
    # dependency differentiated, both compute the factor by `jax.jvp` of the method from
    # `a`, a loop constant, and JAX hoists it for `lax.scan` too.)
    assert _stacked_factors(programs[lax.scan][program])


def test_the_hoisted_value_is_read_outside_the_loop():
    # In the loop, a pinned read is a value closed over by the body: no fingerprint, no
    # lookup, no branch, no decoding of the table, no computation of the value.
    theta, _, m, xs = _setup()
    closed = jax.make_jaxpr(_loss(memox.scan))(theta, m, xs)
    loops = [eqn for eqn in closed.jaxpr.eqns if eqn.primitive.name == "scan"]
    assert len(loops) == 1

    def primitives(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from primitives(sub)

    in_loop = set(primitives(loops[0].params["jaxpr"].jaxpr))
    assert "triangular_solve" in in_loop  # (the walk sees the body)
    assert not in_loop & {"cond", "bitcast_convert_type", "argmax", "cholesky"}
