"""Static types: what a user's type checker sees, and memox type-checks clean.

basedpyright (pinned in the `dev` extra, standard mode: `[tool.basedpyright]` in
pyproject.toml) checks `tests/typing/user_script.py`, a user's script that is never run,
and the package. Each `reveal_type` in the script must give exactly the type below, the
lines marked `# error: <rule>` must be reported with that rule (and nothing else), and
the package must have no errors. Skipped where basedpyright is not installed (CI's
oldest cell installs it).
"""

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).parent.parent
SCRIPT = ROOT / "tests" / "typing" / "user_script.py"

# Each `reveal_type(...)` line of the script, and the type basedpyright must reveal.
REVEALED = {
    # `memox.call`: the result typed by `fn`, the module by `module`.
    "reveal_type(memox.call(model, predict, b))": "tuple[Array, Model]",
    "reveal_type(x)": "Array",
    "reveal_type(memox.call(model, lambda m: m.chol()))": "tuple[Array, Model]",
    "reveal_type(memox.call(model, Model.kernel, b, lengthscale=0.5))": "tuple[Array, Model]",
    "reveal_type(memox.call(model, Model.scale)[0])": "float",
    "reveal_type(memox.call(model, solve, b))": "tuple[Array, Model]",
    # A cached method keeps its signature: from the class, the method itself, called with
    # the module first; from an instance, bound.
    "reveal_type(Model.chol)": "CachedMethod[Model, (), Array]",
    "reveal_type(Model.kernel)": (
        "CachedMethod[Model, (y: Array, *, lengthscale: float = 1), Array]"
    ),
    "reveal_type(model.chol)": "() -> Array",
    "reveal_type(model.kernel)": "(y: Array, *, lengthscale: float = 1) -> Array",
    "reveal_type(model.chol())": "Array",
    "reveal_type(Model.chol(model))": "Array",
    "reveal_type(model.scale())": "float",
    # `memox.jit` keeps `fn`'s parameters and returns `(result, module)`.
    "reveal_type(step)": "(Model, b: Array) -> tuple[Array, Model]",
    "reveal_type(step(model, b))": "tuple[Array, Model]",
    "reveal_type(memox.jit(Model.kernel)(model, b))": "tuple[Array, Model]",
    "reveal_type(memox.jit(donate=False)(Model.kernel)(model, b))": "tuple[Array, Model]",
    # The module in, the module out.
    "reveal_type(view)": "Model",
    "reveal_type(memox.init(model))": "Model",
    "reveal_type(memox.init(model, Model.kernel, b))": "Model",
    "reveal_type(memox.clear(model))": "Model",
    "reveal_type(memox.strip(model))": "Model",
    "reveal_type(memox.invalidate(model, Model.chol, when=jnp.array(True)))": "Model",
    "reveal_type(memox.stats(model))": "dict[str, SlotStats]",
    'reveal_type(memox.stats(model)["chol_cache"].hits)': "int | Array",
    'reveal_type(memox.stats(model)["chol_cache"].flops_saved)': "int | Array | None",
}


@pytest.fixture(scope="module")
def diagnostics():
    """basedpyright's diagnostics for the script and the package (one run for both)."""
    if importlib.util.find_spec("basedpyright") is None:
        pytest.skip("basedpyright is not installed (`pip install -e '.[dev]'`)")
    command = [sys.executable, "-m", "basedpyright", "--outputjson"]
    command += ["--pythonpath", sys.executable, str(SCRIPT), str(ROOT / "memox")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    try:
        return json.loads(done.stdout)["generalDiagnostics"]
    except (json.JSONDecodeError, KeyError):
        pytest.fail(f"basedpyright gave no report:\n{done.stdout}\n{done.stderr}")


def _in(path: pathlib.Path, found: list[dict]) -> list[dict]:
    return [d for d in found if pathlib.Path(d["file"]).resolve().is_relative_to(path)]


def _line(d: dict) -> int:
    return d["range"]["start"]["line"] + 1


def test_revealed_types(diagnostics):
    lines = SCRIPT.read_text().splitlines()
    revealed = {
        _line(d): re.fullmatch(r'Type of ".*" is "(.*)"', d["message"], re.S).group(1)
        for d in _in(SCRIPT, diagnostics)
        if d["severity"] == "information" and d["message"].startswith("Type of ")
    }
    where = {line.strip(): i for i, line in enumerate(lines, 1) if "reveal_type(" in line}
    assert sorted(where) == sorted(REVEALED), "every reveal_type in the script, once"
    got = {source: revealed.get(where[source]) for source in REVEALED}
    assert got == REVEALED


def test_mistakes_are_errors(diagnostics):
    lines = SCRIPT.read_text().splitlines()
    expected = [
        (i, m.group(1))
        for i, line in enumerate(lines, 1)
        if (m := re.search(r"# error: (\w+)$", line))
    ]
    assert len(expected) >= 5
    errors = [
        (_line(d), d.get("rule")) for d in _in(SCRIPT, diagnostics) if d["severity"] == "error"
    ]
    assert sorted(errors) == expected


def test_package_has_no_errors(diagnostics):
    errors = [
        f"{d['file']}:{_line(d)}: {d['message']} ({d.get('rule')})"
        for d in _in(ROOT / "memox", diagnostics)
        if d["severity"] == "error"
    ]
    assert not errors, "\n".join(errors)
