"""The project config as a resource: the one validated `eagle3.yaml`, read the same way in the UI, CLI and
tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.config import ProjectConfig


@dataclass(frozen=True)
class Project:
    """The validated config and the file it came from."""

    cfg: ProjectConfig
    path: Path
