"""What a `jax.debug.callback` inside a cached method costs a step that hits.

A side measurement, not a scenario of `python -m benchmarks` (it records nothing):
`python -m benchmarks.callback_dispatch [--rounds R]`. The model is scenario 5's (a
20-layer MLP of width 32, 40 parameter leaves, `W0 / |W0|` cached), its slot filled;
every timed step is a hit. Each step is compiled twice, from the same method with and
without `jax.debug.callback(lambda: None)` in it, and timed side by side (interleaved,
median). The callback lies in the `cond`'s miss branch, which a hit does not run; the
control is plain `jax.jit` of a function of the same 40 arrays with a callback in a
`lax.cond` branch that is not taken.

Two figures per variant: the median step (call to `jax.block_until_ready`), and the
median time until the call *returns*. Then the same control with a 1000 x 1000 matrix
product after the `cond` (~20 ms of work): without a callback the call returns once the
program is enqueued; with one, JAX runs the program from its Python dispatch path (no
C++ fast path for a program with effects, `pjit._get_fastpath_data`) and, measured on
XLA:CPU, the call returns only when the program has run: Python no longer overlaps the
next step's work with this one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import median
from jax import lax
from s5_dispatch import SIZES, Cached, Plain

import memox


class Counted(Cached):
    @memox.cached("weight_cache")
    def weight(self) -> jax.Array:
        jax.debug.callback(lambda: None)
        return Plain.weight(self)


def _step(cls: type[Cached]) -> Callable[[Cached, jax.Array], jax.Array]:
    return lambda m, x: cls.__call__(m, x)


def variants(states: list[dict[str, Cached]]) -> dict[str, Callable[[], Any]]:
    size = SIZES["full"]
    mlp = eqx.nn.MLP(
        size["width"], size["width"], size["width"], size["depth"], key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (size["batch"], size["width"]))
    fns: dict[str, Callable[[], Any]] = {}
    for cls, tag in ((Cached, "no callback"), (Counted, "callback in the method")):
        for wrapper, compiled in (
            ("memox.jit", memox.jit(_step(cls))),
            (
                "eqx.filter_jit(memox.call)",
                eqx.filter_jit(lambda m, x, f=_step(cls): memox.call(m, f, x)),
            ),
        ):
            state = {"m": memox.init(cls(mlp, None), _step(cls), x)}
            states.append(state)

            def call(state=state, compiled=compiled):
                y, state["m"] = compiled(state["m"], x)
                return y

            fns[f"{wrapper}, {tag}"] = call
    flat = jax.tree.leaves(eqx.filter(mlp, eqx.is_array))
    for callback, tag in ((False, "no callback"), (True, "callback in an untaken branch")):

        def taken(xs, callback=callback):
            if callback:
                jax.debug.callback(lambda: None)
            return [2 * a for a in xs]

        control = jax.jit(lambda p, xs, taken=taken: lax.cond(p, taken, list, xs)[0] @ x.T)
        fns[f"jax.jit control, {tag}"] = lambda control=control: control(jnp.bool_(False), flat)
    return fns


def heavy() -> dict[str, Callable[[], Any]]:
    """The control with ~20 ms of work after the `cond`: does the call wait for it?"""
    a, fns = jnp.ones((1000, 1000)), {}
    for callback, tag in ((False, "no callback"), (True, "callback in an untaken branch")):

        def taken(a, callback=callback):
            if callback:
                jax.debug.callback(lambda: None)
            return a + 1

        f = jax.jit(lambda p, a, taken=taken: lax.cond(p, taken, lambda a: a, a) @ a)
        fns[f"1000 x 1000 product, {tag}"] = lambda f=f: f(jnp.bool_(False), a)
    return fns


def measure(fns: dict[str, Callable[[], Any]], rounds: int) -> None:
    """Print each function's median step and median time until its call returns."""
    step: dict[str, list[float]] = {n: [] for n in fns}
    returned: dict[str, list[float]] = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            out = fns[name]()
            back = time.perf_counter()
            jax.block_until_ready(out)
            step[name].append(time.perf_counter() - start)
            returned[name].append(back - start)
    for name in names:
        print(f"{name:50s} {1e6 * median(step[name]):10.0f} {1e6 * median(returned[name]):19.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400, help="interleaved rounds (default 400)")
    args = parser.parse_args(argv)
    states: list[dict[str, Cached]] = []
    fns, big = variants(states), heavy()
    for fn in [*fns.values(), *big.values()]:  # compile, fill the slots
        for _ in range(3):
            jax.block_until_ready(fn())
    print(f"{'variant':50s} {'step [us]':>10s} {'returns after [us]':>19s}")
    measure(fns, args.rounds)
    measure(big, max(args.rounds // 20, 5))
    for state in states:  # one fill, then hits only
        stats = memox.stats(state["m"])["weight_cache"]
        assert stats.misses == 1 and stats.hits >= args.rounds, stats
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; every memox step a hit")


if __name__ == "__main__":
    main()
