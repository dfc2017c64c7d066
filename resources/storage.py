"""Where outputs land: a local folder with one sub-folder per partition (design §4)."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from eagle3_assets.core.files import write_json
from eagle3_assets.core.layout import DatasetLayout


class StorageResource(dg.ConfigurableResource):
    """The storage root; every stage asks it for a dataset's layout instead of building paths itself."""

    root: str

    def layout(self, key: str) -> DatasetLayout:
        return DatasetLayout(Path(self.root), key).ensure()


class StorageJsonIOManager(dg.ConfigurableIOManager):
    """Small values passed between ops (shard names, stats) as JSON under the storage root.

    The storage root is shared by every step that reads or writes data (pods included), so values that travel
    between steps of one run live there too; no separate object store is needed.
    """

    root: str

    def _path(self, context: dg.OutputContext | dg.InputContext) -> Path:
        parts = context.get_identifier()
        return Path(self.root) / ".dagster_io" / Path(*[str(p) for p in parts]).with_suffix(".json")

    def handle_output(self, context: dg.OutputContext, obj: object) -> None:
        path = self._path(context)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(obj, path)

    def load_input(self, context: dg.InputContext) -> object:
        return json.loads(self._path(context.upstream_output).read_text())
