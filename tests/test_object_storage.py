"""An object-store root, against a real S3-compatible server the test starts on loopback (moto's server mode):
every output lands in the bucket in the contract's layout, a fresh working copy resumes from what the store
holds, a top-up moves what it adds, two writers cannot both win, and the dataset lease holds off a second
generator."""

from __future__ import annotations

import json
import time
from pathlib import Path

import obstore as obs
import polars as pl
import pytest

from eagle3_assets.core.storage.remote import ConflictError, RemoteRoot
from eagle3_assets.core.storage.remote_lease import LeaseHeld

from .support.object_store import BUCKET, s3_options, s3_project
from .support.projects import STAGES_TO_REPORT, materialize_in_process


def objects(url: str, prefix: str) -> set[str]:
    store = RemoteRoot(f"s3://{BUCKET}", s3_options(url), cache_dir=Path("/tmp/unused")).store
    return {m["path"] for batch in obs.list(store, prefix) for m in batch}


@pytest.mark.slow
def test_every_output_lands_in_the_bucket_and_a_fresh_copy_resumes_from_it(tmp_path, s3_server, aws_env):
    path = s3_project(tmp_path, s3_server, "runs/a")
    result = materialize_in_process(path, (*STAGES_TO_REPORT, "hidden_states"), limit=4)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    keys = objects(s3_server, "runs/a/B1")
    for name in (
        "prompts.parquet",
        "quarantine.parquet",
        "tokens.parquet",
        "tokens_errors.parquet",
        "report.json",
    ):
        assert f"runs/a/B1/{name}" in keys, name
    assert any(k.startswith("runs/a/B1/responses/") and k.endswith(".parquet") for k in keys)
    assert any(k.startswith("runs/a/B1/hidden_states/shard-") for k in keys)
    assert "runs/a/B1/hidden_states/index.parquet" in keys
    report = json.loads(
        bytes(
            obs.get(
                RemoteRoot(f"s3://{BUCKET}/runs/a", s3_options(s3_server), tmp_path / "x").store,
                "B1/report.json",
            ).bytes()
        )
    )
    assert report["n_responses"] == 4

    # Another machine (a fresh working copy): it starts from the store, buys only the 2 prompts left, and
    # tokenizes only those.
    other = s3_project(tmp_path / "pod2", s3_server, "runs/a", cache="cache2")
    result = materialize_in_process(other, STAGES_TO_REPORT)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    tokens_md = next(m for m in result.asset_materializations_for_node("tokens")).metadata
    assert tokens_md["tokenized_this_run"].value == 2 and tokens_md["dagster/row_count"].value == 6
    responses_md = next(m for m in result.asset_materializations_for_node("responses")).metadata
    assert responses_md["answered_before_this_run"].value == 4 and responses_md["sent_this_run"].value == 2


def test_two_writers_cannot_both_win(tmp_path, s3_server, aws_env):
    a = RemoteRoot(f"s3://{BUCKET}/race", s3_options(s3_server), tmp_path / "a")
    b = RemoteRoot(f"s3://{BUCKET}/race", s3_options(s3_server), tmp_path / "b")
    for root in (a, b):
        root.local("B1").mkdir(parents=True, exist_ok=True)
    # Both create the same file: the first wins, the second is refused (If-None-Match).
    (a.local("B1") / "tokens.parquet").write_text("from a")
    (b.local("B1") / "tokens.parquet").write_text("from b")
    assert a.push("B1", ["tokens.parquet"]) == 1
    with pytest.raises(ConflictError):
        b.push("B1", ["tokens.parquet"])
    # Both start from the stored file and replace it: the first wins, the second is refused (If-Match).
    b.pull("B1", ["tokens.parquet"])
    assert (b.local("B1") / "tokens.parquet").read_text() == "from a"
    time.sleep(0.01)
    (a.local("B1") / "tokens.parquet").write_text("a again")
    (b.local("B1") / "tokens.parquet").write_text("b again")
    a.push("B1", ["tokens.parquet"])
    with pytest.raises(ConflictError):
        b.push("B1", ["tokens.parquet"])
    b.pull("B1", ["tokens.parquet"])
    assert (b.local("B1") / "tokens.parquet").read_text() == "a again"
    # Appends are new objects with unique names: both writers' parts are kept.
    (a.local("B1") / "responses").mkdir()
    (b.local("B1") / "responses").mkdir()
    (a.local("B1") / "responses" / "part-a.parquet").write_text("a")
    (b.local("B1") / "responses" / "part-b.parquet").write_text("b")
    a.push("B1", ["responses/"])
    b.push("B1", ["responses/"])
    assert b.pull("B1", ["responses/"]) == 1 and sorted(
        p.name for p in (b.local("B1") / "responses").iterdir()
    ) == [
        "part-a.parquet",
        "part-b.parquet",
    ]


def test_the_lease_holds_off_a_second_generator_and_is_taken_over_when_its_holder_died(
    tmp_path, s3_server, aws_env
):
    a = RemoteRoot(f"s3://{BUCKET}/lease", s3_options(s3_server), tmp_path / "a")
    b = RemoteRoot(f"s3://{BUCKET}/lease", s3_options(s3_server), tmp_path / "b")
    with (
        a.lease("B1", "generation for B1"),
        pytest.raises(LeaseHeld, match="already running"),
        b.lease("B1", "generation for B1"),
    ):
        pass
    with b.lease("B1", "generation for B1"):  # released: the next one gets it
        pass
    # A holder that died leaves an expired lease: it is taken over.
    obs.put(
        a.store, "B1/.lease.json", json.dumps({"holder": "dead pod", "expires": time.time() - 1}).encode()
    )
    with b.lease("B1", "generation for B1"):
        held = json.loads(bytes(obs.get(b.store, "B1/.lease.json").bytes()))
        assert held["holder"] != "dead pod"


def test_a_top_up_moves_what_it_adds(tmp_path, s3_server, aws_env):
    root = RemoteRoot(f"s3://{BUCKET}/topup", s3_options(s3_server), tmp_path / "a")
    folder = root.local("B1") / "responses"
    folder.mkdir(parents=True)
    for i in range(20):
        pl.DataFrame({"id": [f"r{i}"]}).write_parquet(folder / f"part-{i:03d}.parquet")
    assert root.push("B1", ["responses/"]) == 20
    pl.DataFrame({"id": ["r20"]}).write_parquet(folder / "part-020.parquet")
    assert root.push("B1", ["responses/"]) == 1  # one new part, nothing else
    fresh = RemoteRoot(f"s3://{BUCKET}/topup", s3_options(s3_server), tmp_path / "b")
    assert fresh.pull("B1", ["responses/"]) == 21
    pl.DataFrame({"id": ["r21"]}).write_parquet(folder / "part-021.parquet")
    root.push("B1", ["responses/"])
    assert fresh.pull("B1", ["responses/"]) == 1  # the top-up: only what was added comes down
