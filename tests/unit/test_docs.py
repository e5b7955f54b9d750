"""The README stays a user's guide (its two commands, short, no measurement diary), and every relative link
in the repository's Markdown reaches a file."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    skip = {".git", ".venv", "node_modules", ".whl", "collections"}
    return [path for path in REPO.rglob("*.md") if not skip & set(path.relative_to(REPO).parts)]


def test_readme_keeps_its_two_commands_and_stays_a_guide():
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/bigmem-train run" in readme
    assert "bash scripts/test.sh" in readme
    assert len(readme.splitlines()) <= 200
    # Dates, times and model history belong to results pages and git, not the front door.
    months = "January|February|March|April|May|June|July|August|September|October|November|December"
    diary = rf"\b({months}) 20\d\d\b|\b20\d\d-\d\d-\d\d\b|\bUTC\b|\bmodel \d\b|load average"
    assert not re.search(diary, readme)


def test_relative_links_reach_a_file():
    broken = []
    for page in markdown_files():
        for target in LINK.findall(page.read_text(errors="ignore")):
            path = target.split("#")[0]
            if not path or target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, "links to nothing: " + "; ".join(broken)
