"""Write or check docs/code-layout.md: one line per module of eagle3_assets/, resources/ and tests/support/,
taken from the first sentence of each module's docstring.

    python scripts/code_layout.py --write   # regenerate the page (`make code-layout`)
    python scripts/code_layout.py --check   # fail when the page does not list exactly the modules that exist
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "code-layout.md"
ROOTS = ("eagle3_assets", "resources", "tests/support")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(])")
SECTION = re.compile(r"^## `([^`]+)/`", re.M)
ITEM = re.compile(r"^- `([^`]+\.py)`", re.M)
LINE = 150

HEAD = """# Code layout

The data flow is the shape of the code: thin Dagster assets, each beside its checks, over a plain-Python core
with one package per stage. Each stage imports only the stages before it (`tests/test_layering.py` holds every
module to that order), and nothing under `eagle3_assets/core/` imports Dagster. Every outside system (an
inference service, the target tokenizer, storage, vLLM) has one adapter under `resources/`.

This page is generated from the modules' own docstrings by `make code-layout`; `make docs` fails when it does
not list exactly the modules that exist.

Beside the packages: `bench/` (the [benchmarks](benchmarks.md)), `configs/` (the Kimi-K2.5 recipe), `deploy/`
(instance files, Helm values, the vLLM Deployment: [operations](operations.md)), `prompts/` (the demo datasets
B1..B8), `scripts/` (the system packages the tests need; this page's generator) and `tests/`
([tests](tests.md)).
"""


def _top_level(text: str) -> list[tuple[int, str]]:
    """(position, character) of each character outside parentheses and backquotes."""
    depth, quoted, out = 0, False, []
    for i, c in enumerate(text):
        if c == "`":
            quoted = not quoted
        elif not quoted and c in "([":
            depth += 1
        elif not quoted and c in ")]":
            depth = max(0, depth - 1)
        elif not quoted and depth == 0:
            out.append((i, c))
    return out


def role(path: Path) -> str:
    """The first sentence of the module's docstring, shortened to about a line: asides in parentheses dropped,
    then whatever follows its first top-level semicolon."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    if not paragraph:
        return "(no docstring)"
    text = SENTENCE_END.split(paragraph, maxsplit=1)[0]
    if len(text) > LINE:
        text = re.sub(r"\s*\([^()]*\)", "", text)
    if len(text) > LINE:
        cut = next((i for i, c in _top_level(text) if c == ";"), None)
        text = text[:cut] + "." if cut else text
    return text[:-1] + "." if text.endswith(":") else text


def packages() -> dict[str, list[Path]]:
    """Each folder holding Python modules, in order, with its modules (its __init__.py first)."""
    found: dict[str, list[Path]] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            folder = path.parent.relative_to(REPO).as_posix()
            found.setdefault(folder, []).append(path)
    for mods in found.values():
        mods.sort(key=lambda p: (p.name != "__init__.py", p.name))
    return found


def render() -> str:
    out = [HEAD]
    for folder, mods in packages().items():
        out.append(f"## `{folder}/`\n")
        for path in mods:
            out.append(f"- `{path.name}`: {role(path)}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def listed(text: str) -> set[str]:
    """The module paths the page lists: each item under its section's folder."""
    paths: set[str] = set()
    sections = list(SECTION.finditer(text))
    for i, section in enumerate(sections):
        end = sections[i + 1].start() if i + 1 < len(sections) else len(text)
        for item in ITEM.finditer(text, section.end(), end):
            paths.add(f"{section.group(1)}/{item.group(1)}")
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    if args.write:
        PAGE.write_text(render())
        print(f"wrote {PAGE.relative_to(REPO)}")
        return 0
    exist = {path.relative_to(REPO).as_posix() for mods in packages().values() for path in mods}
    on_page = listed(PAGE.read_text()) if PAGE.exists() else set()
    missing, gone = sorted(exist - on_page), sorted(on_page - exist)
    if missing or gone:
        print(
            f"{PAGE.relative_to(REPO)} does not match the code: not listed {missing}, listed but gone "
            f"{gone}. Run `make code-layout`.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
