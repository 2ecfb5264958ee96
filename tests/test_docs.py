"""The README and docs/ stay honest: the README starts with the two commands and stays short, every relative link
points to a file (and heading) that exists, and every result file the docs name is in bench-results/."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCH_RESULTS = ROOT / "bench-results"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
# The README is the way in, not the journal: about 200 lines (issue 49), the measured detail under docs/
README_MAX_LINES = 220

FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)  # fenced, in a list item too
CODE_SPAN = re.compile(r"`[^`]+`")  # a code span may run over a line break
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
RESULT_PATH = re.compile(r"bench-results/[A-Za-z0-9_.{},*/\-]*[A-Za-z0-9_}*]")
RESULT_NAME = re.compile(r"`([A-Za-z0-9][A-Za-z0-9_.{},\-]*\.json)`")
PLACEHOLDER = re.compile(r"(?<![A-Za-z0-9])[A-Z]+(?![A-Za-z0-9])")  # result files are named in lower case


def prose(text: str) -> str:
    """The page without its code blocks, and its code spans blanked (a link's text may be code)."""
    return CODE_SPAN.sub("`code`", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and code reduced to their text, lower case, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def expand_braces(pattern: str) -> list[str]:
    """`a-{b,c}.json` -> ['a-b.json', 'a-c.json'] (shell brace expansion, any number of groups, not nested)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M)
    assert first_block is not None, "the README has no bash block"
    assert text[:first_block.start()].strip() == "# rampserve", "the two commands come right after the title"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert all((ROOT / command.split()[1]).is_file() for command in commands)


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.\-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading '#{anchor}' in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page_id(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_results_exist(page: Path):
    """Every bench-results path a page names (brace groups, globs and placeholders expanded) matches a file, and so
    does every result file it names bare in code (`sim-...-seeds3.json`, whose kind, its name's first word, is one
    that bench-results holds); names abbreviated with '…' cannot be checked."""
    text = page.read_text()
    kinds = {re.split(r"[-.]", p.name)[0] for p in BENCH_RESULTS.glob("*.json")}
    missing = []
    for mention in set(RESULT_PATH.findall(text)):
        for path in expand_braces(mention.rstrip(".")):
            # A command's placeholder (`--json bench-results/staging-M.json`, M the model) stands for any name
            if not list(ROOT.glob(PLACEHOLDER.sub("*", path))):
                missing.append(path)
    for name in set(RESULT_NAME.findall(text)):
        if re.split(r"[-.]", name)[0] in kinds:
            missing += [n for n in expand_braces(name) if not (BENCH_RESULTS / n).is_file()]
    assert not missing, f"{page_id(page)} names result files that bench-results/ lacks: {sorted(missing)}"


def test_every_result_page_is_reachable_from_the_readme():
    """docs/README.md is the index: every page under docs/ is linked from it or from the README."""
    linked = set()
    for index in (README, ROOT / "docs" / "README.md"):
        for target in LINK.findall(prose(index.read_text())):
            linked.add((index.parent / target.partition("#")[0]).resolve())
    unlinked = [page_id(p) for p in PAGES[1:] if p.resolve() not in linked and p.name != "README.md"]
    assert not unlinked, f"pages no index links to: {unlinked}"
