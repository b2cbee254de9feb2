"""A user's script, for the type checker only: `tests/test_types.py` runs basedpyright on
it and compares each `reveal_type` with the type a user should see, and checks that the
lines marked `# error: <rule>` (and no others) are reported. Never imported, never run:
everything that would execute is under `TYPE_CHECKING`."""

from typing import TYPE_CHECKING, reveal_type

import equinox as eqx
import jax.numpy as jnp
from jax import Array

import memox


class Model(eqx.Module):
    x: Array
    chol_cache: memox.Memo[Array] = memox.Memo()
    kernel_cache: memox.Memo[Array] = memox.Memo(size=4)
    scale_cache: memox.Memo[float] = memox.Memo()

    @memox.cached("chol_cache")
    def chol(self) -> Array:
        return jnp.linalg.cholesky(self.x @ self.x.T + jnp.eye(self.x.shape[0]))

    @memox.cached("kernel_cache")
    def kernel(self, y: Array, *, lengthscale: float = 1.0) -> Array:
        return jnp.exp(-jnp.sum((self.x - y) ** 2, axis=-1) / lengthscale)

    @memox.cached("scale_cache", policy=memox.policies.Manual())
    def scale(self) -> float:
        return 2.0


def predict(model: Model, b: Array) -> Array:
    return model.chol() @ b * model.scale()


def solve(model: Model, b: Array) -> Array:
    view = memox.hoist(model, Model.chol)  # inside `memox.call`
    reveal_type(view)
    return jnp.linalg.solve(view.chol(), b)


if TYPE_CHECKING:
    model = Model(jnp.eye(3))
    b = jnp.ones(3)

    # memox.call: the result typed by `fn`, the module by `module`.
    reveal_type(memox.call(model, predict, b))
    x, model = memox.call(model, predict, b)
    reveal_type(x)
    reveal_type(memox.call(model, lambda m: m.chol()))
    reveal_type(memox.call(model, Model.kernel, b, lengthscale=0.5))
    reveal_type(memox.call(model, Model.scale)[0])

    # A cached method keeps its signature: unbound from the class, bound from an instance.
    reveal_type(Model.chol)
    reveal_type(Model.kernel)
    reveal_type(model.chol)
    reveal_type(model.kernel)
    reveal_type(model.chol())
    reveal_type(Model.chol(model))
    reveal_type(model.scale())

    # memox.jit keeps `fn`'s parameters and returns `(result, module)`.
    step = memox.jit(predict)
    reveal_type(step)
    reveal_type(step(model, b))
    reveal_type(memox.jit(Model.kernel)(model, b))
    reveal_type(memox.jit(donate=False)(Model.kernel)(model, b))
    use_chol = memox.jit(lambda m: m.chol())  # a lambda: its parameter is `Any`, no error
    reveal_type(memox.call(model, solve, b))

    # The module in, the module out.
    reveal_type(memox.init(model))
    reveal_type(memox.init(model, Model.kernel, b))
    reveal_type(memox.clear(model))
    reveal_type(memox.strip(model))
    reveal_type(memox.invalidate(model, Model.chol, when=jnp.array(True)))

    reveal_type(memox.stats(model))
    reveal_type(memox.stats(model)["chol_cache"].hits)
    reveal_type(memox.stats(model)["chol_cache"].flops_saved)

    # Mistakes a checker catches.
    memox.call(model, predict, "b")  # error: reportArgumentType
    memox.call(model, Model.kernel, b, lengthscale="long")  # error: reportArgumentType
    memox.call(model, model.chol)  # error: reportArgumentType
    memox.jit(predict)(model)  # error: reportCallIssue
    memox.invalidate(model, model.chol)  # error: reportArgumentType
