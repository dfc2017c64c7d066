"""data_value's files where the storage root keeps them. With an object-store root the store holds the report,
its markdown, the suite's answers and the inputs record; the local folder is a working copy, replaced from
the store before the asset decides whether its inputs changed and published after a finished report, so a
second machine (or a wiped cache) re-reports the stored report instead of training again, and a reader of
the store sees what the asset measured. With a local root both are one folder and nothing is copied."""

from __future__ import annotations

from pathlib import Path

from ...config import ProjectConfig
from ..storage.files import write_text
from ..storage.layout import DataValueLayout
from ..storage.root_files import RootFiles, root_files


def value_layout(cfg: ProjectConfig) -> DataValueLayout:
    return DataValueLayout(Path(cfg.storage_root))


def stored_files(cfg: ProjectConfig) -> RootFiles:
    """The root as stored: the object store itself for an object-store root, else the local folder."""
    if cfg.storage_is_remote:
        return root_files(cfg.storage.root, cfg.storage.options, remote=True)
    return root_files(cfg.storage_root)


def pull(files: RootFiles, layout: DataValueLayout) -> None:
    """The local copies replaced by the stored ones; a local file the store lacks is removed (a working copy
    that was never published must not pass for the stored report)."""
    for path in layout.stored():
        text = read_stored(files, layout, path)
        if text is None:
            path.unlink(missing_ok=True)
        else:
            write_text(text, path)


def publish(files: RootFiles, layout: DataValueLayout) -> list[str]:
    """Every local file stored, in `stored()` order (the inputs record last); returns where each went."""
    return [
        files.write_text(layout.rel(p), p.read_text(encoding="utf-8")) for p in layout.stored() if p.exists()
    ]


def read_stored(files: RootFiles, layout: DataValueLayout, path: Path) -> str | None:
    """The stored text of the layout's file `path`; None where the store lacks it."""
    return files.read_text(layout.rel(path))
