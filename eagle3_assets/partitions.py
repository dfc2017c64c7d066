"""One partition per dataset key of the config (B1..B8 in the shipped config)."""

from __future__ import annotations

import dagster as dg

from .config import ProjectConfig


def dataset_partitions(cfg: ProjectConfig) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition(list(cfg.datasets))
