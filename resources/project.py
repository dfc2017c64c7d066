"""The project config as a resource, so assets read dataset settings the same way in the UI, the CLI and tests."""

from __future__ import annotations

import dagster as dg

from eagle3_assets.config import ProjectConfig, load_config


class ProjectConfigResource(dg.ConfigurableResource):
    """Path of `eagle3.yaml` (and the backend override it was loaded with)."""

    path: str
    backend: str | None = None

    def load(self) -> ProjectConfig:
        return load_config(self.path, self.backend)
