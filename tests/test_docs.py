"""The documentation holds together: README.md stays short, every relative link in README.md,
docs/ and the other READMEs resolves (files, directories and ``#anchors`` by GitHub's heading slugs), every docs page
opens with a table of contents of its sections, every YAML key of the configuration dataclasses
(and every MindSpore alias) is in docs/configuration.md, and the YAML examples load.

Pure file reading and parsing: no processes, well under a second.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from resilience.config import config_from_dict
from resilience.config.mindspore_names import ALIASES
from resilience.config.resilience_config import SECTIONS

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
LINKED = [*PAGES, *(REPO / folder / "README.md" for folder in ("templates", "bench", "slurm"))]  # the other READMEs link into docs/
README_MAX_LINES = 250  # issue 28: the README says what it is and links to the reference in docs/

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks and indented code, inline code kept."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation other than ``-``
    and ``_`` dropped, each space a ``-`` (github-slugger, as GitHub renders Markdown)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file's headings give, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    return [target for line in prose(path.read_text()) for target in LINK.findall(re.sub(r"`[^`]*`", "", line))]


def test_the_readme_stays_short_and_docs_holds_the_reference():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference material to docs/"
    readme_links = set(links(REPO / "README.md"))
    unlinked = [page.name for page in PAGES[1:] if f"docs/{page.name}" not in readme_links]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_opens_with_a_table_of_contents_of_its_sections(page: Path):
    text = prose(page.read_text())
    first_section = next(i for i, line in enumerate(text) if line.startswith("## "))
    toc = {target for line in text[:first_section] for target in LINK.findall(line)}
    sections = [slug(line[3:]) for line in text if line.startswith("## ")]
    missing = [s for s in sections if f"#{s}" not in toc]
    assert not missing, f"{page.name}: sections missing from the table of contents before the first one: {missing}"


def test_every_configuration_key_is_documented_on_the_keys_page():
    text = (DOCS / "configuration.md").read_text()
    documented = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", text))
    keys = {f"{section}.{field.name}" for section, cls in SECTIONS.items() for field in dataclasses.fields(cls)}
    keys |= {f"{section}.{key}" for section, key in ALIASES}
    assert len(keys) > 40, "the dataclasses were walked"
    missing = sorted(keys - documented)
    assert not missing, f"keys missing from docs/configuration.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_yaml_examples_are_valid_configurations(page: Path):
    blocks = re.findall(r"^```yaml\n(.*?)^```", page.read_text(), re.M | re.S)
    for block in blocks:
        config_from_dict(yaml.safe_load(block))  # raises ConfigError on an unknown key or a bad value
