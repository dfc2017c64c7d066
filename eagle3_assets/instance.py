"""The Dagster instance settings the platform relies on, in one place: the launch guard, one run per dataset
at a time and the step pools' limits. `eagle3 instance` applies them to DAGSTER_HOME's instance; the shipped
instance files under `deploy/` carry the same guard and run limit (a test holds them to this module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Two runs generating the same partition would both buy its answers. The queued run coordinator enforces this
# for runs of one partition (tagged `dagster/partition`), two pods on a shared volume included. A single-run
# backfill of several datasets carries `dagster/asset_partition_range_start`/`_end` instead, which this limit
# cannot see: there the `llm_api` pool and the dataset's own lock (a file lock, a lease object on an object
# store; resources/storage.py) keep a second writer out (tests/test_one_writer_per_dataset.py).
ONE_RUN_PER_DATASET: dict[str, Any] = {
    "key": "dagster/partition",
    "value": {"applyLimitPerUniqueValue": True},
    "limit": 1,
}


# The run coordinator every launch passes (eagle3_assets/launch_guard.py): Dagster's queued one, refusing
# launches that choose where or how code runs.
LAUNCH_GUARD: dict[str, str] = {"module": "eagle3_assets.launch_guard", "class": "LaunchGuardRunCoordinator"}


def _load(home: Path) -> tuple[Path, dict[str, Any]]:
    import yaml

    path = home / "dagster.yaml"
    return path, (yaml.safe_load(path.read_text()) if path.exists() else None) or {}


def _save(path: Path, doc: dict[str, Any]) -> None:
    import yaml

    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def ensure_run_limit(home: Path) -> str:
    """Add the one-run-per-dataset limit to `home`/dagster.yaml when it is missing; the rest of the file is
    kept."""
    path, doc = _load(home)
    coordinator_limits = ((doc.get("run_coordinator") or {}).get("config") or {}).get(
        "tag_concurrency_limits"
    )
    if any(x.get("key") == ONE_RUN_PER_DATASET["key"] for x in coordinator_limits or []):
        return f"one run per dataset: already in {path} (run_coordinator)"
    limits = doc.setdefault("concurrency", {}).setdefault("runs", {}).setdefault("tag_concurrency_limits", [])
    if any(x.get("key") == ONE_RUN_PER_DATASET["key"] for x in limits):
        return f"one run per dataset: already in {path}"
    limits.append(ONE_RUN_PER_DATASET)
    _save(path, doc)
    return f"one run per dataset: added to {path} (restart the daemon to apply it)"


def ensure_launch_guard(home: Path) -> tuple[bool, str]:
    """Make the launch guard `home`/dagster.yaml's run coordinator: it replaces Dagster's queued run
    coordinator (keeping its config) or stands in where none is named; any other coordinator is left as it is
    and reported (False: launches there are not guarded)."""
    path, doc = _load(home)
    current = doc.get("run_coordinator") or {}
    if {k: current.get(k) for k in LAUNCH_GUARD} == LAUNCH_GUARD:
        return True, f"launch guard: already in {path}"
    dagster_queued = current.get("class") == "QueuedRunCoordinator" and str(current.get("module")).startswith(
        "dagster"
    )
    if current and not dagster_queued:
        return False, (
            f"launch guard: {path} names run coordinator {current.get('module')}.{current.get('class')}, so "
            "launches there may set run tags and resources that change where and how code runs. Set "
            f"run_coordinator to module {LAUNCH_GUARD['module']}, class {LAUNCH_GUARD['class']} (it takes "
            "the config of Dagster's QueuedRunCoordinator; see deploy/local/dagster.yaml)."
        )
    doc["run_coordinator"] = {
        **LAUNCH_GUARD,
        **({"config": current["config"]} if current.get("config") else {}),
    }
    _save(path, doc)
    return (
        True,
        f"launch guard: added to {path} (restart dagster dev or the webserver and daemon to apply it)",
    )


def apply_pools(instance: Any, pools: dict[str, int]) -> list[str]:
    """Set each pool's concurrent-step limit on the instance (they live in its database)."""
    for pool, limit in pools.items():
        instance.event_log_storage.set_concurrency_slots(pool, limit)
    return [f"pool {pool}: {limit} concurrent step(s)" for pool, limit in pools.items()]
