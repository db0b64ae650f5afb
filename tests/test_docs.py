"""References in the repository lead somewhere: every citation of a Markdown file's
numbered section (a path ending in .md, then § and the number) names a file that is in
the repository and a section `## N.` it has, and every relative link in a Markdown file
points to a file or folder that exists."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"([\w./-]+\.md) §(\d+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEXT = (".py", ".md", ".proto", ".sh", ".yaml", ".toml", ".jinja")


def tracked() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / name for name in names if name.endswith(TEXT) and (REPO / name).is_file()]


def sections(path: Path) -> set[str]:
    return set(re.findall(r"^## (\d+)\.", path.read_text(encoding="utf-8"), flags=re.MULTILINE))


def test_every_section_citation_leads_to_a_section():
    broken, found = [], 0
    for path in tracked():
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for cited, number in CITATION.findall(line):
                found += 1
                target = REPO / cited
                if not target.is_file():
                    broken.append(f"{path.relative_to(REPO)}:{line_no}: {cited} is not in the repository")
                elif number not in sections(target):
                    broken.append(f"{path.relative_to(REPO)}:{line_no}: {cited} has no section {number}")
    assert found >= 20, f"only {found} citations found: has the citation style changed?"
    assert not broken, "\n".join(broken)


def test_every_relative_markdown_link_exists():
    broken = []
    for path in tracked():
        if path.suffix != ".md":
            continue
        for target in LINK.findall(path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(REPO)}: link to {target}")
    assert not broken, "\n".join(broken)


def test_the_checks_catch_what_they_guard_against():
    """The patterns find a citation and a link where they stand in real text."""
    assert CITATION.findall("see docs/design.md §4, and") == [("docs/design.md", "4")]
    assert LINK.findall("[the design](docs/design.md) and [x](https://a.b)") == ["docs/design.md", "https://a.b"]
    assert "4" in sections(REPO / "docs" / "design.md")
