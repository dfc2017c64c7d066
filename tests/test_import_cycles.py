"""No import circles in the core, and the config below it: a module's imports (those for type checking and
inside functions included, `support/import_graph.py`) never lead back to it, and the config reads of the core
only leaves that import nothing of the project (the storage schemes), so no import runs up the layers."""

from __future__ import annotations

from pathlib import Path

from .support.import_graph import cycles, graph, imported, module_name
from .support.projects import REPO

PACKAGE = REPO / "eagle3_assets"


def _config_reads_of_the_core(root: Path) -> list[str]:
    """Core modules the config imports that import something of the project themselves."""
    files = {module_name(p, root): p for p in (root / "eagle3_assets" / "core").rglob("*.py")}
    bad = []
    for path in sorted((root / "eagle3_assets" / "config").rglob("*.py")):
        for module in sorted(imported(path, root) & files.keys()):
            own = sorted(m for m in imported(files[module], root) if m.startswith("eagle3_assets"))
            if own:
                bad.append(f"{path.name} imports {module}, which imports {own}")
    return bad


def test_the_core_has_no_import_circle():
    assert cycles(graph(PACKAGE / "core", REPO)) == []


def test_the_config_reads_only_leaves_of_the_core():
    assert _config_reads_of_the_core(REPO) == []


def test_a_circle_is_found_type_checking_imports_included(tmp_path):
    """The check itself, on a probe tree: a -> b at run time, b -> a for type checking only, c outside."""
    pkg = tmp_path / "eagle3_assets" / "core" / "probe"
    pkg.mkdir(parents=True)
    for folder in (pkg.parent, pkg):
        (folder / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (pkg / "c.py").write_text("from . import a\n")
    found = cycles(graph(tmp_path / "eagle3_assets" / "core", tmp_path))
    assert found == [["eagle3_assets.core.probe.a", "eagle3_assets.core.probe.b"]]


def test_a_config_import_of_a_core_module_with_imports_is_found(tmp_path):
    core, config = tmp_path / "eagle3_assets" / "core" / "storage", tmp_path / "eagle3_assets" / "config"
    core.mkdir(parents=True)
    config.mkdir(parents=True)
    for folder in (tmp_path / "eagle3_assets", core.parent, core, config):
        (folder / "__init__.py").write_text("")
    (core / "schemes.py").write_text("import os\n")
    (core / "remote.py").write_text("from ...config import project\n")
    (config / "project.py").write_text("from ..core.storage.schemes import X\n")
    assert _config_reads_of_the_core(tmp_path) == []
    (config / "project.py").write_text("from ..core.storage.remote import RemoteRoot\n")
    assert _config_reads_of_the_core(tmp_path) == [
        "project.py imports eagle3_assets.core.storage.remote, which imports "
        "['eagle3_assets.config', 'eagle3_assets.config.project']"
    ]
