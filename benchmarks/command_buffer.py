"""Does XLA's command buffer remove the GPU stall of memox's in-graph check?

On an NVIDIA GPU every `lax.cond` is a host round trip: XLA copies the predicate to the
host and waits for the stream before it launches the branch, and conditionals are not
in XLA's default command-buffer (CUDA graph) set (FIELD-NOTES 15). memox's in-graph check
(`memox.call` inside your own `jit`) holds a `cond` per cached method; a hit decided on
the host (`memox.jit`, `memox.filter_jit`) holds none. This runs scenario s10 (a
fine-tuning loop on a frozen backbone) twice, each in a fresh process (XLA reads
`XLA_FLAGS` once, when it starts): as the environment sets `XLA_FLAGS`, and with
`--xla_gpu_enable_command_buffer=+CONDITIONAL` added, and writes each placement's median
step side by side. Where the flag removes the stall, the in-graph placements' steps
shrink towards the host-decided ones'.

    python -m benchmarks.command_buffer [--quick] [--out DIR]

Writes `<date>-<device>-command-buffer.{json,md}` to `benchmarks/results/` (or
`results/quick/` with `--quick`). On a CPU the flag is a GPU option that XLA accepts
and ignores: both runs compile the same programs (CI smoke-runs it so).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import progress


FLAG = "--xla_gpu_enable_command_buffer=+CONDITIONAL"
HERE = Path(__file__).resolve().parent
# How each of `benchmarks/s10_finetune.py`'s placements checks a hit: in the program
# (a `lax.cond`), or on the host before dispatch (no `cond`); the others cache nothing.
CHECK = {
    "eqx.filter_jit + memox.call": "in-graph (a cond)",
    "Manual, eqx.filter_jit": "in-graph (a cond)",
    "memox.filter_jit + memox.call": "on the host",
    "Manual, memox.filter_jit": "on the host",
    "memox.jit step": "on the host",
}
TIMEOUT_S = 3600


def _run_s10(xla_flags: str, quick: bool, out: Path) -> dict:
    """Scenario s10 in a fresh process with `XLA_FLAGS=xla_flags`: its JSON record."""
    env = {**os.environ, "XLA_FLAGS": xla_flags}
    command = [sys.executable, "-m", "benchmarks", "--only", "s10", "--out", str(out)]
    subprocess.run(
        command + (["--quick"] if quick else []),
        env=env,
        check=True,
        timeout=TIMEOUT_S,
        cwd=HERE.parent,
    )
    (record,) = out.glob("*.json")
    return json.loads(record.read_text())


def compare(without: dict, with_flag: dict) -> list[dict]:
    """Each placement's median step in both runs, and their ratio."""
    steps = [
        {r["variant"]: r["median step [us]"] for r in rec["scenarios"]["s10"]["rows"]}
        for rec in (without, with_flag)
    ]
    return [
        {
            "variant": name,
            "check on a hit": CHECK.get(name, "no cache"),
            "median step [us]": us,
            f"median step [us], {FLAG}": steps[1][name],
            "with / without": steps[1][name] / us,
        }
        for name, us in steps[0].items()
    ]


def markdown(rows: list[dict], without: dict, base_flags: str, command: str) -> str:
    env = without["environment"]
    columns = list(rows[0])
    out = [
        f"# XLA command buffer and memox's check: {without['date']} on {env['device']}",
        "",
        f"Command: `{command}`. Scenario s10 ({without['mode']} mode) run twice, each in a "
        f"fresh process: with `XLA_FLAGS={base_flags!r}`, and with `{FLAG}` added. JAX "
        f"{env['versions']['jax']}, memox commit {env['memox_commit']}.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        out.append("| " + " | ".join(map(_cell, row.values())) + " |")
    out += [
        "",
        "The two runs are separate processes, minutes apart: compare the in-graph rows' "
        "ratio with the others' (the same noise, no `cond` to remove).",
    ]
    if env["platform"] == "cpu":
        out.append(
            "On a CPU the flag is a GPU option that XLA ignores: both runs compile the "
            "same programs, and the ratios are noise."
        )
    return "\n".join(out) + "\n"


def _cell(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.command_buffer")
    parser.add_argument("--quick", action="store_true", help="s10's small sizes (CI)")
    parser.add_argument("--out", default=None, help="output directory")
    args = parser.parse_args(argv)
    base = os.environ.get("XLA_FLAGS", "")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in (("without", base), ("with", f"{base} {FLAG}".strip())):
            progress(f"command buffer: s10 {name} {FLAG}")
            records.append(_run_s10(flags, args.quick, Path(tmp) / name))
    rows = compare(*records)
    out_dir = Path(args.out) if args.out else HERE / "results" / ("quick" if args.quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = out_dir / f"{date}-{records[0]['environment']['device']}-command-buffer"
    command = " ".join(["python -m benchmarks.command_buffer", *argv])
    record = {"date": date, "flag": FLAG, "base_xla_flags": base, "command": command}
    record |= {"rows": rows, "runs": records}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(rows, records[0], base, command))
    for row in rows:
        progress(f"  {row['variant']}: with / without {row['with / without']:.3f}")
    progress(f"wrote {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
