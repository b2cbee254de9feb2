"""Scenario 7: memory. Bytes a slot holds beyond its cached value, and the compiled
memory of scenario 1's step (`Compiled.memory_analysis()`).

A slot's leaves (`memox.Memo`): `value` (the cached value's bits, per table entry),
`valid`, `key` (64-bit fingerprint), `age`, `used`, `snapshot` (Drift only: a copy of
the dependencies, per entry), `hits`, `misses`. Everything but `value` is overhead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import s1_frozen_training as s1
import s2_gp_serving as s2
import s3_stiff_jacobian as s3
import s4_changing_dependency as s4
from _common import progress, slot_bytes

import memox
from memox import Memo


class Table(eqx.Module):
    """An argument-keyed table of 8 entries (`Memo(size=8)`), for comparison."""

    w: jax.Array
    table: Memo[jax.Array] = Memo(size=8)

    @memox.cached("table")
    def scaled(self, x: jax.Array) -> jax.Array:
        return self.w * x


def slots(sizes: dict) -> list[dict]:
    n1, n2, n4 = sizes["s1"]["n"], sizes["s2"]["n"], sizes["s4"]["n"]
    laplacian, _, _ = s1.graph_problem(n1)
    head = eqx.nn.MLP(sizes["s1"]["k"], 1, 8, 1, key=jax.random.key(0))
    with jax.enable_x64(True):
        newton = memox.init(s3.NewtonMatrix(jnp.asarray(s3.Y0), jnp.asarray(0.0)), s3.newton_lu)
        newton_rows = [
            (f"s3 NewtonMatrix.{f} ({p})", getattr(newton, f"{f}_cache"))
            for f, p in (("jac", "Manual"), ("lu", "Drift"))
        ]
        newton_rows = [(name, slot_bytes(slot)) for name, slot in newton_rows]
    solver = s4.Solver(jnp.zeros((n4, 2)), jnp.asarray(0.0), jnp.asarray(0.0))
    table = memox.init(Table(jnp.ones((256,))), Table.scaled, jnp.asarray(2.0))
    k = sizes["s1"]["k"]
    models = [
        (
            f"s1 ExactNet.eigenbasis (n={n1})",
            memox.init(s1.ExactNet(laplacian, head, k)).basis_cache,
        ),
        (
            f"s1 ManualNet.eigenbasis (n={n1})",
            memox.init(s1.ManualNet(laplacian, head, k)).basis_cache,
        ),
        (f"s2 GP.factor (n={n2})", memox.init(s2.make_gp(jax.random.key(0), n2, 2)).factor_cache),
        (f"s4 Solver.factor (n={n4})", memox.init(solver).factor_cache),
        ("Table.scaled, Memo(size=8)", table.table),
    ]
    rows = []
    for name, b in [(name, slot_bytes(slot)) for name, slot in models] + newton_rows:
        overhead = sum(b.values()) - b["value"]
        rows.append(
            {"slot": name, **{f"{k} [B]": v for k, v in b.items()}, "overhead [B]": overhead}
        )
    return rows


def step_memory(size: dict) -> list[dict]:
    setup = s1.build(size)
    rows = []
    for name, variant in setup.variants.items():
        if name == "memox.jit step":
            continue  # memox.jit's compiled function is internal (no `.lower`)
        stats = variant.jitted.lower(*variant.args(variant.initial())).compile()
        m = stats.compiled.memory_analysis()
        rows.append(
            {
                "s1 step": name,
                "argument [MiB]": m.argument_size_in_bytes / 2**20,
                "output [MiB]": m.output_size_in_bytes / 2**20,
                "alias [MiB]": m.alias_size_in_bytes / 2**20,
                "temp [MiB]": m.temp_size_in_bytes / 2**20,
                "peak [MiB]": getattr(m, "peak_memory_in_bytes", 0) / 2**20,
            }
        )
    return rows


def run(sizes: dict) -> dict:
    progress("s7 memory: slot overhead and scenario 1's compiled memory")
    slot_rows = slots(sizes)
    mem_rows = step_memory(sizes["s1"])
    naive = next(r for r in mem_rows if r["s1 step"] == "naive")
    return {
        "id": "s7",
        "title": "Memory: bytes per slot beyond the cached value; compiled memory of s1's step",
        "sizes": {k: sizes[k] for k in ("s1", "s2", "s4")},
        "rows": slot_rows,
        "tables": {"s1 step memory (Compiled.memory_analysis)": mem_rows},
        "metrics": {
            "slot_overhead_bytes": {r["slot"]: r["overhead [B]"] for r in slot_rows},
            "s1_temp_over_naive": {
                r["s1 step"]: r["temp [MiB]"] / naive["temp [MiB]"] for r in mem_rows
            },
        },
        "notes": [
            "Overhead of an Exact or Manual slot: valid, key, age, used, hits, misses "
            "(a few dozen bytes); a Drift slot also snapshots its dependencies per entry.",
            "memox.jit's step is not listed: its compiled function is internal to memox.",
        ],
    }


def headline(result: dict) -> Iterator[tuple[str, str, Any]]:
    """This scenario's rows of the report's headline: (scenario, measure, value). `GOALS`
    name the measures they apply to."""
    for slot, b in result["metrics"]["slot_overhead_bytes"].items():
        if slot.startswith(("s1 Exact", "s3 NewtonMatrix.lu", "Table")):
            yield ("7 memory", f"slot overhead [B], {slot}", b)


if __name__ == "__main__":
    import _runner

    _runner.main(script=__file__)
