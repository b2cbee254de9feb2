"""Every ```python block of the documentation pages runs.

Each page (`docs/*.md`, `docs/howto/*.md`; not `docs/design.md`, which holds no runnable
code) runs its blocks in order in one fresh namespace, so a later block uses the names
of an earlier one. Two HTML comments, invisible on the site, steer a page's run:

- `<!-- skip -->` on the line before a fence: the block is illustrative only.
- `<!-- docs-test: standard-promotion -->` anywhere in a page: its blocks run under
  `jax.numpy_dtype_promotion("standard")`, for pages using optax's `adam`/`adamw`, whose
  bias correction mixes int32 step counts with floats (as in tests/test_optax.py). The
  rest of the suite's strictness (rank promotion, warnings as errors, leak checking)
  stays on.
"""

import contextlib
import importlib
import pathlib
import re
import types

import jax
import pytest

import memox


DOCS = pathlib.Path(__file__).parent.parent / "docs"
if not DOCS.is_dir():  # an sdist holds the package and its tests, not the docs
    pytest.skip("docs/ is not part of this source tree", allow_module_level=True)

PAGES = sorted(p for p in [*DOCS.glob("*.md"), *DOCS.glob("howto/*.md")] if p.name != "design.md")
FENCE = re.compile(r"^(?P<skip><!-- skip -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S)
STANDARD_PROMOTION = "<!-- docs-test: standard-promotion -->"


def blocks(page: pathlib.Path) -> list[tuple[int, str, bool]]:
    """(number from 1, code, skipped) of each ```python block of `page`."""
    text = page.read_text()
    return [(i, m["code"], m["skip"] is not None) for i, m in enumerate(FENCE.finditer(text), 1)]


# Pages with code to run (transformations.md has none).
RUNNABLE = [p for p in PAGES if any(not skipped for _, _, skipped in blocks(p))]


def test_there_are_pages():
    names = {p.relative_to(DOCS).as_posix() for p in RUNNABLE}
    assert {"index.md", "getting-started.md", "semantics.md", "faq.md"} <= names, names


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a page writes (checkpoints) land here
    found = blocks(page)
    text = page.read_text()
    promotion = (
        jax.numpy_dtype_promotion("standard")
        if STANDARD_PROMOTION in text
        else contextlib.nullcontext()
    )
    name = page.relative_to(DOCS).as_posix()
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    with promotion:
        for number, code, skipped in found:
            if skipped:
                continue
            try:
                exec(compile(code, f"<docs/{name}, block {number}>", "exec"), namespace)
                jax.effects_barrier()  # callbacks counting executions have run
            except Exception as error:
                raise AssertionError(
                    f"docs/{name}, ```python block {number} failed: "
                    f"{type(error).__name__}: {error}"
                ) from error


def test_transformations_page_copies_the_design_table():
    # docs/transformations.md repeats the table (and known limits) of design.md's
    # "Transformations" section for the site's readers: the copy must not drift.
    design = (DOCS / "design.md").read_text()
    section = design.split("\n## Transformations\n", 1)[1].split("\n## ", 1)[0]
    table = section[section.index("| combination |") :].strip()
    page = (DOCS / "transformations.md").read_text()
    assert page[page.index("| combination |") :].strip() == table


def _public_names(module: types.ModuleType) -> set[str]:
    """`module.name` for each public non-module name of `module`."""
    return {
        f"{module.__name__}.{n}"
        for n, value in vars(module).items()
        if not n.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_api_page_lists_every_public_name():
    # A new public name needs its `::: memox.name` entry on the API page: memox's,
    # memox.policies', memox.internal's (semi-public) and memox.diffrax's.
    text = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: (memox(?:\.\w+)+)", text, flags=re.M))
    public = _public_names(memox)
    public |= _public_names(memox.policies) | _public_names(memox.internal)
    try:
        memox_diffrax = importlib.import_module("memox.diffrax")
    except ImportError:  # needs diffrax, an extra (CI's oldest cell installs it)
        pass
    else:
        public |= _public_names(memox_diffrax)
        assert {"memox.diffrax.ReuseJacobian", "memox.diffrax.ReuseState"} <= public
    assert public <= documented, sorted(public - documented)


def test_training_page_runs_a_memox_jit_step():
    # Issue 21: the training how-to says "compile the step with `memox.jit`"; it must show
    # a complete one (optax, `eqx.filter_value_and_grad` inside the function given to
    # `memox.jit`, `eqx.combine`) in a block that test_page_runs runs, not a skipped one.
    found = blocks(DOCS / "howto" / "training.md")
    runnable = [code for _, code, skipped in found if not skipped]
    assert any(
        all(part in code for part in ("memox.jit(", "filter_value_and_grad", "eqx.combine"))
        for code in runnable
    ), "docs/howto/training.md: no runnable `memox.jit` training step"
