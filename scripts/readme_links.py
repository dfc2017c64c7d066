"""Check the relative links of README.md (the documentation site's build checks its own pages): every linked
file exists, and every anchor into a Markdown file names one of its headings.

    python scripts/readme_links.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    # Markup marks go, as the page renders: backticks, asterisks, and underscores that open or close
    # emphasis (an underscore inside a word, `data_value`, stays in the anchor).
    return {slugify(re.sub(r"[`*]|(?<!\w)_+|_+(?!\w)", "", h), "-") for h in HEADING.findall(text)}


def problems(readme: Path) -> list[str]:
    found = []
    for target in LINK.findall(FENCE.sub("", readme.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor of the README itself
        path, _, anchor = target.partition("#")
        file = (readme.parent / path).resolve()
        if not file.exists():
            found.append(f"{target}: {path} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            found.append(f"{target}: {path} has no heading whose anchor is #{anchor}")
    return found


def main() -> int:
    found = problems(REPO / "README.md")
    for problem in found:
        print(f"README.md: broken link {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
