"""The README and docs/ hold together: CI runs the README's test command, every relative link
and anchor leads somewhere, and no commit hash stands in for a dated, reproducible result."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+ (.+)$", re.M)
# A short hex run with a digit and a letter, as `git log --oneline` prints one; a SHA-256
# (64 hex digits) has no word boundary inside it, so it is not one.
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")


def prose(page: Path) -> str:
    """The page without its code blocks: links and headings in examples are not the page's."""
    return _FENCE.sub("", page.read_text())


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(heading) for heading in _HEADING.findall(prose(page))}


def test_ci_runs_the_readme_s_test_command() -> None:
    """.ci/run calls the README's test command as written, so CI tests what a reader runs."""
    commands = [line for block in _FENCE.findall(README.read_text())
                for line in block.splitlines() if "install.sh --dev" in line]
    assert commands == ["bash install.sh --dev && scripts/test"]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands[0] in ci_lines


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in _LINK.findall(prose(page)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_no_commit_hash_in_the_readme_or_docs() -> None:
    """Results are dated and name the command that made them; a hash ages into a riddle."""
    found = {page.name: _COMMIT.findall(page.read_text()) for page in PAGES}
    assert not {name: hits for name, hits in found.items() if hits}, found


def test_the_readme_stays_a_first_page() -> None:
    """What it is, a start, a first request, where to read on; the rest lives in docs/."""
    assert len(README.read_text().splitlines()) <= 300
