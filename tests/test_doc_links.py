"""Every relative link in README.md and docs/ points at a file (and heading) that exists."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

pytestmark = pytest.mark.timeout(30)


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces -> '-'."""
    out = set()
    for line in md.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def _docs():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for md in _docs():
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)  # code is not links
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{md.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_docs_folder_holds_one_file_per_user_question():
    names = {p.name for p in (REPO / "docs").glob("*.md")}
    for name in ("quickstart.md", "configuration.md", "clusters.md", "algorithms.md", "conversion.md",
                 "reward-models.md", "troubleshooting.md", "benchmarks.md"):
        assert name in names, name
