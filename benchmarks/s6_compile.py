"""Scenario 6: traces and compile time, memox vs unmemoized, for scenarios 1-3.

Measured inside scenarios 1-3 themselves (so it costs no extra run): each variant's
first call runs under a compile probe (`jax.monitoring`'s backend-compile events) and
its step function counts its own traces for the whole run. This module only collects
and compares them:

- traces: how often the user's step was traced over the whole run (1 = never retraced);
- first call: wall time of the first call; XLA compile: the backend compile time inside
  it; trace+lower: the rest, beyond the same work in a steady call;
- memox.jit's early calls: it learns which inputs are dependencies at its first call and
  fingerprints them outside the compiled code from its third; that third call compiles
  the fingerprint for each new dependency shape (a one-time cost, listed here).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from _common import progress


# Run alone (`python benchmarks/s6_compile.py`), s6 runs these first: it reads their runs.
NEEDS = ("s1", "s2", "s3")
# (scenario, memox variant, unmemoized variant) pairs compared.
PAIRS = [
    ("s1", "memox Exact", "naive"),
    ("s1", "memox Manual", "naive"),
    ("s1", "memox.jit step", "naive"),
    ("s2", "memox.jit", "recompute"),
    ("s2", "filter_jit + memox.call", "recompute"),
    ("s3", "memox", "hand-written"),
]


def run(results: dict) -> dict | None:
    have = [s for s in ("s1", "s2", "s3") if s in results]
    if not have:
        progress("s6 compile: skipped (needs scenarios 1-3 in the same run)")
        return None
    rows = [row for s in have for row in results[s]["compile"]]
    by_name = {row["variant"]: row for row in rows}
    ratios = {}
    for scenario, memo, plain in PAIRS:
        a, b = by_name.get(f"{scenario} {memo}"), by_name.get(f"{scenario} {plain}")
        if a and b:
            ratios[f"{scenario}: {memo} / {plain}"] = {
                "first call": a["first call [s]"] / b["first call [s]"],
                "XLA compile": a["XLA compile [s]"] / b["XLA compile [s]"],
            }
    early = {}
    for scenario, name in (("s1", "memox.jit step"), ("s2", "memox.jit")):
        if scenario in results and name in results[scenario].get("early_calls_s", {}):
            early[f"{scenario} {name}"] = results[scenario]["early_calls_s"][name]
    progress(f"s6 compile: {len(rows)} variants from {', '.join(have)}")
    return {
        "id": "s6",
        "title": "Traces and compile time (first call), memox vs unmemoized",
        "sizes": {"from": have},
        "rows": rows,
        "metrics": {"ratios": ratios, "memox_jit_calls_1_to_4_s": early},
        "notes": [
            "Every timed loop traced its step exactly once (asserted in each scenario).",
            *(
                f"{k}: calls 1-4 took {', '.join(f'{1e3 * t:.1f}' for t in v)} ms (call 1 "
                "traces and compiles the step; call 2, the first to fingerprint the unchanged "
                "inputs outside, compiles that fingerprint once per dependency shape)."
                for k, v in early.items()
            ),
        ],
    }


def headline(result: dict) -> Iterator[tuple[str, str, Any]]:
    """This scenario's rows of the report's headline: (scenario, measure, value). `GOALS`
    name the measures they apply to."""
    for pair, r in result["metrics"]["ratios"].items():
        yield ("6 compile", f"first call {pair}", r["first call"])


if __name__ == "__main__":
    import _runner

    _runner.main(script=__file__)
