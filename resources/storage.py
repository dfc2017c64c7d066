"""Where outputs land: one sub-folder per partition under `storage.root` (the README's Outputs section)."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from eagle3_assets.config import ProjectConfig
from eagle3_assets.core.files import write_json
from eagle3_assets.core.layout import DatasetLayout


class Storage:
    """The storage root; every stage asks it for a dataset's layout instead of building paths itself."""

    def __init__(self, cfg: ProjectConfig):
        self.root = cfg.storage_root

    def layout(self, key: str) -> DatasetLayout:
        return DatasetLayout(Path(self.root), key).ensure()


class StorageJsonIOManager(dg.IOManager):
    """Small values passed between ops (shard names, stats) as JSON under the storage root.

    The storage root is shared by every step that reads or writes data (pods included), so values that travel
    between steps of one run live there too; no separate object store is needed.
    """

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, context: dg.OutputContext | dg.InputContext) -> Path:
        parts = context.get_identifier()
        return self.root / ".dagster_io" / Path(*[str(p) for p in parts]).with_suffix(".json")

    def handle_output(self, context: dg.OutputContext, obj: object) -> None:
        path = self._path(context)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(obj, path)

    def load_input(self, context: dg.InputContext) -> object:
        return json.loads(self._path(context.upstream_output).read_text())
