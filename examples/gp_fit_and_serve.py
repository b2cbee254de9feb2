"""Fit a Gaussian process, then serve it, with memox caching its Cholesky factor.

`GP` holds its training data and three log-hyperparameters. The cached method `factor`
derives what the likelihood and every prediction need: L with L Lᵀ = K + σ²I (O(n³))
and alpha = K⁻¹y. A `jax.debug.callback` in it counts real factorisations when this file
runs as a script (in float64); `benchmarks/s2_gp_serving.py` imports the model.

1. Fit: adam on the negative log marginal likelihood in an `eqx.filter_jit` step. The
   hyperparameters move every step, so memox recomputes L every step, and the gradient
   flows through the factorisation exactly.
2. Serve: 200 batches of test points through `memox.jit`. Nothing L depends on moves, so
   it is computed once and then read from the slot.

Predictions are checked against scikit-learn's `GaussianProcessRegressor` with the same
fixed kernel. The latency of one predict call is compared with re-factorising every call
and with a hand-written cache (the caller computes L and alpha once and passes them in).
"""

import collections
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import optax
from jaxtyping import Array, Float
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel

import memox
from memox import Memo


N, DIM, STEPS, BATCHES, BATCH, REPEATS = 1000, 2, 50, 200, 64, 20
COUNTS = collections.Counter()  # "factor": real executions of `GP.factor`
COUNTING = __name__ == "__main__"  # imported (by the benchmarks), the model counts nothing

Factors = tuple[Float[Array, "n n"], Float[Array, " n"]]


class GP(eqx.Module):
    X: Float[Array, "n d"]
    y: Float[Array, " n"]
    log_lengthscale: Float[Array, ""]
    log_signal_var: Float[Array, ""]
    log_noise_var: Float[Array, ""]
    factor_cache: Memo[Factors] = Memo()

    def kernel(self, a: Float[Array, "p d"], b: Float[Array, "q d"]) -> Float[Array, "p q"]:
        d2 = jnp.sum((a[:, None, :] - b[None, :, :]) ** 2, axis=-1)
        return jnp.exp(self.log_signal_var - 0.5 * d2 / jnp.exp(2 * self.log_lengthscale))

    # One cached method returns both L and alpha. (Two nested cached methods work too, but
    # under `grad` a cached method read twice in one call is recomputed at each read.)
    @memox.cached("factor_cache")
    def factor(self) -> Factors:
        if COUNTING:  # a host callback: once per execution, not per trace
            jax.debug.callback(lambda: COUNTS.update(["factor"]))
        noise = jnp.exp(self.log_noise_var) * jnp.eye(self.X.shape[0])
        L = jnp.linalg.cholesky(self.kernel(self.X, self.X) + noise)
        return L, jsl.cho_solve((L, True), self.y)

    def nlml(self) -> Float[Array, ""]:
        """Negative log marginal likelihood of the training targets."""
        L, alpha = self.factor()
        logdet = 2 * jnp.sum(jnp.log(jnp.diag(L)))
        return 0.5 * (self.y @ alpha + logdet + self.y.shape[0] * jnp.log(2 * jnp.pi))

    def predict(self, Xs: Float[Array, "m d"]):
        return posterior(self, *self.factor(), Xs)


def posterior(gp: GP, L, alpha, Xs):
    """Posterior mean and latent (noise-free) variance at `Xs`, given L and alpha."""
    Ks = gp.kernel(Xs, gp.X)
    v = jsl.solve_triangular(L, Ks.T, lower=True)
    return Ks @ alpha, jnp.exp(gp.log_signal_var) - jnp.sum(v**2, axis=0)


def make_gp(key: jax.Array, n: int, dim: int) -> GP:
    """`n` noisy samples of a smooth function on [-3, 3]^dim; unit lengthscale and signal
    variance, noise variance 0.1."""
    x_key, noise_key = jax.random.split(key)
    X = jax.random.uniform(x_key, (n, dim), minval=-3.0, maxval=3.0)
    noise = 0.1 * jax.random.normal(noise_key, (n,))
    y = jnp.sin(2 * X[:, 0]) + 0.5 * jnp.cos(3 * X[:, 1]) + noise
    return GP(X, y, jnp.asarray(0.0), jnp.asarray(0.0), jnp.log(jnp.asarray(0.1)))


def fit(gp: GP) -> GP:
    hyper = lambda m: (m.log_lengthscale, m.log_signal_var, m.log_noise_var)  # noqa: E731
    spec = eqx.tree_at(hyper, jax.tree.map(lambda _: False, gp), (True, True, True))
    opt = optax.adam(0.05)
    opt_state = opt.init(eqx.filter(gp, spec))  # X and y stay fixed

    def loss(diff, static):
        return memox.call(eqx.combine(diff, static), GP.nlml)  # (nlml, model) as aux

    @eqx.filter_jit
    def step(gp, opt_state):
        diff, static = eqx.partition(gp, spec)
        (value, gp), grads = eqx.filter_value_and_grad(loss, has_aux=True)(diff, static)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(gp, spec))
        return eqx.apply_updates(gp, updates), opt_state, value

    for i in range(1, STEPS + 1):
        gp, opt_state, value = step(gp, opt_state)
        if i % 10 == 0 or i == 1:
            ls, sv, nv = (float(jnp.exp(p)) for p in hyper(gp))
            hypers = f"lengthscale {ls:.3f}  signal var {sv:.3f}  noise var {nv:.4f}"
            print(f"  step {i:3d}/{STEPS}  nlml {float(value):8.2f}  {hypers}", flush=True)
    return gp


def median_ms(fns: dict) -> dict:
    """Median wall time of each zero-argument function, interleaved round by round."""
    times = collections.defaultdict(list)
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile and warm up
    for _ in range(REPEATS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def main() -> None:
    start = time.perf_counter()
    data_key, test_key = jax.random.split(jax.random.key(0))
    gp = make_gp(data_key, N, DIM)
    X, y = gp.X, gp.y  # fixed while fitting
    Xtest = jax.random.uniform(test_key, (BATCHES, BATCH, DIM), minval=-3.0, maxval=3.0)

    print(f"Fit: {STEPS} adam steps on the NLML, n = {N}, d = {DIM}, float64")
    gp = fit(gp)
    jax.effects_barrier()  # every pending callback has run
    t_fit = time.perf_counter()
    fitted = memox.stats(gp)["factor_cache"]
    assert fitted.misses == STEPS and fitted.hits == 0, fitted  # parameters always moved
    assert COUNTS["factor"] == STEPS, COUNTS

    # Serve: one factorisation (the last adam update moved the parameters), then hits.
    serve = memox.jit(GP.predict)
    preds = []
    for Xs in Xtest:
        pred, gp = serve(gp, Xs)
        preds.append(pred)
    jax.effects_barrier()
    served = memox.stats(gp)["factor_cache"]
    computed, hits = served.misses - fitted.misses, served.hits - fitted.hits
    assert computed == 1 and hits == BATCHES - 1, served
    serve_calls = COUNTS["factor"] - STEPS  # before the latency runs below factorise more
    assert serve_calls == 1, COUNTS
    t_serve = time.perf_counter()

    # Correctness: scikit-learn, same kernel and noise, hyperparameters fixed.
    ls, sv, nv = (
        float(jnp.exp(p)) for p in (gp.log_lengthscale, gp.log_signal_var, gp.log_noise_var)
    )
    kernel = ConstantKernel(sv, "fixed") * RBF(ls, "fixed")
    sk = GaussianProcessRegressor(kernel, alpha=nv, optimizer=None, normalize_y=False)
    sk_mean, sk_std = sk.fit(X, y).predict(np.asarray(Xtest).reshape(-1, DIM), return_std=True)
    mean, var = (np.concatenate([np.asarray(p[i]) for p in preds]) for i in (0, 1))
    err_mean, err_var = np.max(np.abs(mean - sk_mean)), np.max(np.abs(var - sk_std**2))
    assert err_mean < 1e-5 and err_var < 1e-5, (err_mean, err_var)

    # Latency of one predict call, side by side, on the same batch. `serve` donates the
    # slots it is given, so the memox variant threads the model it returns, as a serving
    # loop does; the other two get the model without its caches.
    bare = memox.strip(gp)
    # The two baselines run `GP.factor` under `eqx.filter_jit` outside `memox.call`, on
    # purpose: memox would warn that it computes at every call.
    warnings.filterwarnings("ignore", category=memox.UncachedWarning)
    recompute = eqx.filter_jit(GP.predict)  # outside `memox.call`: factorises every call
    L, alpha = eqx.filter_jit(GP.factor)(bare)  # the hand-written cache
    by_hand = eqx.filter_jit(posterior)
    Xs = Xtest[0]
    served_gp = [gp]

    def memox_predict():
        pred, served_gp[0] = serve(served_gp[0], Xs)
        return pred

    ms = median_ms(
        {
            "memox.jit, cached L": memox_predict,
            "recompute L every call": lambda: recompute(bare, Xs),
            "hand-written, L passed in": lambda: by_hand(bare, L, alpha, Xs),
        }
    )
    rest = memox.flops(posterior, bare, L, alpha, Xs).flops  # FLOPs of a predict that hits

    print(f"\nServe: {BATCHES} batches of {BATCH} points through memox.jit")
    print(f"  factorisations  fit {fitted.misses}, serve {computed}, then {hits} hits")
    print(f"  callback count  fit {STEPS}, serve {serve_calls}")
    print(f"  memox.stats     {served}")
    print(f"  FLOPs           {served.flops:.3e} per factorisation, {rest:.3e} per predict")
    print(f"  FLOPs saved     {served.flops_saved:.3e} (hits x flops)")
    print(f"\nvs scikit-learn  lengthscale {ls:.4f}, signal var {sv:.4f}, noise var {nv:.5f}")
    print(f"  max |mean - sklearn| {err_mean:.1e}, max |var - sklearn| {err_var:.1e}")
    print(f"\nPredict latency ({BATCH} points, median of {REPEATS}, interleaved)")
    for name, t in ms.items():
        print(f"  {name:<27} {t:8.3f} ms   {t / ms['memox.jit, cached L']:5.2f}x memox")
    total, fit_s, serve_s = time.perf_counter() - start, t_fit - start, t_serve - t_fit
    print(f"\nTotal runtime {total:.1f} s (fit {fit_s:.1f} s, serve {serve_s:.1f} s)")


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)  # to compare with scikit-learn to 1e-5
    main()
