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


# Pages with code to run (transformations.md and api.md have none).
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


def test_api_page_lists_every_public_name():
    # A new public name needs its `::: memox.name` entry on the API page.
    text = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: (memox(?:\.\w+)+)", text, flags=re.M))
    public = {
        f"memox.{n}"
        for n in dir(memox)
        if not n.startswith("_") and not isinstance(getattr(memox, n), types.ModuleType)
    }
    public |= {f"memox.policies.{n}" for n in ("Exact", "Drift", "Manual")}
    assert public <= documented, sorted(public - documented)
