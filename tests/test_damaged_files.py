"""A damaged file never bricks a partition: each kind of damage (cut to half, not Parquet, a Parquet file
of another schema) in each file a stage reads is set aside in quarantine/<stage>/ with its reason, and the
stage goes on: answers are asked again (once, charged), tables rebuilt, shards recomputed; the warning
check lists what was set aside. Locally, and through an object-store root's working copy (moto's S3 server
on loopback)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from eagle3_assets.config import DatasetConfig, load_config
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.journal import ResponseJournal
from eagle3_assets.core.generation.ledger import lost_rows
from eagle3_assets.core.generation.protocol import Completion
from eagle3_assets.core.generation.run import generate_responses
from eagle3_assets.core.hidden_states.shards import (
    INDEX_SCHEMA,
    Sample,
    plan_work,
    set_aside_damaged,
    write_index,
    write_shard,
)
from eagle3_assets.core.prompts.ingest import ensure_prompts, write_prompts
from eagle3_assets.core.report import validation
from eagle3_assets.core.report.summary import build_report
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.quarantine import parquet_problem, quarantined, safetensors_problem
from eagle3_assets.core.storage.tables import IMPORT_REJECTED_SCHEMA
from eagle3_assets.core.tokens.build import build_tokens

from .support.engine_runs import make_plan
from .support.object_store import s3_storage
from .support.projects import make_project, user_rows, write_jsonl

KINDS = ["truncated", "not_parquet", "wrong_schema"]
GARBAGE = random.Random(0).randbytes(64)  # arbitrary bytes, the same in every run
N = 12  # prompts per dataset: small, every test runs in a second or two


def damage(path: Path, kind: str) -> None:
    """What an interrupted copy, a lossy disk or a wrong file dropped in place leaves."""
    if kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "not_parquet":
        path.write_bytes(b"this is not a parquet file\n" + GARBAGE)
    elif kind == "wrong_schema":
        pl.DataFrame({"something": [1, 2, 3], "else": ["a", "b", "c"]}).write_parquet(path)
    else:
        raise ValueError(kind)


class _Backend:
    """Answers at once and records what was asked."""

    name, model, wants_prompt_ids = "openrouter", "m", False
    served = None

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def start(self): ...

    async def preflight(self):
        return []

    async def complete(self, request):
        self.asked.append(request.id)
        await asyncio.sleep(0)
        return Completion(
            content=f"answer to {request.id}",
            finish_reason="stop",
            prompt_tokens=3,
            completion_tokens=5,
            model="m",
            cost_usd=0.001,
        )

    async def close(self): ...


SETTINGS = EngineSettings(max_concurrency=4, flush_interval_s=0.05, progress_interval_s=5, fatal_grace_s=1)


def dataset(root: Path, src_dir: Path, n: int = N) -> tuple[DatasetLayout, Path]:
    layout = DatasetLayout(root, "B1").ensure()
    src = write_jsonl(src_dir / "B1.jsonl", user_rows([f"question {i}" for i in range(n)]))
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    return layout, src


def answer(layout: DatasetLayout, chat, limit: int | None = None, **kw) -> tuple[_Backend, object]:
    backend = _Backend()
    plan = make_plan("B1", 16, 10_000_000, limit=limit)
    summary = generate_responses(layout, plan, backend, chat, SETTINGS, log=lambda m: None, **kw)
    return backend, summary


def only_file(folder: Path, pattern: str = "*.parquet") -> Path:
    files = sorted(folder.glob(pattern))
    assert len(files) == 1, files
    return files[0]


def assert_set_aside(layout: DatasetLayout, stage: str, was: str, kind: str, rows: int | None = None):
    records = quarantined(layout.dir, stage)
    assert [r.path for r in records] == [was], records
    record = records[0]
    assert {"truncated": "cut short", "not_parquet": "not a Parquet", "wrong_schema": "wrong schema"}[
        kind
    ] in (record.reason) or (kind == "truncated" and "not a Parquet file or cut short" in record.reason), (
        record.reason
    )
    assert (layout.dir / record.moved_to).exists()
    (saved,) = layout.damaged_records(stage).glob("*.json")
    assert saved.name == Path(record.moved_to).name + ".json" and json.loads(saved.read_text())["path"] == was
    if rows is not None:
        assert record.rows == rows
    verdict = validation.damaged_files(records)
    assert not verdict.passed and was in verdict.metadata["files"]
    return record


# -- the checks themselves
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_each_damage_is_recognised_and_a_whole_file_is_not(tmp_path, kind):
    path = tmp_path / "t.parquet"
    pl.DataFrame({"id": ["a", "b"], "n": [1, 2]}).write_parquet(path)
    schema = {"id": pl.String, "n": pl.Int64}
    assert parquet_problem(path, schema, ["id", "n"]) is None
    damage(path, kind)
    assert parquet_problem(path, schema, ["id", "n"]) is not None


# -- responses: parts of the journal
# --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_responses_part_is_set_aside_and_its_prompts_asked_again_once(tmp_path, chat, kind):
    layout, _ = dataset(tmp_path / "data", tmp_path)
    first, _ = answer(layout, chat, limit=5)
    part = only_file(layout.responses_dir)
    held = set(pl.read_parquet(part)["id"])
    assert held == set(first.asked) and len(held) == 5
    answer(layout, chat)  # the other 7, in a second file
    damage(part, kind)

    again, _ = answer(layout, chat)
    assert sorted(again.asked) == sorted(held)  # exactly the answers the part held, asked again
    record = assert_set_aside(layout, "responses", f"responses/{part.name}", kind, rows=5)
    assert record.details["completion_tokens"] == 25.0
    journal = ResponseJournal(layout)
    assert journal.done_ids() == {f"p{i:03d}" for i in range(N)}
    usage = journal.prior_usage()
    # What the set-aside answers cost stays charged: 12 answers stored + 5 paid and lost, 5 tokens each.
    assert usage.completion_tokens == (N + 5) * 5 and usage.lost_requests == 5
    assert usage.cost_usd == pytest.approx((N + 5) * 0.001)
    # Paid again at most once: the next run asks nothing and sets nothing else aside.
    idle, _ = answer(layout, chat)
    assert idle.asked == [] and len(quarantined(layout.dir)) == 1
    assert ResponseJournal(layout).prior_usage().completion_tokens == (N + 5) * 5


def test_a_part_cut_after_a_kill_is_charged_once_through_the_runs_ledger(tmp_path, chat):
    """A crashed run's part: its dispatch ledger survives, and charges the ids as bought and unstored (the
    tally does not charge them a second time)."""
    layout, _ = dataset(tmp_path / "data", tmp_path)
    journal = ResponseJournal(layout)
    ledger = journal.ledger("crashed")
    from eagle3_assets.core.generation.journal import JournalWriter

    writer = JournalWriter(journal, "openrouter", "crashed")
    for i in range(4):
        ledger.sent(f"p{i:03d}")
        writer.add_completion(
            f"p{i:03d}", Completion("a", "stop", prompt_tokens=3, completion_tokens=5, model="m")
        )
    writer.flush_sync()
    ledger.close()  # the run dies here: no settle, no fold
    damage(only_file(layout.responses_dir), "truncated")

    again, summary = answer(layout, chat)
    assert sorted(again.asked) == [f"p{i:03d}" for i in range(N)]
    assert summary.lost_in_flight == 4  # charged once, by the ledger
    assert ResponseJournal(layout).prior_usage().lost_requests == 4
    assert len(quarantined(layout.dir, "responses")) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_failures_part_is_set_aside_and_its_prompts_tried_again(tmp_path, chat, kind):
    layout, _ = dataset(tmp_path / "data", tmp_path)
    failed = [f"p{i:03d}" for i in range(3)]
    ResponseJournal(layout).failures.append(
        {
            "id": failed,
            "error_kind": ["refused"] * 3,
            "message": ["no"] * 3,
            "attempts": [1] * 3,
            "permanent": [True] * 3,
            "backend": ["openrouter"] * 3,
            "status": [400] * 3,
            "created_at": [time.time()] * 3,
            "run_id": ["r0"] * 3,
        }
    )
    part = only_file(layout.failures_dir)
    damage(part, kind)
    again, _ = answer(layout, chat)
    assert set(failed) <= set(again.asked) and len(again.asked) == N
    assert_set_aside(layout, "responses", f"failures/{part.name}", kind, rows=3)


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_ledger_part_keeps_its_charge(tmp_path, chat, kind):
    """journal/lost/: charges for answers bought and never stored. A lost part cannot say what it charged; its
    tally can, and the charge is carried over (a budget never gains room from damage)."""
    layout, _ = dataset(tmp_path / "data", tmp_path)
    journal = ResponseJournal(layout)
    journal.lost.append(lost_rows("r0", ["p000", "p001"], 40.0, 0.02))
    part = only_file(layout.lost_dir)
    damage(part, kind)
    answer(layout, chat)
    assert_set_aside(layout, "responses", f"journal/lost/{part.name}", kind, rows=2)
    usage = ResponseJournal(layout).prior_usage()
    assert usage.lost_tokens == pytest.approx(80.0)
    assert usage.completion_tokens == N * 5 + 80


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_imports_file_is_set_aside(tmp_path, chat, kind):
    layout, _ = dataset(tmp_path / "data", tmp_path)
    path = layout.imports_dir / "rejected-x-1.parquet"
    path.parent.mkdir(parents=True)
    pl.DataFrame({"source_row": [3], "reason": ["no prompt"]}, schema=IMPORT_REJECTED_SCHEMA).write_parquet(
        path
    )
    damage(path, kind)
    again, _ = answer(layout, chat)
    assert len(again.asked) == N
    assert_set_aside(layout, "responses", f"imports/{path.name}", kind)


# -- tables
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_prompts_table_is_set_aside_and_written_again(tmp_path, chat, kind):
    layout, src = dataset(tmp_path / "data", tmp_path)
    before = pl.read_parquet(layout.prompts)
    damage(layout.prompts, kind)
    # A stage that reads prompts.parquet repairs it from the source before it reads (ensure_prompts) ...
    set_aside = ensure_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    assert [q.path for q in set_aside] == ["prompts.parquet"]
    assert pl.read_parquet(layout.prompts).equals(before)
    assert_set_aside(layout, "prompts", "prompts.parquet", kind)
    # ... and then the stage goes on.
    again, _ = answer(layout, chat)
    assert len(again.asked) == N
    assert ensure_prompts(src, layout, DatasetConfig(source=str(src), format="messages")) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_tokens_table_is_set_aside_and_rebuilt(tmp_path, chat, kind):
    layout, _ = dataset(tmp_path / "data", tmp_path)
    answer(layout, chat)
    build_tokens(layout, chat, log=lambda m: None, workers=1)
    before = pl.read_parquet(layout.tokens).sort("id")
    damage(layout.tokens, kind)
    s = build_tokens(layout, chat, log=lambda m: None, workers=1)
    assert [q.path for q in s.set_aside] == ["tokens.parquet"] and s.n_tokenized == N
    assert (
        pl.read_parquet(layout.tokens)
        .sort("id")
        .select("id", "input_ids", "loss_mask")
        .equals(before.select("id", "input_ids", "loss_mask"))
    )
    assert_set_aside(layout, "tokens", "tokens.parquet", kind)


def test_tokens_rebuild_without_the_answers_of_a_damaged_part(tmp_path, chat):
    """The tokens stage does not own the journal: it skips a damaged part (the responses stage sets it aside
    and asks again), and the next build after that picks the answers up again."""
    layout, _ = dataset(tmp_path / "data", tmp_path)
    answer(layout, chat, limit=5)
    part = only_file(layout.responses_dir)
    answer(layout, chat)
    build_tokens(layout, chat, log=lambda m: None, workers=1)
    damage(part, "truncated")
    s = build_tokens(layout, chat, log=lambda m: None, workers=1)
    assert s.n_rows == N - 5
    answer(layout, chat)
    assert build_tokens(layout, chat, log=lambda m: None, workers=1).n_rows == N


def _shards(folder: Path) -> None:
    """Two small shards in the project's format (what the extraction writes), and their index."""
    import torch

    rng = np.random.default_rng(0)
    for name, ids in (("shard-a.safetensors", ["p000", "p001"]), ("shard-b.safetensors", ["p002"])):
        samples = [
            Sample(i, np.arange(4, dtype=np.int32) + k, np.ones(4, dtype=np.int8)) for k, i in enumerate(ids)
        ]
        T = 4 * len(samples)
        write_shard(
            folder / name,
            samples,
            torch.from_numpy(rng.standard_normal((T, 768)).astype(np.float32)),
            torch.from_numpy(rng.standard_normal((T, 256)).astype(np.float32)),
            {"model": "m", "aux_layers": "[1, 2, 3]", "dtype": "float32"},
        )
    write_index(folder)


@pytest.mark.parametrize("kind", ["truncated", "not_safetensors", "wrong_schema"])
def test_a_damaged_shard_is_set_aside_and_its_samples_planned_again(tmp_path, kind):
    layout = DatasetLayout(tmp_path, "B1").ensure()
    folder = layout.hidden_states_dir
    folder.mkdir()
    _shards(folder)
    shard = folder / "shard-a.safetensors"
    if kind == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        assert safetensors_problem(shard) is not None
    elif kind == "not_safetensors":
        shard.write_bytes(b"not a safetensors file" + GARBAGE)
        assert safetensors_problem(shard) is not None
    else:  # a whole safetensors file, of something else
        import torch
        from safetensors.torch import save_file

        save_file({"weight": torch.zeros(3)}, str(shard), metadata={"format": "pt"})
        assert safetensors_problem(shard) is None
    set_aside = set_aside_damaged(layout.dir, folder)
    assert [q.path for q in set_aside] == ["hidden_states/shard-a.safetensors"]
    assert set_aside[0].rows == (2 if kind == "truncated" else None)  # a cut shard still names its samples
    assert ("wrong schema" in set_aside[0].reason) == (kind == "wrong_schema")
    tokens = pl.DataFrame(
        {"id": ["p000", "p001", "p002"], "input_ids": [list(range(k, k + 4)) for k in (0, 1, 0)]},
        schema={"id": pl.String, "input_ids": pl.List(pl.Int32)},
    )
    work = plan_work(tokens, folder, 10**9, 16, 10_000)
    assert {i for p in work.todo for i in p.ids} == {"p000", "p001"}
    assert validation.damaged_files(quarantined(layout.dir, "hidden_states")).passed is False


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_index_is_set_aside_and_rebuilt(tmp_path, kind):
    layout = DatasetLayout(tmp_path, "B1").ensure()
    folder = layout.hidden_states_dir
    folder.mkdir()
    _shards(folder)
    before = pl.read_parquet(layout.hidden_states_index)
    damage(layout.hidden_states_index, kind)
    set_aside = set_aside_damaged(layout.dir, folder)
    assert [q.path for q in set_aside] == ["hidden_states/index.parquet"]
    assert write_index(folder).sort("id").equals(before.sort("id"))
    assert set(INDEX_SCHEMA) <= set(pl.read_parquet(layout.hidden_states_index).columns)
    assert_set_aside(layout, "hidden_states", "hidden_states/index.parquet", kind)


def test_the_report_lists_what_was_set_aside_and_reads_around_damage(tmp_path, chat):
    layout, _ = dataset(tmp_path / "data", tmp_path)
    answer(layout, chat, limit=5)
    part = only_file(layout.responses_dir)
    answer(layout, chat)
    build_tokens(layout, chat, log=lambda m: None, workers=1)
    damage(part, "truncated")
    damage(layout.tokens, "not_parquet")  # not yet rebuilt: the report reads it as missing, and does not fail
    answer(layout, chat)
    report = build_report(layout, DatasetConfig(source="x", format="messages")).to_json()
    assert [d["path"] for d in report["damaged_files"]] == [f"responses/{part.name}"]
    assert report["n_responses"] == N and report["n_tokens_rows"] == 0


# -- through Dagster: the warning check
# -----------------------------------------------------------------------
def test_the_quarantined_files_check_warns_in_a_run(tmp_path):
    import dagster as dg

    from eagle3_assets.definitions import build_definitions

    path = make_project(tmp_path, {"B1": {"rows": user_rows(["a", "b", "c"])}})
    defs = build_definitions(load_config(path), str(path))
    job = defs.resolve_implicit_global_asset_job_def()

    def run():
        with dg.instance_for_test() as instance:
            result = job.execute_in_process(
                partition_key="B1", instance=instance, asset_selection=[dg.AssetKey("prompts")]
            )
        assert result.success
        (ev,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "quarantined_files"]
        return ev

    assert run().passed
    damage(tmp_path / "data" / "B1" / "prompts.parquet", "truncated")
    ev = run()
    assert not ev.passed and ev.severity == dg.AssetCheckSeverity.WARN
    assert "prompts.parquet" in ev.metadata["files"].value
    assert pl.read_parquet(tmp_path / "data" / "B1" / "prompts.parquet").height == 3


def test_after_a_kill_a_cut_part_no_longer_bricks_the_partition(tmp_path):
    """A killed run's cut file, through Dagster on the embedded model: the newest part of responses/ cut to
    half (and tokens.parquet with it); the next run of the training-data job succeeds, asks the part's prompts
    again, and the warning checks and the report say what was set aside."""
    import dagster as dg

    from eagle3_assets.definitions import TRAINING_DATA_JOB, build_definitions

    texts = ["Name a colour.", "What is 2 plus 2?", "Say hello.", "Name a fruit."]
    path = make_project(tmp_path, {"B1": {"rows": user_rows(texts), "max_tokens": 8}})
    defs = build_definitions(load_config(path), str(path))
    job = defs.resolve_job_def(TRAINING_DATA_JOB)
    root = tmp_path / "data" / "B1"

    def run(limit=None):
        with dg.instance_for_test() as instance:
            result = job.execute_in_process(
                partition_key="B1",
                instance=instance,
                raise_on_error=False,
                run_config={"ops": {"responses": {"config": {"limit": limit}}}} if limit else None,
            )
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        return {(e.asset_key.path[-1], e.check_name): e for e in result.get_asset_check_evaluations()}

    run(limit=2)
    first = only_file(root / "responses")
    held = set(pl.read_parquet(first)["id"])
    checks = run()
    assert checks[("responses", "quarantined_files")].passed
    damage(first, "truncated")
    damage(root / "tokens.parquet", "truncated")
    checks = run()
    for asset in ("responses", "tokens"):
        ev = checks[(asset, "quarantined_files")]
        assert not ev.passed and ev.severity == dg.AssetCheckSeverity.WARN, asset
    assert checks[("prompts", "quarantined_files")].passed
    answered = pl.concat([pl.read_parquet(p) for p in (root / "responses").glob("*.parquet")])
    assert sorted(answered["id"]) == sorted(f"p{i:03d}" for i in range(4)) and held
    assert pl.read_parquet(root / "tokens.parquet").height == 4
    report = json.loads((root / "report.json").read_text())
    assert {d["path"] for d in report["damaged_files"]} == {f"responses/{first.name}", "tokens.parquet"}
    assert "Damaged files set aside" in (root / "report.md").read_text()


# -- an object-store root
# -------------------------------------------------------------------------------------
@pytest.fixture
def remote_project(tmp_path, s3_server, aws_env):
    prefix = f"runs/{tmp_path.name}"

    def storage(cache: str):
        from resources.storage import Storage

        path = make_project(
            tmp_path,
            {"B1": {"rows": user_rows([f"question {i}" for i in range(N)])}},
            storage=s3_storage(s3_server, prefix, tmp_path / cache),
        )
        cfg = load_config(path)
        return Storage(cfg), cfg

    return storage, prefix


def _objects(storage, prefix: str) -> dict[str, bytes]:
    import obstore as obs

    store = storage.remote.store
    return {
        m["path"]: bytes(obs.get(store, m["path"]).bytes()) for batch in obs.list(store, "B1/") for m in batch
    }


def _run_responses(storage, cfg, chat) -> _Backend:
    backend = _Backend()
    plan = make_plan("B1", 16, 10_000_000)
    with storage.stage("B1", "responses", append_only=True) as layout:
        generate_responses(
            layout,
            plan,
            backend,
            chat,
            SETTINGS,
            log=lambda m: None,
            lock=storage.lock("B1"),
            on_flush=storage.flusher("B1"),
        )
    return backend


def test_on_an_object_store_a_damaged_part_is_moved_aside_in_the_bucket(remote_project, chat):
    make_storage, prefix = remote_project
    storage, cfg = make_storage("cache-a")
    with storage.stage("B1", "prompts") as layout:
        write_prompts(cfg.resolve_path(cfg.dataset("B1").source), layout, cfg.dataset("B1"))
    first = _Backend()
    with storage.stage("B1", "responses", append_only=True) as layout:
        generate_responses(
            layout,
            make_plan("B1", 16, 10**7, limit=5),
            first,
            chat,
            SETTINGS,
            log=lambda m: None,
            lock=storage.lock("B1"),
            on_flush=storage.flusher("B1"),
        )
    _run_responses(storage, cfg, chat)
    # The store loses the tail of the first run's file (after the fact: the copies here are whole).
    import obstore as obs

    parts = sorted(
        k for k in _objects(storage, prefix) if k.startswith("B1/responses/") and k.endswith(".parquet")
    )
    victim = next(
        k for k in parts if set(pl.read_parquet(storage.layout("B1").dir / k[3:])["id"]) == set(first.asked)
    )
    data = bytes(obs.get(storage.remote.store, victim).bytes())
    obs.put(storage.remote.store, victim, data[: len(data) // 2])

    fresh, _ = make_storage("cache-b")  # another pod: a fresh working copy
    again = _run_responses(fresh, cfg, chat)
    assert sorted(again.asked) == sorted(first.asked)
    stored = _objects(fresh, prefix)
    assert victim not in stored  # the damaged object is gone from responses/ ...
    aside = [k for k in stored if k.startswith("B1/quarantine/responses/")]
    assert len(aside) == 2 and any(
        k.endswith(".json") for k in aside
    )  # ... and kept in quarantine/, with why
    record = json.loads(next(stored[k] for k in aside if k.endswith(".json")))
    assert record["path"] == victim[3:] and record["rows"] == 5
    # A third copy reads the bucket as whole: every prompt answered, nothing asked, the check still warns.
    third, _ = make_storage("cache-c")
    assert _run_responses(third, cfg, chat).asked == []
    layout = third.checkout("B1", "quarantine")
    assert not validation.damaged_files(quarantined(layout.dir, "responses")).passed
    assert ResponseJournal(third.checkout("B1", "responses")).done_ids() == {f"p{i:03d}" for i in range(N)}


def test_on_an_object_store_a_damaged_tokens_table_is_rebuilt(remote_project, chat):
    make_storage, prefix = remote_project
    storage, cfg = make_storage("cache-a")
    with storage.stage("B1", "prompts") as layout:
        write_prompts(cfg.resolve_path(cfg.dataset("B1").source), layout, cfg.dataset("B1"))
    _run_responses(storage, cfg, chat)
    with storage.stage("B1", "tokens") as layout:
        build_tokens(layout, chat, log=lambda m: None, workers=1)
    import obstore as obs

    obs.put(storage.remote.store, "B1/tokens.parquet", b"garbage, not parquet")
    fresh, _ = make_storage("cache-b")
    with fresh.stage("B1", "tokens") as layout:
        s = build_tokens(layout, chat, log=lambda m: None, workers=1)
    assert [q.path for q in s.set_aside] == ["tokens.parquet"] and s.n_rows == N
    stored = _objects(fresh, prefix)
    assert parquet_problem(fresh.layout("B1").tokens) is None
    assert stored["B1/tokens.parquet"][:4] == b"PAR1"
    assert any(k.startswith("B1/quarantine/tokens/") and k.endswith(".json") for k in stored)


def test_parts_written_before_the_tally_existed_are_tallied_once(tmp_path, chat):
    layout, _ = dataset(tmp_path / "data", tmp_path)
    answer(layout, chat, limit=5)
    part = only_file(layout.responses_dir)
    answer(layout, chat)
    (layout.journal_dir / "tally-responses.json").unlink()  # as an older version left the journal
    answer(layout, chat)  # nothing to ask; the tally is rebuilt from the parts
    damage(part, "truncated")
    again, _ = answer(layout, chat)
    assert len(again.asked) == 5
    assert quarantined(layout.dir, "responses")[0].rows == 5
    assert ResponseJournal(layout).prior_usage().completion_tokens == (N + 5) * 5


def test_wiring_the_summary_counts_what_was_set_aside_and_asked_again(tmp_path, chat):
    from eagle3_assets.assets.responses import summary_metadata

    layout, _ = dataset(tmp_path / "data", tmp_path)
    answer(layout, chat, limit=5)
    part = only_file(layout.responses_dir)
    answer(layout, chat)
    damage(part, "truncated")
    again, summary = answer(layout, chat)
    assert summary.set_aside.answers == 5 == len(again.asked)
    md = summary_metadata(summary, 4)
    assert md["damaged_files_set_aside"] == 1 and md["answers_asked_again"] == 5
    assert md["set_aside_tokens_charged"] == 25
