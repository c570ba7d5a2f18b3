"""The README and the pages in docs/ are a user's guide: the README stays short and names only commands that
exist, and every command is in its table; no page but the mutation record speaks of issue numbers, mutation
IDs or test functions; every relative link and anchor between them resolves."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from sparkctl.cli import cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The development record: the mutation log names mutants and tests by design.
DEV_PAGES = {"mutations.md"}
USER_PAGES = [README] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in DEV_PAGES)

ISSUE = re.compile(r"\b[Ii]ssues? #?\d+\b")
MUTANT = re.compile(r"\bM\d{3,4}\b")
TEST_FUNCTION = re.compile(r"(?:::|\b)test_[a-z0-9_]+\b(?!\.py)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks (a shell example may hold anything)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", _prose(page.read_text()), re.M)}


def test_the_readme_is_a_short_guide() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail to a page in docs/"
    assert "tests/" not in README.read_text(), "the README points users at test files"


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_a_user_page_names_no_issue_mutant_or_test_function(page: Path) -> None:
    text = _prose(page.read_text())
    for name, pattern in (("an issue number", ISSUE), ("a mutation ID", MUTANT),
                          ("a test function", TEST_FUNCTION)):
        hits = [m.group(0) for m in pattern.finditer(text)]
        assert not hits, f"{page.name} names {name}: {hits[:5]}"


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an outside address
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: links that lead nowhere: {broken}"


def _readme_commands() -> set[str]:
    """The first word of every command in the README's command table."""
    text = README.read_text()
    table = text[text.index("| command | what it does |"):]
    table = table[:table.index("\n\n")]
    words = set()
    for row in table.splitlines()[2:]:
        cell = row.replace("\\|", "/").split("|")[1]
        for part in re.findall(r"`([^`]+)`", cell):
            words.add(part.split()[0])
    return words


def test_the_command_table_names_every_command_and_no_other() -> None:
    assert isinstance(cli, click.Group)
    real = set(cli.list_commands(click.Context(cli)))
    named = _readme_commands()
    assert named - real == set(), f"the README names commands that do not exist: {sorted(named - real)}"
    assert real - named == set(), f"the README's table leaves out: {sorted(real - named)}"
