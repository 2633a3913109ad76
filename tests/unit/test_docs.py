"""The docs: the settings page matches the schema, every relative link resolves, the layout
map names every package, and every measured figure a page quotes is in BENCHMARKS.md.

Links are read from README.md and docs/**/*.md without Sphinx (`make docs` checks the site
again, warnings as errors): a link's file must exist, and its `#anchor` must be a heading of
that page under the GitHub/MyST slug rule, or a MyST label `(name)=`. Links to http(s) and
mailto addresses are not followed.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
FENCE = re.compile(r"^\s*(```+|~~~+)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LABEL = re.compile(r"^\(([^()\s]+)\)=\s*$")
# [text](target) and ![alt](target); the text may hold one level of brackets or `code`
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s|$)")
INCLUDE = re.compile(r"^```+\{(?:include|literalinclude|image|figure)\}\s+(\S+)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "docs_settings", ROOT / "scripts" / "docs_settings.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in found if "_build" not in p.relative_to(ROOT).parts]


def prose(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a fence) of every line; a fence's own lines count as inside."""
    lines, fence = [], ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if fence:
            lines.append((number, line, True))
            close = re.fullmatch(r"\s*(`{3,}|~{3,})\s*", line)
            if close and close.group(1)[0] == fence[0] and len(close.group(1)) >= len(fence):
                fence = ""
        elif match := FENCE.match(line):
            fence = match.group(1)
            lines.append((number, line, True))
        else:
            lines.append((number, line, False))
    return lines


def github_slug(title: str) -> str:
    """MyST's `github_slugify` (myst_parser.slugs), which is GitHub's rule."""
    return re.sub(r"[^\w\u4e00-\u9fff\- ]", "", title.lower().replace(" ", "-"))


def heading_text(source: str) -> str:
    """The text of a heading's Markdown: links become their text, code and emphasis marks go."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", source)
    text = re.sub(r"(?<!\\)`+", "", text)
    text = re.sub(r"(?<![\w\\])[*_]+|[*_]+(?!\w)", "", text)
    return re.sub(r"\\(.)", r"\1", text)


def anchors(path: Path) -> set[str]:
    """The ids a link may name in a page: its headings' slugs (deduplicated as GitHub and MyST
    do: x, x-1, x-2) and its MyST labels."""
    found: set[str] = set()
    for _, line, fenced in prose(path):
        if fenced:
            continue
        if label := LABEL.match(line):
            found.add(label.group(1))
        elif heading := HEADING.match(line):
            slug = base = github_slug(heading_text(heading.group(2)))
            n = 1
            while slug in found:
                slug, n = f"{base}-{n}", n + 1
            if slug:
                found.add(slug)
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link, image, reference definition and include of a page."""
    found = []
    for number, line, fenced in prose(path):
        if fenced:
            if include := INCLUDE.match(line.strip()):
                found.append((number, include.group(1)))
            continue
        text = re.sub(r"(`+).*?\1", "", line)  # code spans hold examples, not links
        found += [(number, m.group(1)) for m in LINK.finditer(text)]
        if reference := REFERENCE.match(text):
            found.append((number, reference.group(1)))
    return found


def broken(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if EXTERNAL.match(target):
            continue
        file, _, anchor = target.partition("#")
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            problems.append(f"{where}: no file {resolved.relative_to(ROOT)}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading or label '{anchor}' in {resolved.name}")
    return problems


def test_committed_settings_page_is_current():
    generator = load_generator()
    committed = generator.PAGE.read_text()
    assert committed == generator.generate(), (
        "docs/reference/settings.md drifted from schemas/: run `make docs-reference` and commit"
    )


def test_settings_page_has_every_kind_and_setting():
    generator = load_generator()
    schema = json.loads(generator.SCHEMA.read_text())
    page = generator.generate()
    for kind, block in generator.kinds(schema["$defs"]).items():
        start = page.index(f"<!-- settings:{kind} -->")
        section = page[start : page.index(f"<!-- /settings:{kind} -->")]
        for name in schema["$defs"][block]["properties"]:
            assert f"| `{name}` |" in section, f"{kind}.{name} missing"
    for name in schema["properties"]:
        assert f"| `{name}` |" in page


def test_settings_cells_escape_markdown():
    generator = load_generator()
    assert generator.escape("runs/<name>/ a|b *x* `a|b <c>` _y_ snake_case") == (
        r"runs/\<name\>/ a\|b \*x\* `a\|b <c>` \_y\_ snake_case"
    )


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path):
    assert broken(path) == []


def includes(path: Path) -> list[tuple[int, Path, dict[str, str]]]:
    """(line, file, options) of every MyST `include` directive of a page."""
    text = path.read_text()
    found = []
    for match in re.finditer(r"^```+\{include\}[ \t]+(\S+)\n((?::[\w-]+:.*\n)*)", text, re.M):
        options = dict(re.findall(r"^:([\w-]+):[ \t]*(.*)$", match.group(2), re.M))
        number = text.count("\n", 0, match.start()) + 1
        found.append((number, (path.parent / match.group(1)).resolve(), options))
    return found


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_include_finds_its_markers(path: Path):
    """A settings table a page includes by its markers is still in the generated page (a
    renamed block would otherwise fail only in `make docs`)."""
    for number, target, options in includes(path):
        text = target.read_text()
        for key in ("start-after", "end-before"):
            if key in options:
                where = f"{path.relative_to(ROOT)}:{number}"
                assert options[key] in text, f"{where}: no {options[key]!r} in {target.name}"


def test_link_checker_sees_what_is_broken(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# The `b` page\n\n## Run on *Slurm*\n\n## Run on Slurm\n")
    (tmp_path / "a.md").write_text(
        "(top)=\n# A\n\n[ok](b.md#the-b-page) [ok](b.md#run-on-slurm-1) [ok](#top)\n"
        "[gone](c.md) [no anchor](b.md#nope) ![img](x.png) [web](https://example.com/x)\n"
        "`[code](nowhere.md)`\n\n```yaml\n[fenced](nowhere.md)\n```\n"
    )
    assert broken(tmp_path / "a.md") == [
        "a.md:5: c.md: no file c.md",
        "a.md:5: b.md#nope: no heading or label 'nope' in b.md",
        "a.md:5: x.png: no file x.png",
    ]


def test_slugs_agree_with_myst():
    """The heading rule above is MyST's, on every heading the docs have."""
    slugs = pytest.importorskip("myst_parser.slugs")
    markdown_it = pytest.importorskip("markdown_it")
    parser = markdown_it.MarkdownIt("commonmark")
    for path in pages():
        tokens = parser.parse(path.read_text())
        titles = [
            "".join(c.content for c in tokens[i + 1].children if c.type in ("text", "code_inline"))
            for i, token in enumerate(tokens)
            if token.type == "heading_open"
        ]
        ours = [
            github_slug(heading_text(m.group(2)))
            for _, line, fenced in prose(path)
            if not fenced and (m := HEADING.match(line))
        ]
        assert ours == [slugs.github_slugify(t) for t in titles], path


# docs/development.md's layout map: a fenced block under "## Layout" of entries such as
#   engine/          the engine, by phase; ...
#     spec/          load: ... source, overrides, schema, ...
#                    (continuation lines, indented deeper than any entry's name)
# An entry starts with `name/` at an indent of at most 12 spaces; every other line belongs to
# the entry of the nearest line above it indented less. A package (a folder with
# __init__.py) is named by an entry of its own, or as `name/` in its parent's entry (or the
# parent's parent's ...: e.g. `tune/ (cli, target, sweep, write)` inside collect's); a module
# is named when its name (with or without `.py`) is a word of its package's entry, or of the
# entry of the nearest package above it that has one.
ENTRY = re.compile(r"^( {0,12})([A-Za-z_]\w*)/(?=\s|$)")
MAPPED = ("engine", "stages")


def layout_map(path: Path) -> dict[str, str]:
    """{'engine/plan': the text of its entry, ...} from the page's `## Layout` block."""
    lines = path.read_text().split("\n## Layout\n", 1)[1].split("\n```\n", 2)[1].splitlines()
    entries: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, owning entry) of the lines above
    for line in lines:
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if match := ENTRY.match(line):
            parents = [owner for _, owner in stack]
            owner = f"{parents[-1]}/{match.group(2)}" if parents else match.group(2)
        elif stack:
            owner = stack[-1][1]
        else:
            continue
        entries[owner] = entries.get(owner, "") + " " + line.strip()
        stack.append((indent, owner))
    return entries


def named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w./-]){re.escape(name)}(?:\.py)?(?![\w/-])", text) is not None


def unmapped(root: Path, entries: dict[str, str]) -> list[str]:
    """Every package and module under engine/ and stages/ that the map does not name, and
    every entry of the map under them that is not a package of the tree."""
    missing = []
    for top in MAPPED:
        for init in sorted((root / top).rglob("__init__.py")):
            package = init.parent.relative_to(root).as_posix()
            owner = package
            while owner not in entries and "/" in owner:
                owner = owner.rsplit("/", 1)[0]
            if owner not in entries:
                missing.append(f"{package}/ (no entry for it or a package above it)")
                continue
            text = entries[owner]
            if owner != package:
                inline = package[len(owner) + 1 :].split("/")
                if not all(named(f"{part}/", text) for part in inline):
                    missing.append(f"{package}/ (not named in {owner}/'s entry)")
                    continue
            for module in sorted(init.parent.glob("*.py")):
                if module.name != "__init__.py" and not named(module.stem, text):
                    missing.append(f"{package}/{module.name} (not named in {owner}/'s entry)")
    for entry in entries:
        if entry.split("/")[0] in MAPPED and not (root / entry / "__init__.py").is_file():
            missing.append(f"{entry}/ is in the map but is not a package")
    return missing


def test_the_layout_map_names_every_package_and_module():
    """docs/development.md's map is the tree as it is: each package and module under engine/
    and stages/ is named in its package's entry (rule above `layout_map`)."""
    problems = unmapped(ROOT, layout_map(DOCS / "development.md"))
    assert problems == [], "docs/development.md's layout map is out of date:\n" + "\n".join(
        problems
    )


def test_the_layout_map_check_sees_what_is_missing(tmp_path: Path):
    for file in (
        "engine/__init__.py",
        "engine/errors.py",
        "engine/spec/__init__.py",
        "engine/spec/load.py",
        "engine/spec/presets/__init__.py",
        "engine/spec/presets/data.py",
        "engine/run/__init__.py",
        "engine/run/task.py",
        "stages/__init__.py",
        "stages/lib/__init__.py",
        "stages/lib/net.py",
        "stages/lib/model/__init__.py",
        "stages/lib/model/gguf.py",
    ):
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_text("")
    (tmp_path / "map.md").write_text(
        "# Dev\n\n## Layout\n\n```\n"
        "engine/          the engine\n"
        "  spec/          load: load.py, presets/ (data),\n"
        "                 and errors\n"
        "  plan/          resolve\n"
        "  errors.py\n"
        "stages/\n"
        "  lib/           shared: network (free_port)\n"
        "    model/       gguf\n"
        "```\n"
    )
    entries = layout_map(tmp_path / "map.md")
    assert entries["engine/spec"] == " spec/          load: load.py, presets/ (data), and errors"
    assert unmapped(tmp_path, entries) == [
        "engine/run/ (not named in engine/'s entry)",
        "stages/lib/net.py (not named in stages/lib/'s entry)",
        "engine/plan/ is in the map but is not a package",
    ]


# a measured figure: a number or a range with its unit (98.2%, +41.8 points, 2,470 s,
# 5 min 49 s, 0.68x, 15-58 s)
NUMBER = r"\d{1,3}(?:,\d{3})*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.,+-])[+-]?{NUMBER}(?:-{NUMBER})?"
    r"(?: min \d+ s\b|%| points\b| s\b| min\b| minutes\b|x\b| tokens/s\b)"
)


def figures(path: Path) -> list[tuple[int, str]]:
    """(line, figure) of every measured figure in a page's prose: code blocks, code spans and
    link targets hold commands and addresses, not measurements."""
    found = []
    for number, line, fenced in prose(path):
        if not fenced:
            text = re.sub(r"(`+).*?\1", "", line)
            text = re.sub(r"\]\([^)]*\)", "]", text)
            found += [(number, m.group(0)) for m in FIGURE.finditer(text)]
    return found


# pages whose figures are not quoted: generated from the schema's field descriptions
UNQUOTED_PAGES = {"docs/reference/settings.md"}
# figures a page states that are not measurements, with why (page, figure): reason; a
# setting listed here would otherwise pass only while BENCHMARKS.md happens to hold it
NOT_MEASURED = {
    ("docs/rl/verifiers.md", "180 s"): "a setting: the bound on the bridge's start-up "
    "(stages/lib/env/served.py START_TIMEOUT_S)",
    ("docs/rl/algorithms.md", "-13%"): "arithmetic: the population std's advantages are "
    "sqrt((G-1)/G) of the sample std's, sqrt(3/4) - 1 at G = 4",
    ("docs/stages/collect.md", "80%"): "pipe tune's rule: HEADROOM = 0.8 of the knee "
    "(stages/collect/tune/sweep.py)",
    ("docs/stages/collect.md", "4x"): "--diagnose's reading: 20 in flight against 5 is 4x "
    "the throughput when parallelism is the limit",
    ("docs/placement.md", "90-100%"): "the memory check's warning band, a rule",
    ("docs/stages/collect.md", "10%"): "pipe tune's rule: the knee is within 10% of the best",
    ("docs/stages/collect.md", "30 s"): "the retry backoff's cap, a setting",
    ("docs/models.md", "10 s"): "the hub request's timeout, a setting",
    ("docs/slurm.md", "30 s"): "how long pipe run waits for cancelled jobs, a setting",
    ("docs/tracking.md", "10 s"): "MLflow's HTTP timeout as pipe sets it",
    ("docs/tracking.md", "120 s"): "PIPE_TRACKING_CLOSE_S's default",
    ("docs/tracking.md", "80%"): "the OpenRLHF guide's GPU utilisation target, a rule",
}


def quoted(figure: str, benchmarks: str) -> bool:
    """The figure stands in BENCHMARKS.md as a figure of its own: `5 s` is not in `0.5 s`,
    `45 s` or `5 scores`."""
    return re.search(rf"(?<![\w.,]){re.escape(figure)}(?!\w)", benchmarks) is not None


def unquoted(path: Path, benchmarks: str) -> list[str]:
    """`page:line: figure` of each measured figure of a page that BENCHMARKS.md does not have."""
    page = path.relative_to(ROOT).as_posix()
    return [
        f"{page}:{number}: {figure}"
        for number, figure in figures(path)
        if (page, figure) not in NOT_MEASURED and not quoted(figure, benchmarks)
    ]


@pytest.mark.parametrize(
    "path",
    [p for p in pages() if p.relative_to(ROOT).as_posix() not in UNQUOTED_PAGES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_figure_a_page_quotes_is_in_benchmarks(path: Path):
    """README.md and the docs pages quote their results from BENCHMARKS.md, where each has its
    command: a figure that is not there (to the digit and unit) was typed by hand or has
    drifted. Quote BENCHMARKS.md's figure, add a measured one there with its command, or, for
    a number that is not a measurement (a setting's value, arithmetic), NOT_MEASURED."""
    missing = unquoted(path, (ROOT / "BENCHMARKS.md").read_text())
    assert missing == [], "figures that BENCHMARKS.md does not have:\n" + "\n".join(missing)


def test_every_not_measured_figure_is_still_on_its_page():
    """An entry of NOT_MEASURED whose figure left its page would excuse the next one typed."""
    stale = [
        f"{page}: {figure}"
        for page, figure in NOT_MEASURED
        if figure not in [f for _, f in figures(ROOT / page)]
    ]
    assert stale == [], "NOT_MEASURED entries no page needs:\n" + "\n".join(stale)


def test_a_figure_is_quoted_only_whole():
    text = "took 0.5 s and 45 s, 5 scores, +26.6 points, 1.83x; 66.4%."
    assert [quoted(f, text) for f in ("0.5 s", "45 s", "+26.6 points", "1.83x", "66.4%")] == [
        True
    ] * 5
    assert [quoted(f, text) for f in ("5 s", "6.6 points", "1.8x", "6.4%", "3x")] == [False] * 5


def test_the_figure_reader_sees_figures_and_skips_code(tmp_path: Path):
    (tmp_path / "a.md").write_text(
        "# A\n\n56.4% -> **98.2%** (+41.8 points) in 5 min 49 s; 2,470 s, 0.68x, 2 cores\n"
        "`torch==2.13.0` [5 s](b.md#x-1.5-s) Python 3.10+, 15-58 s, 5-7k tokens/s\n\n"
        "```\n12.5% in a block\n```\n"
    )
    assert [f for _, f in figures(tmp_path / "a.md")] == [
        "56.4%",
        "98.2%",
        "+41.8 points",
        "5 min 49 s",
        "2,470 s",
        "0.68x",
        "5 s",
        "15-58 s",
    ]
