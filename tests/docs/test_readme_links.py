"""The README is the front door: every file it links to (the guides, the reference, the screenshot) exists."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The README's length limit (issue 37): the rest lives in docs/.
MAX_LINES = 250


def test_every_relative_link_of_the_readme_exists():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert any(t.startswith("docs/guides/") for t in local), local  # the table of what is where
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_stays_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}: move the rest to docs/)"
    assert "docs/_static/dashboard.png" in "\n".join(lines)
