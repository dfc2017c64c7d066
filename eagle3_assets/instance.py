"""The Dagster instance settings the platform relies on, in one place: one run per dataset at a time and the
step pools' limits. `eagle3 instance` applies them to DAGSTER_HOME's instance; the shipped instance files
under `deploy/` carry the same run limit (a test holds them to this module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Two runs generating the same partition would both buy its answers. The queued run coordinator enforces this
# for every run, two pods on a shared volume included, where a file lock is not reliable.
ONE_RUN_PER_DATASET: dict[str, Any] = {
    "key": "dagster/partition",
    "value": {"applyLimitPerUniqueValue": True},
    "limit": 1,
}


def ensure_run_limit(home: Path) -> str:
    """Add the one-run-per-dataset limit to `home`/dagster.yaml when it is missing; the rest of the file is
    kept."""
    import yaml

    path = home / "dagster.yaml"
    doc = (yaml.safe_load(path.read_text()) if path.exists() else None) or {}
    limits = doc.setdefault("concurrency", {}).setdefault("runs", {}).setdefault("tag_concurrency_limits", [])
    if any(x.get("key") == ONE_RUN_PER_DATASET["key"] for x in limits):
        return f"one run per dataset: already in {path}"
    limits.append(ONE_RUN_PER_DATASET)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return f"one run per dataset: added to {path} (restart the daemon to apply it)"


def apply_pools(instance: Any, pools: dict[str, int]) -> list[str]:
    """Set each pool's concurrent-step limit on the instance (they live in its database)."""
    for pool, limit in pools.items():
        instance.event_log_storage.set_concurrency_slots(pool, limit)
    return [f"pool {pool}: {limit} concurrent step(s)" for pool, limit in pools.items()]
