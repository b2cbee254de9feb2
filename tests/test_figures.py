"""Every measured figure in README.md and the docs is quoted from a benchmark record.

A quoted figure is a number written right before an HTML comment that names its record
and where the number is in it (invisible on the site and on GitHub):

    takes 1.05x<!-- fig 2026-11-28-cpu-only-s10-s1-s5: s1>loop_wall_over_hand>memox.jit step -->

- The record is a file stem in `benchmarks/results/`; its `.json` is read.
- The path is keys joined by `>`. A first key `sN` is short for `scenarios>sN>metrics`.
  In a list, a key `field=value` (several joined by `&`) picks the one dict whose fields
  have those values (`rows>variant=memox&n=64>median call [us]`); a number picks by index.
- `PATH over PATH` is the ratio of two values (`s3>run_over_hand>memox over
  s3>run_over_hand>refactorise always`), and ` * FACTOR` after the path scales the
  value (`* 1e-3`: a record's ms quoted in s).
- A range `a-b` takes two or more paths, joined by `;`: `a` is their smallest value and
  `b` their largest.
- The number must equal the value rounded to the digits shown: `1.05` is `f"{v:.2f}"`,
  `296` is `f"{v:.0f}"`, `7.0e10` is `f"{v:.1e}"`. Thousands separators (`591,424`)
  are allowed.
- Its record must be named where the reader sees it: the stem appears, outside comments,
  in the figure's paragraph (a table counts as one) or in the paragraph just before it.

A number that looks measured (followed by `x`, `µs`, `ms` or ` s`; in a table, any number
with a decimal point) and is not quoted so fails the test, so no figure goes untied. A
goal's bound (`≤ 1.05`, `>= 0.95`) is not a measurement.
Code (fenced blocks, inline code spans) is not read. docs/design.md keeps the history of
the design and docs/transformations.md copies its table word for word
(test_docs.py checks the copy), so neither is read; nor is docs/api.md, generated from
the docstrings.
"""

import json
import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if not (ROOT / "docs").is_dir() or not RESULTS.is_dir():  # an sdist: no docs, no records
    pytest.skip("docs/ or benchmarks/results/ is not in this source tree", allow_module_level=True)

NOT_READ = {"design.md", "transformations.md", "api.md"}
DOCS = [*(ROOT / "docs").glob("*.md"), *(ROOT / "docs").glob("howto/*.md")]
PAGES = [ROOT / "README.md"] + sorted(p for p in DOCS if p.name not in NOT_READ)

NUMBER = r"\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?"
FIGURE = re.compile(
    rf"(?P<lo>{NUMBER})(?:[-–](?P<hi>{NUMBER}))?\s?(?:x|µs|ms|s|MB)?"
    r"<!-- fig (?P<record>[\w.-]+): (?P<paths>.*?) -->"
)
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE = re.compile(r"^```.*?^```$|`[^`\n]*`", re.M | re.S)
# Numbers that look measured: a ratio (1.3x, 2.7-5x), a time (296 µs, 0.5 ms, 10.4 s).
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?(?:x\b|\s?(?:µs|ms)\b|\ss\b)")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![.\d])")  # not a version: 0.7.2
BOUND = re.compile(r"(?:[≤≥]|[<>]=)\s?\d+(?:\.\d+)?")


def _paragraphs(text: str) -> list[str]:
    return re.split(r"\n\s*\n", text)


def _lookup(record: dict, path: str) -> float:
    spec, _, factor = path.partition(" * ")
    if " over " in spec:
        numerator, denominator = spec.split(" over ")
        return _lookup(record, numerator) / _lookup(record, denominator) * float(factor or 1)
    keys = [k.strip() for k in spec.split(">")]
    if re.fullmatch(r"s\d+", keys[0]):
        keys = ["scenarios", keys[0], "metrics", *keys[1:]]
    node = record
    for key in keys:
        if isinstance(node, list) and "=" in key:
            want = dict(part.split("=", 1) for part in key.split("&"))
            found = [d for d in node if all(str(d.get(k)) == v for k, v in want.items())]
            assert len(found) == 1, f"{key!r} picks {len(found)} entries, not one"
            node = found[0]
        elif isinstance(node, list):
            node = node[int(key)]
        else:
            assert key in node, f"no key {key!r} (there are {sorted(node)})"
            node = node[key]
    assert isinstance(node, int | float), f"{path!r} is not a number: {node!r}"
    return node * float(factor) if factor else node


def _shown(value: float, text: str) -> str:
    """`value` rounded to the digits `text` shows, written as `text` writes it."""
    text = text.replace(",", "")
    if "e" in text:
        mantissa, exponent = f"{value:.{len(text.split('e')[0].partition('.')[2])}e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:.{len(text.partition('.')[2])}f}"


def quoted(page: pathlib.Path) -> list[tuple[str, str, str, list[str], str]]:
    """(figure, lo, hi, paths, record) of each quoted figure, with the text around it."""
    return [
        (m[0], m["lo"], m["hi"], m["paths"].split(";"), m["record"])
        for m in FIGURE.finditer(CODE.sub("", page.read_text()))
    ]


def test_there_are_quoted_figures():
    counts = {p.name: len(quoted(p)) for p in PAGES}
    assert counts["README.md"] > 0 and counts["performance.md"] > 0, counts


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_quoted_figures_match_their_records(page):
    comments = CODE.sub("", page.read_text()).count("<!-- fig ")
    wrong = (
        [] if comments == len(quoted(page)) else ["a `<!-- fig` comment with no number before it"]
    )
    for figure, lo, hi, paths, record in quoted(page):
        source = RESULTS / f"{record}.json"
        if not source.is_file():
            wrong.append(f"{figure}: no record {source.relative_to(ROOT)}")
            continue
        try:
            values = [_lookup(json.loads(source.read_text()), p) for p in paths]
        except (AssertionError, KeyError, IndexError, ValueError) as error:
            wrong.append(f"{figure}: {error}")
            continue
        if hi is None and len(values) != 1:
            wrong.append(f"{figure}: one number, {len(values)} paths (a range is `a-b`)")
        elif hi is not None and len(values) < 2:
            wrong.append(f"{figure}: a range needs two or more paths")
        elif hi is None and _shown(values[0], lo) != lo.replace(",", ""):
            wrong.append(f"{figure}: the record says {values[0]!r}")
        elif hi is not None and (_shown(min(values), lo), _shown(max(values), hi)) != (
            lo.replace(",", ""),
            hi.replace(",", ""),
        ):
            wrong.append(f"{figure}: the record says {min(values)!r} to {max(values)!r}")
    assert not wrong, f"{page.name}: figures that disagree with their records:\n" + "\n".join(
        wrong
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_quoted_figures_name_their_record(page):
    paragraphs = _paragraphs(CODE.sub("", page.read_text()))
    unnamed = []
    for i, paragraph in enumerate(paragraphs):
        visible = COMMENT.sub("", paragraph) + COMMENT.sub("", paragraphs[i - 1] if i else "")
        unnamed += [m[0] for m in FIGURE.finditer(paragraph) if m["record"] not in visible]
    assert not unnamed, f"{page.name}: figures whose record is not named beside them: {unnamed}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_measured_number_is_quoted(page):
    text = BOUND.sub("", FIGURE.sub("", CODE.sub("", page.read_text())))
    untied = [m[0] for m in MEASURED.finditer(COMMENT.sub("", text))]
    for line in COMMENT.sub("", text).splitlines():
        if line.startswith("|"):
            untied += [m[0] for m in DECIMAL.finditer(line)]
    assert not untied, (
        f"{page.name}: measured-looking numbers not quoted from a record "
        f"(write `<!-- fig RECORD: PATH -->` after each): {untied}"
    )
