"""Run memox's benchmarks: `python -m benchmarks [--quick | --gpu] [--only s1,s4] [--out DIR]`,
or one scenario as a script: `python benchmarks/s1_frozen_training.py [--quick | --gpu]`.

Writes `<date>-<device>.json`, `.md` and `-*.png` to `benchmarks/results/` (full mode)
or `benchmarks/results/quick/` (`--quick`; git-ignored, for CI's smoke run).
`--render RECORD.json` runs nothing: it rewrites a recorded run's headline and Markdown
report from its JSON record, with the scenarios' current metrics and goals (each
scenario's `headline` and `GOALS`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import _report
import jax
from _common import matmul_peak, progress


SCENARIOS = {
    "s1": "s1_frozen_training",
    "s2": "s2_gp_serving",
    "s3": "s3_stiff_jacobian",
    "s4": "s4_changing_dependency",
    "s5": "s5_dispatch",
    "s6": "s6_compile",
    "s7": "s7_memory",
    "s8": "s8_grad_scan",
    "s9": "s9_diffrax",
    "s10": "s10_finetune",
    "s11": "s11_neural_ode",
    "s12": "s12_scaling",
    "s13": "s13_scan_layers",
}
HERE = Path(__file__).resolve().parent


def device_name() -> str:
    device = jax.devices()[0]
    name = getattr(device, "device_kind", "") or device.platform
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or device.platform


def environment(argv: list[str]) -> dict:
    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    def git(*args: str) -> str:
        run = subprocess.run(
            ["git", "-C", str(HERE.parent), *args], capture_output=True, text=True, check=True
        )
        return run.stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "memox")
        commit += " + uncommitted changes in memox/" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    device = jax.devices()[0]
    return {
        "device": device_name(),
        "device_kind": getattr(device, "device_kind", ""),
        "platform": device.platform,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "versions": {
            pkg: version(pkg)
            for pkg in ("jax", "jaxlib", "equinox", "memox", "optax", "flax", "numpy")
        },
        "memox_commit": commit,
        "command": " ".join(["python -m benchmarks", *argv]),
        "executable": sys.executable,
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None, script: str | None = None) -> None:
    """Run the benchmarks `argv` asks for; with `script`, a scenario's file, that one
    scenario (and those it needs: s6 reads s1-s3's runs)."""
    argv = sys.argv[1:] if argv is None else argv
    prog = f"python {os.path.relpath(script)}" if script else "python -m benchmarks"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="sizes for a GPU (s1 n=4096, s2 n=10000, s10 a 53 M-parameter backbone; the "
        "others their full sizes); chosen without the flag when JAX's default backend is "
        "a GPU",
    )
    if script is None:
        parser.add_argument("--only", default="", help="comma-separated scenarios, e.g. s1,s4")
    parser.add_argument("--out", default=None, help="output directory")
    parser.add_argument(
        "--render",
        default=None,
        metavar="RECORD.json",
        help="run nothing: rewrite a recorded run's headline and Markdown report from its "
        "JSON record, with the scenarios' current goals",
    )
    args = parser.parse_args(argv)
    modules = {key: importlib.import_module(name) for key, name in SCENARIOS.items()}
    if args.render:
        files = _report.render(Path(args.render), modules)
        progress(f"rewrote {', '.join(files)}")
        return
    gpu = args.gpu or jax.default_backend() == "gpu"
    mode = "quick" if args.quick else "gpu" if gpu else "full"
    if script is None:
        chosen = [s.strip() for s in args.only.split(",") if s.strip()] or list(SCENARIOS)
    else:
        (key,) = [k for k, name in SCENARIOS.items() if name == Path(script).stem]
        chosen = [*getattr(modules[key], "NEEDS", ()), key]
        argv = [*argv, "--only", ",".join(chosen)]  # the run, as the record states it
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {list(SCENARIOS)}")
    out_dir = Path(args.out) if args.out else HERE / "results" / ("quick" if args.quick else "")
    start = time.perf_counter()
    env = environment(argv)
    progress(
        f"memox benchmarks, {mode} mode, on {env['device']} ({env['platform']}); "
        f"writing to {out_dir}"
    )

    sizes = {
        key: mod.SIZES.get(mode, mod.SIZES["full"])
        for key, mod in modules.items()
        if hasattr(mod, "SIZES")
    }
    results: dict = {}
    for key in chosen:
        t0 = time.perf_counter()
        if key == "s6":
            results[key] = modules[key].run(results)
        elif key == "s7":
            results[key] = modules[key].run(sizes)
        else:
            results[key] = modules[key].run(sizes[key])
        progress(f"{key} done in {time.perf_counter() - t0:.1f} s")

    env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    env["matmul_peak_gflops"] = matmul_peak() / 1e9  # (what `of matmul peak` divides by)
    record = {
        "date": datetime.date.today().isoformat(),
        "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": mode,
        "runtime_s": time.perf_counter() - start,
        "environment": env,
        "sizes": sizes,
        "scenarios": results,
    }
    record["headline"] = _report.headline(results, modules)
    stem = f"{record['date']}-{env['device']}"
    if chosen != list(SCENARIOS):  # a partial run never overwrites a complete one
        stem += "-only-" + "-".join(chosen)
    files = _report.write(record, out_dir, stem)
    print(_report.table(record["headline"]))
    progress(f"done in {record['runtime_s']:.1f} s; wrote {', '.join(files)}")
