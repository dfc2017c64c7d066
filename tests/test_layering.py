"""The core's stages import downward only, and nothing under core imports Dagster or the layers above it.

Order (eagle3_assets/core/__init__.py): storage < target_model < prompts < generation < tokens < report <
hidden_states < acceptance < data_value. A module may import its own stage, any stage before it, and
`eagle3_assets.config`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .support.projects import REPO

CORE = REPO / "eagle3_assets" / "core"
ORDER = [
    "storage",
    "target_model",
    "prompts",
    "generation",
    "tokens",
    "report",
    "hidden_states",
    "acceptance",
    "data_value",
]


def _imports(path: Path, root: Path) -> list[str]:
    """Every module `path` (a file of the tree at `root`) imports, relative imports resolved, at any depth."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["eagle3_assets", "core"] and len(parts) > 2:
        return parts[2]
    return None


MODULES = sorted(CORE.rglob("*.py"))


def assert_layered(path: Path, root: Path = REPO) -> None:
    """`path`, a module under `root`'s eagle3_assets/core, imports only its stage and those before it."""
    rel = path.relative_to(root / "eagle3_assets" / "core")
    own = rel.parts[0] if len(rel.parts) > 1 else None
    allowed = set(ORDER[: ORDER.index(own) + 1]) if own else set()
    for module in _imports(path, root):
        top = module.split(".")[0]
        assert top not in ("dagster", "resources"), (
            f"{path.name} imports {module}: the core stays Dagster-free"
        )
        if module.startswith("eagle3_assets.") and _stage(module) is None:
            assert module.startswith(("eagle3_assets.config", "eagle3_assets.core")), (
                f"{path.name} imports {module}, a layer above the core"
            )
        stage = _stage(module)
        if stage is not None and stage in ORDER and own is not None:
            assert stage in allowed, f"{rel} imports {module}: {stage} comes after {own}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(CORE)))
def test_a_core_module_imports_only_its_stage_and_those_before_it(path):
    assert_layered(path)


def test_every_stage_is_a_package_with_a_docstring_that_says_what_it_may_import():
    assert sorted(p.name for p in CORE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ORDER)
    assert [p.name for p in CORE.glob("*.py")] == ["__init__.py"]  # no module outside a stage
    for stage in ORDER:
        doc = ast.get_docstring(ast.parse((CORE / stage / "__init__.py").read_text()))
        assert doc and (stage == "storage" or "May import:" in doc), stage


def test_the_layering_rule_can_fail(tmp_path):
    """The check itself: an upward import is seen (in a probe laid out under tmp_path, not in the source
    tree)."""
    bad = tmp_path / "eagle3_assets" / "core" / "storage" / "_upward_probe.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ..acceptance.gate import run_gate\n")
    with pytest.raises(AssertionError, match="acceptance comes after storage"):
        assert_layered(bad, root=tmp_path)
