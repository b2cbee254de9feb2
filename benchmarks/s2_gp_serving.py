"""Scenario 2: serving a Gaussian process, its Cholesky factor cached across calls.

The `GP` of `examples/gp_fit_and_serve.py`, imported from it (`GP`, `posterior`,
`make_gp`), in float32 with its initial hyperparameters: the cached method `factor`
returns L (L L^T = K + s^2 I, O(n^3)) and alpha = K^-1 y; `predict(Xs)` is the posterior
mean and variance at a batch of test points. Every predict call is its own jit call (a
serving loop), so XLA cannot hoist anything across calls.

Variants (per-call latency, interleaved call by call):

- memox.jit: `pred, gp = serve(gp, Xs)`, threading the returned model (its slots are
  donated: a hit copies nothing);
- memox.jit, donate=False: the same without donation (XLA copies the slot's table, L
  included, into a fresh output buffer on every call);
- filter_jit + memox.call: the user's own `eqx.filter_jit` returning `(pred, gp)`: the
  fingerprint of X, y and the hyperparameters is computed in-graph, and the returned
  model is copied, L included (FIELD-NOTES 1);
- recompute: `eqx.filter_jit(GP.predict)` without caches: factorises every call;
- hand-written: L and alpha computed once by the caller and passed in.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import (
    TraceCounter,
    compile_row,
    first_call,
    flops_of,
    interleaved,
    matmul_peak,
    median,
    programs,
    progress,
    rate,
    timed,
)

import memox
from examples.gp_fit_and_serve import GP, make_gp, posterior


SIZES = {
    "full": dict(n=2000, dim=2, batch=64, rounds=60),
    "quick": dict(n=500, dim=2, batch=64, rounds=15),
    "gpu": dict(n=10000, dim=2, batch=64, rounds=60),
}
HAND = "hand-written"


def run(size: dict) -> dict:
    n, batch = size["n"], size["batch"]
    progress(f"s2 GP serving: n={n}, batches of {batch} points, {size['rounds']} rounds")
    traces = TraceCounter()
    bare = make_gp(jax.random.key(0), n, size["dim"])
    Xs = jax.random.uniform(jax.random.key(1), (batch, size["dim"]), minval=-3.0, maxval=3.0)

    def counted(name, fn):
        def wrapper(*args):
            traces.tick(name)
            return fn(*args)

        return wrapper

    serve = memox.jit(counted("memox.jit", GP.predict))
    serve_copy = memox.jit(counted("memox.jit, donate=False", GP.predict), donate=False)
    user = eqx.filter_jit(
        counted("filter_jit + memox.call", lambda gp, Xs: memox.call(gp, GP.predict, Xs))
    )
    # The two baselines run `GP.factor` under `eqx.filter_jit` outside `memox.call`, on
    # purpose: memox would warn that it computes at every call.
    warnings.filterwarnings("ignore", category=memox.UncachedWarning)
    recompute = eqx.filter_jit(counted("recompute", GP.predict))
    by_hand = eqx.filter_jit(counted(HAND, posterior))
    factor = eqx.filter_jit(GP.factor)

    # Each variant's state: the model it threads (memox) or what the caller keeps.
    models = {
        "memox.jit": [bare],
        "memox.jit, donate=False": [bare],
        "filter_jit + memox.call": [memox.init(bare)],
    }
    cached = {}

    def threaded(name, fn):
        def call():
            pred, models[name][0] = fn(models[name][0], Xs)
            return pred

        return call

    def hand():
        if "L" not in cached:  # the caller computes the factor once, at its first call
            cached["L"] = factor(bare)
        return by_hand(bare, *cached["L"], Xs)

    fns = {
        "memox.jit": threaded("memox.jit", serve),
        "memox.jit, donate=False": threaded("memox.jit, donate=False", serve_copy),
        "filter_jit + memox.call": threaded("filter_jit + memox.call", user),
        "recompute": lambda: recompute(bare, Xs),
        HAND: hand,
    }

    # A plain Cholesky of the same kernel matrix (the FLOP cross-check).
    K = bare.kernel(bare.X, bare.X) + jnp.exp(bare.log_noise_var) * jnp.eye(n)
    chol = jax.jit(jnp.linalg.cholesky)
    jax.block_until_ready(chol(K))
    chol_s = median(interleaved({"chol": lambda: chol(K)}, 5)["chol"])
    chol_flops = flops_of(jnp.linalg.cholesky, K)
    factor_s = median(interleaved({"factor": lambda: factor(bare)}, 5)["factor"])

    compile_rows, early_calls = [], {}
    for name, fn in fns.items():
        _, probe = first_call(fn)
        early = [timed(fn)[1] for _ in range(3)]
        early_calls[name] = [probe["first_call_s"], *early]
        work = early[-1] + (0.0 if name == "recompute" else factor_s)
        compile_rows.append(compile_row(f"s2 {name}", probe, work, 0))
        calls = ", ".join(f"{1e3 * t:.1f}" for t in early_calls[name])
        progress(f"  s2 warm-up {name}: calls 1-4 took {calls} ms")

    times = interleaved(fns, size["rounds"])
    for row in compile_rows:
        row["traces"] = traces[row["variant"][3:]]
    assert all(traces[name] <= programs(name) for name in fns), traces.counts
    calls = 4 + size["rounds"]  # warm-up calls included: memox's counters include them
    for name in ("memox.jit", "memox.jit, donate=False", "filter_jit + memox.call"):
        st = memox.stats(models[name][0])["factor_cache"]
        assert (st.misses, st.hits) == (1, calls - 1), (name, st)

    f_factor = memox.stats(models["memox.jit"][0])["factor_cache"].flops
    f_rest = flops_of(posterior, bare, *cached["L"], Xs)
    f_user = flops_of(user, memox.init(bare), Xs)  # the in-graph check included
    per_call = {
        "memox.jit": f_rest,
        "memox.jit, donate=False": f_rest,
        "filter_jit + memox.call": f_user - f_factor,
        "recompute": flops_of(recompute, bare, Xs),
        HAND: f_rest,
    }
    # Over the timed calls plus the 4 warm-up calls: one factorisation each (not recompute).
    total = {
        name: calls * f + (0 if name == "recompute" else f_factor) for name, f in per_call.items()
    }
    med = {name: median(ts) for name, ts in times.items()}
    rows = [
        {
            "variant": name,
            "factorisations": calls if name == "recompute" else 1,
            "FLOPs per hit call": per_call[name],
            f"FLOPs, {calls} calls": total[name],
            "median call [ms]": 1e3 * med[name],
            "call / hand": med[name] / med[HAND],
            "GFLOP/s": rate(per_call[name], med[name]) / 1e9,
            "of matmul peak": rate(per_call[name], med[name]) / matmul_peak(),
        }
        for name in fns
    ]
    bound = total["recompute"] - total[HAND]
    naive_rate = rate(per_call["recompute"], med["recompute"])
    return {
        "id": "s2",
        "title": "GP serving: predict calls with a cached Cholesky factor",
        "sizes": size,
        "rows": rows,
        "metrics": {
            "flops_factor": f_factor,
            "flops_predict_rest": f_rest,
            "flops_check_in_graph": f_user - f_factor - f_rest,
            "call_over_hand": {m: med[m] / med[HAND] for m in fns},
            "recompute_over_memox_jit": med["recompute"] / med["memox.jit"],
            "saved_over_bound": {m: (total["recompute"] - total[m]) / bound for m in fns},
            "recompute_gflops": naive_rate / 1e9,
            "plain_cholesky_gflops": rate(chol_flops, chol_s) / 1e9,
            "traces": traces.counts,
        },
        "notes": [
            f"FLOP cross-check: recompute runs at {naive_rate / 1e9:.1f} GFLOP/s by the jaxpr "
            f"count, a plain jitted Cholesky of the same matrix at "
            f"{rate(chol_flops, chol_s) / 1e9:.1f} GFLOP/s (the kernel matrix build is "
            "memory-bound).",
            f"memox.jit, donate=False returns the slot (L: {n}x{n}, "
            f"{4 * n * n / 2**20:.0f} MiB) in a fresh buffer; measured: "
            f"{1e3 * (med['memox.jit, donate=False'] - med['memox.jit']):+.2f} ms per call vs "
            "donating. filter_jit + memox.call returns (copies) the whole model and hashes "
            "X, y and the hyperparameters in-graph.",
        ],
        "compile": compile_rows,
        "early_calls_s": early_calls,
        "series": {"call_seconds": {m: [float(t) for t in ts] for m, ts in times.items()}},
    }


def headline(result: dict) -> Iterator[tuple[str, str, Any]]:
    """This scenario's rows of the report's headline: (scenario, measure, value). `GOALS`
    name the measures they apply to."""
    m = result["metrics"]
    for v in ("memox.jit", "filter_jit + memox.call", "recompute"):
        yield ("2 GP serving", f"call / hand-written, {v}", m["call_over_hand"][v])
    yield (
        "2 GP serving",
        "FLOP-count cross-check: recompute / plain Cholesky [GFLOP/s]",
        f"{m['recompute_gflops']:.1f} / {m['plain_cholesky_gflops']:.1f}",
    )


if __name__ == "__main__":
    import _runner

    _runner.main(script=__file__)
