"""The README stays short and points to the docs pages; its test command is the one CI runs; every link of
the README and the docs pages leads somewhere; the README's speed rows are measured ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
#: ``[text](target)`` and ``![alt](target)``; the target up to the first space or closing parenthesis.
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def sections(text: str) -> dict[str, str]:
    """``## heading -> body`` of a Markdown text (level-2 headings only, outside code blocks)."""
    found: dict[str, str] = {}
    heading, body, fenced = None, [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("## "):
            if heading is not None:
                found[heading] = "\n".join(body)
            heading, body = line[3:].strip(), []
        elif heading is not None:
            body.append(line)
    if heading is not None:
        found[heading] = "\n".join(body)
    return found


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    lines, fenced, found = text.splitlines(), False, set()
    for line in lines:
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_readme_test_command_is_the_one_ci_runs():
    readme = README.read_text()
    command = re.search(r"Run the tests:\n\n```bash\n(.+)\n```", readme).group(1)
    ci = [
        line
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if "pytest" in line and not line.lstrip().startswith("#")
    ]
    assert ci == [command, "python -m pytest -q -m slow"]  # the README's command, then the tests it leaves out
    assert "`python -m pytest -q -m slow`" in readme


def test_every_readme_section_links_its_docs_page():
    unlinked = [
        heading
        for heading, body in sections(README.read_text()).items()
        if heading != "Quick start" and not re.search(r"\]\(docs/[\w\-]+\.md[)#]", body)
    ]
    assert not unlinked, f"README sections without a link to a docs/ page: {unlinked}"


def test_every_docs_page_is_linked():
    texts = [README.read_text(), *(page.read_text() for page in PAGES)]
    targets = {Path(target.split("#")[0]).name for text in texts for target in _LINK.findall(text)}
    assert [page.name for page in PAGES if page.name not in targets] == []


FOLDER_READMES = [REPO / folder / "README.md" for folder in ("pipelines", "finetune", "eval")]


@pytest.mark.parametrize("doc", [README, *PAGES, *FOLDER_READMES], ids=lambda path: str(path.relative_to(REPO)))
def test_links_lead_to_files_and_headings_that_exist(doc):
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s) and mailto
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(target)
    assert not broken, f"{doc.name} links to what does not exist: {broken}"


def test_readme_speed_rows_are_the_measured_ones():
    """The README's speed tables are copied from docs/speed.md: the timings from the `mhla bench` section, the
    bytes moved from the `mhla bench --traffic` table (which tests/bench/test_traffic.py checks against the
    command's output)."""
    page = (REPO / "docs" / "speed.md").read_text()
    measured = re.search(r"<!-- mhla-bench:cpu -->\n(.*?)<!-- /mhla-bench:cpu -->", page, re.DOTALL).group(1)
    traffic = page.split("## Memory traffic", 1)[1].split("\n## ", 1)[0]
    tables = [t for t in sections(README.read_text())["Speed"].split("\n\n") if t.startswith("|")]
    timing = [t.splitlines() for t in tables if "| median ms |" in t.splitlines()[0]]
    moved = [t.splitlines() for t in tables if "| x floor |" in t.splitlines()[0]]
    assert len(timing) == 1 and len(moved) == 1
    assert len(timing[0]) >= 3 and [row for row in timing[0] if row not in measured.splitlines()] == []
    assert len(moved[0]) >= 3 and [row for row in moved[0] if row not in traffic.splitlines()] == []
