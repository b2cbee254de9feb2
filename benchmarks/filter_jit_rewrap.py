"""A function wrapped again at every call: `memox.filter_jit(f)(x, y)` in a loop, as
`eqx.filter_jit(m.method)(y)` or a wrapper made inside a function called often are.

Equinox compiles one program per function object (or name, for any other callable),
whatever wraps it; so must memox's drop-in. This prints, for both, the traces and the
median wall time of one wrapping plus one call, against a call of one kept wrapper:

    python -m benchmarks.filter_jit_rewrap [--quick]

Fair: the same function, arguments and loop for both; the first round (compilation) is
left out of the medians; the calls alternate between the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import memox


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (CI's smoke run)")
    calls = 21 if parser.parse_args().quick else 400
    traces = {"eqx.filter_jit": 0, "memox.filter_jit": 0}
    jits = {"eqx.filter_jit": eqx.filter_jit, "memox.filter_jit": memox.filter_jit}

    def function(name: str):
        def f(x, y):
            traces[name] += 1
            return jnp.tanh(x @ y) + 1

        return f

    functions = {name: function(name) for name in jits}
    kept = {name: jit(functions[name]) for name, jit in jits.items()}
    x, y = jnp.ones((64, 64)), jnp.ones((64, 64))
    times: dict[str, list[float]] = {f"{n}, {k}": [] for n in jits for k in ("again", "kept")}
    for i in range(calls + 1):
        for name, jit in jits.items():
            for kind in ("again", "kept"):
                start = time.perf_counter()
                wrapped = jit(functions[name]) if kind == "again" else kept[name]
                jax.block_until_ready(wrapped(x, y))
                if i:
                    times[f"{name}, {kind}"].append(time.perf_counter() - start)
    print(f"jax {jax.__version__}, equinox {eqx.__version__}, {jax.devices()[0].device_kind}")
    for key, ts in times.items():
        name = key.split(",")[0]
        print(f"{key:28s} {1e3 * statistics.median(ts):7.3f} ms per call, traces {traces[name]}")


if __name__ == "__main__":
    main()
