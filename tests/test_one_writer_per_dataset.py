"""What keeps two runs from generating one dataset at once, for the single-run backfill too.

The instance's run-tag limit on `dagster/partition` holds only runs of one partition: a single-run backfill of
several datasets carries `dagster/asset_partition_range_start`/`_end` instead, so the queued run coordinator
cannot see which datasets it writes. What protects a dataset there is the `llm_api` pool (one generating step
per instance with `llm_api: 1`) and, for every writer on any instance, the dataset's lock (a file lock in its
responses folder, a lease object on an object store). Here a real `dagster asset materialize
--partition-range` over two datasets runs while another process holds one dataset's lock: that dataset is
skipped with the reason in its metadata, and nothing of it is written; the other is generated; once the lock
is free the next run answers the skipped one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import dagster as dg
import polars as pl

from eagle3_assets.core.storage.layout import DatasetLayout

from .support.projects import REPO, make_project, user_rows

HOLD = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable

    with JournalTable(Path(sys.argv[1]), RESPONSE_SCHEMA).exclusive("generation for dataset B3"):
        print("held", flush=True)
        sys.stdin.read()  # until the test closes stdin
    """
)


def _materialize(config, home, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"EAGLE3_CONFIG": str(config), "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "-m", "eagle3_assets.definitions", *args]
    return subprocess.run(
        cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )


def _parts(layout: DatasetLayout) -> list:
    return sorted(layout.responses_dir.glob("*.parquet"))


def test_a_single_run_backfill_skips_a_dataset_another_run_is_writing(tmp_path, monkeypatch):
    config = make_project(
        tmp_path,
        {
            "B3": {"rows": user_rows(["What is 2+2?", "Name a colour."]), "max_tokens": 8},
            "B4": {"rows": user_rows(["Hi"]), "max_tokens": 8},
        },
    )
    home = tmp_path / "dagster_home"
    home.mkdir()
    b3, b4 = DatasetLayout(tmp_path / "data", "B3"), DatasetLayout(tmp_path / "data", "B4")
    for key in ("B3", "B4"):  # `prompts` has no single-run policy: one run per partition
        done = _materialize(config, home, "--select", "prompts", "--partition", key)
        assert done.returncode == 0, done.stderr[-4000:]
    b3.responses_dir.mkdir(parents=True, exist_ok=True)

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(b3.responses_dir)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        done = _materialize(config, home, "--select", "responses", "--partition-range", "B3...B4")
        assert done.returncode == 0, done.stderr[-4000:]
        assert _parts(b3) == []  # not one journal part written beside the holder
        assert pl.read_parquet(_parts(b4)).height == 1
    finally:
        holder.communicate("")  # closes stdin: the holder lets go and exits
    assert holder.returncode == 0

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as instance:
        runs = [r for r in instance.get_runs() if r.asset_selection == {dg.AssetKey("responses")}]
        assert len(runs) == 1
        tags = runs[0].tags
        # The tag the instance's run limit keys on is absent: that limit cannot hold this run.
        assert "dagster/partition" not in tags
        assert (tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]) == (
            "B3",
            "B4",
        )
        records = instance.fetch_materializations(dg.AssetKey("responses"), limit=10).records
        mats = [r.asset_materialization for r in records if r.asset_materialization is not None]
        stops = {m.partition: m.metadata["stop_reason"].value for m in mats}
    assert stops["B4"] == "done"
    assert str(stops["B3"]).startswith("busy (") and "already running" in str(stops["B3"]), stops

    # The lock free, the next run over the same range answers the skipped dataset and sends nothing for B4.
    again = _materialize(config, home, "--select", "responses", "--partition-range", "B3...B4")
    assert again.returncode == 0, again.stderr[-4000:]
    assert pl.read_parquet(_parts(b3)).height == 2 and pl.read_parquet(_parts(b4)).height == 1
