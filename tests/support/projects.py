"""A project as a user has it: an `eagle3.yaml` with its datasets' source rows beside it, and its assets
materialised in process on a throwaway Dagster instance."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
STAGES_TO_REPORT = ("prompts", "responses", "tokens", "validation_report")  # every stage before hidden states


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def user_rows(texts: list[str], with_ids: bool = True) -> list[dict]:
    rows = []
    for i, t in enumerate(texts):
        row = {"messages": [{"role": "user", "content": t}]}
        if with_ids:
            row["id"] = f"p{i:03d}"
        rows.append(row)
    return rows


def make_project(root: Path, datasets: dict[str, dict], **top) -> Path:
    """A config file in `root` with the given datasets (source rows written beside it)."""
    cfg: dict = {"storage": {"root": "data"}, "datasets": {}}
    for key, spec in datasets.items():
        rows = spec.pop("rows")
        write_jsonl(root / "prompts" / f"{key}.jsonl", rows)
        cfg["datasets"][key] = {
            "source": f"prompts/{key}.jsonl",
            "format": spec.pop("format", "messages"),
            "max_tokens": spec.pop("max_tokens", 12),
            **spec,
        }
    cfg.update(top)
    path = root / "eagle3.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def materialize_in_process(
    path: Path, select: tuple[str, ...] | list[str], partition: str = "B1", limit: int | None = None
):
    """The project at `path` as its definitions build it: `select`ed assets of one partition in process, on a
    throwaway instance, answering at most `limit` prompts; fails with the failures' messages."""
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import build_definitions

    defs = build_definitions(load_config(path), str(path))
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        result = job.execute_in_process(
            partition_key=partition,
            instance=instance,
            run_config={"ops": {"responses": {"config": {"limit": limit}}}} if limit else None,
            asset_selection=[dg.AssetKey(k) for k in select],
            raise_on_error=False,
        )
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    return result


def run_training_data_job(config_path, key, instance, run_config=None, selection=None):
    """The training-data job on `instance` (kept by the caller across runs, so a second run sees the first);
    returns the result, failed or not."""
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import TRAINING_DATA_JOB, build_definitions

    defs = build_definitions(load_config(config_path), str(config_path))
    job = defs.resolve_job_def(TRAINING_DATA_JOB)
    keys = [dg.AssetKey(s) for s in selection] if selection else None
    return job.execute_in_process(
        partition_key=key,
        instance=instance,
        raise_on_error=False,
        run_config=run_config,
        asset_selection=keys,
    )
