"""Writing results: the JSON record, the Markdown report and the PNG plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import matplotlib
from _common import Goal, goal_key


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402


def colour(name: str) -> str:
    """One colour per family of variants: red recomputes, blue memox, green by hand."""
    name = name.split(" [")[0]
    for prefix, c in (
        ("memox Manual", "tab:cyan"),
        ("memox.jit step", "tab:purple"),
        ("memox.jit, donate", "tab:purple"),
        ("scan: memox", "tab:blue"),
        ("memox", "tab:blue"),
        ("filter_jit + memox", "tab:purple"),
        ("scan: naive", "tab:red"),
        ("naive", "tab:red"),
        ("recompute", "tab:red"),
        ("refactorise", "tab:red"),
        ("filter_jit, unmemoized", "tab:red"),
        ("unmemoized", "tab:red"),
        ("hand-written, model step", "tab:olive"),
        ("hand-written, blocked", "tab:olive"),
        ("scan: hand", "tab:green"),
        ("hand", "tab:green"),
        ("nnx", "tab:orange"),
        ("jax.jit", "black"),
    ):
        if name.startswith(prefix):
            return c
    return "tab:gray"


def _fmt(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return "" if x is None else str(x)
    if isinstance(x, int):
        return f"{x:,}" if abs(x) >= 10_000 else str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return ""
        if x == 0:
            return "0"
        if abs(x) >= 1e5 or abs(x) < 1e-3:
            return f"{x:.3e}"
        if abs(x) >= 100:
            return f"{x:.0f}"
        return f"{x:.3g}" if abs(x) < 1 else f"{x:.3f}".rstrip("0").rstrip(".")
    return str(x)


def table(rows: list[dict]) -> str:
    if not rows:
        return ""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def goal_cell(goal: Goal | None, value: Any) -> str:
    """What a headline row says of its goal: the target, met or not, the measured value,
    and for an unmet goal the reason its scenario gives."""
    if goal is None:
        return ""
    cell = f"goal: {goal.op} {_fmt(goal.bound)}"
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        return f"{cell} — not measured"
    if goal.met(value):
        return f"{cell} — met (measured {_fmt(value)})"
    reason = goal.unmet or "the scenario gives no reason"
    return f"{cell} — **unmet** (measured {_fmt(value)}): {reason}"


_S12_REF = "eqx.filter_jit, unmemoized"


def headline(results: dict, scenarios: dict[str, ModuleType]) -> list[dict]:
    """The few ratios worth a glance, each with its goal where its scenario declares one.
    `scenarios`: the scenario modules by key; each names its rows (`headline(result)`)
    and their goals (`GOALS`)."""
    rows = []
    for key, module in scenarios.items():
        result = results.get(key)
        if not result or not hasattr(module, "headline"):
            continue
        declared: dict[str, Goal] = getattr(module, "GOALS", {})
        used = set()
        for scenario, measure, value in module.headline(result):
            found = goal_key(declared, measure)
            used.add(found)
            goal = None if found is None else declared[found]
            rows.append(
                {
                    "scenario": scenario,
                    "measure": measure,
                    "value": value,
                    "goal": goal_cell(goal, value),
                }
            )
        # A declared goal that no row matches has lost its measure (a renamed variant).
        lost = set(declared) - used
        if lost:
            raise ValueError(f"{key}'s goals that match no headline measure: {sorted(lost)}")
    return rows


def markdown(record: dict, plots: list[str]) -> str:
    env = record["environment"]
    out = [
        f"# memox benchmarks: {record['date']} on {env['device']}",
        "",
        f"Command: `{env['command']}` ({record['mode']} mode, {record['runtime_s']:.0f} s). "
        f"JAX {env['versions']['jax']}, jaxlib {env['versions']['jaxlib']}, Equinox "
        f"{env['versions']['equinox']}, memox {env['versions']['memox']} "
        f"(commit {env['memox_commit']}), {env['cpu_count']} CPU cores, load average "
        f"{env['loadavg_start']} at start, OPENBLAS_NUM_THREADS={env['OPENBLAS_NUM_THREADS']}.",
        "",
        "Every ratio is measured side by side in this run (variants interleaved, medians).",
        *(
            [
                f"`of matmul peak`: achieved FLOP/s over a plain float32 matrix product's on this "
                f"device, {peak:.1f} GFLOP/s."
            ]
            if (peak := env.get("matmul_peak_gflops"))
            else []
        ),
        "",
        "## Headline",
        "",
        table(record["headline"]),
        "",
    ]
    for key, res in record["scenarios"].items():
        if not res:
            continue
        out += [f"## {key}: {res['title']}", "", f"Sizes: `{json.dumps(res['sizes'])}`", ""]
        out += [table(res["rows"]), ""]
        for name, rows in res.get("tables", {}).items():
            out += [f"**{name}**", "", table(rows), ""]
        if res.get("compile") and key != "s6":
            out += ["Compile rows are collected in s6.", ""]
        out += [f"- {note}" for note in res.get("notes", [])]
        out += [""]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(out)


def _cumulative(ax, series: dict, title: str) -> None:
    for name, flops in series.items():
        c = np.cumsum(flops)
        dashed = any(w in name for w in ("Manual", "model step", "blocked", "jit step"))
        ax.plot(
            np.arange(1, len(c) + 1),
            c,
            label=name,
            color=colour(name),
            linestyle="--" if dashed else "-",
            lw=1.6,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cumulative FLOPs executed")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _excess(ax, series: dict, base: str, title: str) -> None:
    """Cumulative FLOPs beyond the hand-written optimum (log scale)."""
    ref = np.cumsum(series[base])
    for name, flops in series.items():
        if name == base:
            continue
        extra = np.cumsum(flops) - ref
        if np.all(extra <= 0):
            continue
        ax.plot(
            np.arange(1, len(extra) + 1),
            np.where(extra > 0, extra, np.nan),
            label=name,
            color=colour(name),
            lw=1.6,
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"cumulative FLOPs beyond '{base}'")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def plot(record: dict, stem: Path) -> list[str]:
    paths = []
    sc = record["scenarios"]
    if sc.get("s1"):
        s, m = sc["s1"]["sizes"], sc["s1"]["metrics"]
        series = sc["s1"]["series"]["step_flops"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        saved = ", ".join(
            f"{k.replace('memox ', '')} {v:.4f}"
            for k, v in m["saved_over_bound"].items()
            if k.startswith("memox")
        )
        _cumulative(
            a,
            series,
            f"s1: frozen eigh, n={s['n']}, {s['steps']} adamw steps\nFLOPs saved / bound: {saved}",
        )
        _excess(b, series, "hand-written", "s1: FLOPs beyond the hand-written optimum")
        paths.append(_save(fig, stem, "s1-cumulative-flops"))

        fig, ax = plt.subplots(figsize=(8, 4.8))
        for name, ts in sc["s1"]["series"]["step_seconds"].items():
            ax.plot(
                np.arange(1, len(ts) + 1),
                1e3 * np.asarray(ts),
                label=name,
                color=colour(name),
                lw=1,
            )
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("wall time of the step [ms]")
        ax.set_title(
            "s1: wall time per step (step 1 computes the eigenbasis in every variant)", fontsize=10
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, stem, "s1-step-time"))
    if sc.get("s4"):
        series = sc["s4"]["series"]["step_flops"]
        fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4.2))
        for ax, (k, d) in zip(np.atleast_1d(axes), series.items()):
            _cumulative(ax, d, f"s4: dependency changes every {k.split('=')[1]} steps")
        paths.append(_save(fig, stem, "s4-cumulative-flops"))
    if sc.get("s12"):
        paths.append(_scaling_plot(sc["s12"], stem))
    panels = _wall_panels(sc)
    if panels:
        cols = 3
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(16, 4.6 * rows))
        axes = np.atleast_1d(axes).ravel()
        for ax, (title, unit, values) in zip(axes, panels):
            names = list(values)
            ax.barh(names, [values[n] for n in names], color=[colour(n) for n in names])
            spread = max(values.values()) / max(min(values.values()), 1e-12)
            if spread > 20:  # log scale only where it is needed to see the small bars
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel(unit)
            ax.set_title(title, fontsize=10)
            ax.tick_params(axis="y", labelsize=7)
            ax.invert_yaxis()
            ax.grid(True, axis="x", which="both", alpha=0.3)
            for i, n in enumerate(names):
                ax.text(values[n], i, f" {values[n]:.3g}", va="center", fontsize=7)
        for ax in axes[len(panels) :]:
            ax.axis("off")
        fig.suptitle(
            "Wall time per step or call (medians; log scale where the spread is wide; red "
            "recomputes, blue/purple memox, green hand-written)"
        )
        paths.append(_save(fig, stem, "wall-per-step"))
    return paths


def _scaling_plot(s12: dict, stem: Path) -> str:
    """s12: µs per call against leaves and against slots, first-call wall time, and a
    hit's time against the hand-hoisted step's as the cached value grows."""
    sweeps = s12["metrics"]["sweeps"]
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.6))
    for ax, sweep in zip(axes[:2], ("leaves", "slots")):
        ns = sorted(sweeps[sweep], key=int)
        for v, marker in zip(sweeps[sweep][ns[0]]["per_call_us"], "osD^"):
            ys = [sweeps[sweep][n]["per_call_us"][v] for n in ns]
            ax.plot([int(n) for n in ns], ys, marker + "-", label=v)
        ax.set_yscale("log")
        fixed = "1 slot" if sweep == "leaves" else f"{s12['sizes']['slot_leaves']} leaves"
        _log_x_panel(ax, sweep, "median µs per call", f"s12: µs per call vs {sweep} ({fixed})")
    ax = axes[2]
    for sweep, style in (("leaves", "o-"), ("slots", "s--")):
        ns = sorted(sweeps[sweep], key=int)
        for v in ("memox.jit", _S12_REF):
            ys = [sweeps[sweep][n]["first_call_s"][v] for n in ns]
            ax.plot([int(n) for n in ns], ys, style, label=f"{v} ({sweep})")
    _log_x_panel(ax, "leaves or slots", "first call (trace + compile) [s]", "s12: first call")
    ax = axes[3]
    by_mb = sweeps.get("value", {})
    mbs = sorted(by_mb, key=int)
    for v, marker in zip(by_mb[mbs[0]]["per_call_us"] if mbs else (), "osD^"):
        ys = [by_mb[n]["per_call_us"][v] / by_mb[n]["per_call_us"]["hand-hoisted"] for n in mbs]
        ax.plot([int(n) for n in mbs], ys, marker + "-", label=v)
    ax.axhline(1.05, color="gray", linestyle=":", label="goal 1.05")
    title = "s12: a hit as the cached value grows (matmul reads it)"
    _log_x_panel(ax, "cached value [MB]", "µs per call / hand-hoisted", title)
    return _save(fig, stem, "s12-scaling")


def _log_x_panel(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """A panel's x axis in log scale, its labels, title, grid and legend."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _wall_panels(sc: dict) -> list[tuple[str, str, dict]]:
    panels = []
    if sc.get("s1"):
        rows = sc["s1"]["rows"]
        panels.append(
            ("s1 training step", "ms", {r["variant"]: r["median step [ms]"] for r in rows})
        )
    if sc.get("s2"):
        panels.append(
            (
                "s2 GP predict call",
                "ms",
                {r["variant"]: r["median call [ms]"] for r in sc["s2"]["rows"]},
            )
        )
    if sc.get("s3"):
        panels.append(
            (
                "s3 ODE run (whole scan)",
                "ms",
                {r["variant"]: r["median run [ms]"] for r in sc["s3"]["rows"]},
            )
        )
    if sc.get("s4"):
        panels.append(
            ("s4 scan step", "ms", {r["variant"]: r["per step [ms]"] for r in sc["s4"]["rows"]})
        )
    if sc.get("s5"):
        panels.append(
            (
                "s5 dispatch",
                "us per call",
                {
                    f"{r['variant']} [{r['model'].split(' (')[0]}]": r["median call [us]"]
                    for r in sc["s5"]["rows"]
                },
            )
        )
    if sc.get("s11"):
        for label in sc["s11"]["metrics"]:
            rows = [r for r in sc["s11"]["rows"] if r["size"] == label]
            panels.append(
                (
                    f"s11 neural-ODE training step, {label}",
                    "ms",
                    {r["variant"]: r["median step [ms]"] for r in rows},
                )
            )
    if sc.get("s13"):
        panels.append(
            (
                "s13 scan over layers, training step",
                "ms",
                {
                    f"{r['variant']} [{r['layers']} layers]": r["median step [ms]"]
                    for r in sc["s13"]["rows"]
                    if "median step [ms]" in r
                },
            )
        )
    return panels


def _save(fig, stem: Path, name: str) -> str:
    fig.tight_layout()
    path = f"{stem}-{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(record: dict, out_dir: Path, stem_name: str) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / stem_name
    plots = plot(record, stem)
    record["plots"] = [os.path.basename(p) for p in plots]
    with open(f"{stem}.json", "w") as f:
        json.dump(record, f, indent=1, default=_default)
    with open(f"{stem}.md", "w") as f:
        f.write(markdown(record, plots))
    return [f"{stem}.json", f"{stem}.md", *plots]


def render(path: Path, scenarios: dict[str, ModuleType]) -> list[str]:
    """Rewrite a recorded run's headline (in its JSON record) and its Markdown report
    from the record, with the `scenarios`' current rows and goals; the measurements and
    the plots are left as they are."""
    record = json.loads(path.read_text())
    record["headline"] = headline(record["scenarios"], scenarios)
    path.write_text(json.dumps(record, indent=1, default=_default))
    report = path.with_suffix(".md")
    report.write_text(markdown(record, record.get("plots", [])))
    return [str(path), str(report)]


def _default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)
