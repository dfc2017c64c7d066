"""Where outputs land: a local folder with one sub-folder per partition (design §4)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from eagle3_assets.core.layout import DatasetLayout


class StorageResource(dg.ConfigurableResource):
    """The storage root; every stage asks it for a dataset's layout instead of building paths itself."""

    root: str

    def layout(self, key: str) -> DatasetLayout:
        return DatasetLayout(Path(self.root), key).ensure()
