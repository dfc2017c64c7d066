"""Every trained token is the target's own answer to the prompt as it stands, tried as an adversary would:
source files edited between runs, a provider on loopback that answers as another model or lies in its usage
counts, two targets on one storage root. Real Dagster runs of the training-data job (the shipped checks), a
real HTTP provider on loopback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.config import load_config
from eagle3_assets.core.generation.binding import FOREIGN_MODEL, PROMPT_EDITED, PROMPT_REMOVED, TARGET_CHANGED
from eagle3_assets.core.generation.journal import ResponseJournal
from eagle3_assets.core.prompts.ingest import content_id
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.definitions import build_definitions
from eagle3_assets.partitions import dataset_partitions

from .support.engine_runs import KEY, KEY_ENV
from .support.fake_servers import FakeOpenRouter
from .support.projects import make_project, run_training_data_job, write_jsonl

MODEL = "moonshotai/kimi-k2.5"


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def rows_of(texts: list[str], ids: list[str] | None) -> list[dict]:
    rows = []
    for i, text in enumerate(texts):
        row: dict = {"messages": [{"role": "user", "content": text}]}
        if ids is not None:
            row["id"] = ids[i]
        rows.append(row)
    return rows


def project(root: Path, rows: list[dict], server: FakeOpenRouter, stream: bool = False, **dataset) -> Path:
    openrouter = {"base_url": server.base_url, "api_key_env": KEY_ENV, "max_concurrency": 4, "stream": stream}
    openrouter.update(dataset.pop("openrouter", {}))
    top = {"backend": "openrouter", "backends": {"openrouter": openrouter}}
    top.update(dataset.pop("top", {}))
    return make_project(
        root, {"B1": {"rows": rows, "max_tokens": dataset.pop("max_tokens", 64), **dataset}}, **top
    )


def run(path: Path, instance, run_config: dict | None = None, selection=None):
    return run_training_data_job(path, "B1", instance, run_config=run_config, selection=selection)


def failed_checks(result) -> set[str]:
    return {e.check_name for e in result.get_asset_check_evaluations() if not e.passed}


def failure_text(result) -> str:
    """What the failed steps raised, as a user reads it in the run's log."""
    messages = []
    for event in result.all_events:
        error = event.step_failure_data.error if event.is_step_failure else None
        while error is not None:
            messages.append(error.message)
            error = error.cause
    return "\n".join(messages)


def run_check(path: Path, instance, asset: str, name: str):
    """One check of the project at `path`, alone, on partition B1: its evaluation."""
    cfg = load_config(path)
    defs = build_definitions(cfg, str(path))
    key = dg.AssetCheckKey(dg.AssetKey(asset), name)
    job = dg.define_asset_job(
        "one_check", selection=dg.AssetSelection.checks(key), partitions_def=dataset_partitions(cfg)
    )
    result = (
        dg.Definitions(
            assets=defs.assets, asset_checks=defs.asset_checks, resources=defs.resources, jobs=[job]
        )
        .resolve_job_def("one_check")
        .execute_in_process(tags={"dagster/partition": "B1"}, instance=instance, raise_on_error=False)
    )
    [evaluation] = result.get_asset_check_evaluations()
    return evaluation


def layout_of(path: Path) -> DatasetLayout:
    return DatasetLayout(load_config(path).storage_root, "B1")


def aside(layout: DatasetLayout) -> dict[str, str]:
    table = ResponseJournal(layout).aside
    return {r["id"]: r["aside_reason"] for r in table.read().iter_rows(named=True)} if table.files() else {}


def token_texts(layout: DatasetLayout, chat) -> dict[str, str]:
    rows = pl.read_parquet(layout.tokens, columns=["id", "input_ids"])
    return {i: chat.tok.decode(ids) for i, ids in zip(rows["id"], rows["input_ids"].to_list(), strict=True)}


def materialization_metadata(result, asset: str) -> dict:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key == dg.AssetKey(asset)]
    return event.materialization.metadata


@pytest.mark.parametrize("with_ids", [True, False], ids=["ids", "content-ids"])
def test_edited_deleted_reordered_and_added_rows(tmp_path, instance, chat, with_ids):
    texts = ["write a haiku about the sea", "name a river", "name a mountain", "name a city", "name a lake"]
    ids = ["p0", "p1", "p2", "p3", "p4"] if with_ids else None
    with FakeOpenRouter(key=KEY) as server:
        path = project(tmp_path, rows_of(texts, ids), server)
        first = run(path, instance)
        assert first.success and failed_checks(first) <= {"tokens_reference_match"}  # (UNVERIFIED: text only)
        assert len(server.hits) == 5
        layout = layout_of(path)

        # Edited (row 0), deleted (row 1), reordered (rows 3 and 2), added (row 5).
        edited = [
            "EDITED: write a haiku about the sea",
            "name a city",
            "name a mountain",
            "name a lake",
            "a sea",
        ]
        new_ids = ["p0", "p3", "p2", "p4", "p5"] if with_ids else None
        write_jsonl(path.parent / "prompts" / "B1.jsonl", rows_of(edited, new_ids))
        second = run(path, instance)
        assert second.success and failed_checks(second) <= {"tokens_reference_match"}
        sent = [h.prompt for h in server.hits[5:]]
        assert sorted(sent) == ["EDITED: write a haiku about the sea", "a sea"]  # each once, nothing else
        trained = token_texts(layout, chat)
        assert len(trained) == 5
        edited_id = "p0" if with_ids else content_id([{"role": "user", "content": edited[0]}])
        assert "Answer to: EDITED: write a haiku" in trained[edited_id]  # the new question's own answer
        assert all("Answer to: write a haiku" not in t for t in trained.values())
        old_id = "p0" if with_ids else content_id([{"role": "user", "content": texts[0]}])
        removed_id = "p1" if with_ids else content_id([{"role": "user", "content": texts[1]}])
        assert aside(layout) == {
            old_id: PROMPT_EDITED if with_ids else PROMPT_REMOVED,
            removed_id: PROMPT_REMOVED,
        }
        md = materialization_metadata(second, "responses")
        assert md["asked_again"].value == (1 if with_ids else 0)
        report = json.loads(layout.report_json.read_text())
        assert report["n_responses"] == 5 and report["answers_set_aside"] == {
            k: 1 for k in {PROMPT_EDITED if with_ids else PROMPT_REMOVED, PROMPT_REMOVED}
        } | ({PROMPT_REMOVED: 2} if not with_ids else {})

        # The deleted row comes back: its answer is restored, nothing is bought again.
        write_jsonl(
            path.parent / "prompts" / "B1.jsonl",
            rows_of([*edited, texts[1]], [*new_ids, "p1"] if ids else None),
        )
        third = run(path, instance)
        assert third.success and len(server.hits) == 7
        assert len(token_texts(layout, chat)) == 6
        assert materialization_metadata(third, "responses")["answers_restored"].value == 1


def test_turns_all_a_conversation_edited_in_its_middle_is_asked_again_from_the_edit(tmp_path, instance, chat):
    def conversation(i: int, second: str) -> dict:
        return {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"first question {i}"},
                {"role": "assistant", "content": "the source's own answer"},
                {"role": "user", "content": second},
                {"role": "assistant", "content": "another source answer"},
                {"role": "user", "content": f"third question {i}"},
            ],
        }

    with FakeOpenRouter(key=KEY) as server:
        path = project(
            tmp_path, [conversation(0, "second 0"), conversation(1, "second 1")], server, turns="all"
        )
        assert run(path, instance).success and len(server.hits) == 6
        write_jsonl(
            path.parent / "prompts" / "B1.jsonl",
            [conversation(0, "EDITED second 0"), conversation(1, "second 1")],
        )
        second = run(path, instance)
        assert second.success and failed_checks(second) <= {"tokens_reference_match"}
        # Turns 2 and 3 of the edited conversation, nothing of the other one.
        assert [h.prompt for h in server.hits[6:]] == ["EDITED second 0", "third question 0"]
        layout = layout_of(path)
        assert aside(layout) == {"c0#t2": PROMPT_EDITED, "c0#t3": "earlier_turn_changed"}
        texts = " ".join(token_texts(layout, chat).values())
        assert "Answer to: EDITED second 0" in texts and "Answer to: second 0" not in texts


def test_an_answer_from_another_model_is_never_trained(tmp_path, instance, chat):
    # The endpoint lists no models (preflight cannot tell): the answers say which model wrote them.
    with FakeOpenRouter(key=KEY, model="evil/other-model-7b", list_models=False) as server:
        path = project(tmp_path, rows_of(["q1", "q2", "q3"], ["p1", "p2", "p3"]), server)
        result = run(path, instance)
        layout = layout_of(path)
        journal = ResponseJournal(layout)
        assert journal.done_ids() == set()  # not one stored as an answer
        failures = journal.failures.read(keep="last")
        assert set(failures["error_kind"]) == {FOREIGN_MODEL} and failures.height == 3
        assert "evil/other-model-7b" in failures["message"][0]
        # Paid for all the same: kept aside and charged to the budget.
        assert set(aside(layout).values()) == {FOREIGN_MODEL}
        assert journal.prior_usage().completion_tokens > 0
        assert "responses_failure_share" in failed_checks(result)

        # Answers a config accepted (a name later found not to be the target's) are held by a blocking check
        # until the responses stage sets them aside; the tokens stage never trains them meanwhile.
        accepting = project(
            tmp_path,
            rows_of(["q1", "q2", "q3"], ["p1", "p2", "p3"]),
            server,
            openrouter={"accepted_models": ["evil/*"]},
        )
        shutil.rmtree(layout.dir)
        assert run(accepting, instance).success and len(journal.done_ids()) == 3
        strict = project(tmp_path, rows_of(["q1", "q2", "q3"], ["p1", "p2", "p3"]), server)
        tokens = run(strict, instance, selection=["tokens"])
        assert tokens.success and pl.read_parquet(layout.tokens).height == 0
        evaluation = run_check(strict, instance, "responses", "responses_from_target")
        assert not evaluation.passed and evaluation.metadata["foreign_answers"].value == 3


def test_usage_counts_are_our_own(tmp_path, instance, chat):
    """A provider that reports 1 token for ~30-token answers buys no more than the budget; a 10 MB answer
    reported as 5 tokens is read up to max_tokens and no further."""
    long_answer = "a sentence of about ten tokens in all. " * 3
    texts = [f"question {i}" for i in range(40)]
    with FakeOpenRouter(key=KEY, completion_tokens=1, answer_text=lambda p: long_answer) as server:
        path = project(tmp_path, rows_of(texts, None), server, budget_tokens=400, max_tokens=64)
        result = run(path, instance)
        layout = layout_of(path)
        stored = ResponseJournal(layout).responses.read()
        charged = int(stored["completion_tokens"].sum())
        counted = int(stored["counted_completion_tokens"].sum())
        assert int(stored["reported_completion_tokens"].sum()) == stored.height  # the lie, kept on record
        assert charged == counted and charged <= 400 + 4 * 40  # the budget, overshot by at most the in-flight
        assert stored.height < 20  # not the 40 that 1-token answers would have allowed
        md = materialization_metadata(result, "responses")
        assert md["completion_tokens_counted_here"].value == counted
        report = json.loads(layout.report_json.read_text())
        assert (
            report["completion_tokens_reported"] == stored.height and report["completion_tokens"] == charged
        )

    flood = "AAAA " * 400_000  # 2 MB, ~8,000x what max_tokens=64 allows
    for stream in (True, False):
        root = tmp_path / f"flood-{stream}"
        with FakeOpenRouter(key=KEY, completion_tokens=5, answer_text=lambda p: flood) as server:
            path = project(
                root, rows_of(["q1", "q2", "q3", "q4"], None), server, stream=stream, max_tokens=64
            )
            run(path, instance)
            journal = ResponseJournal(layout_of(path))
            stored = journal.responses.read()
            if stream:  # read up to the limit, the connection closed: kept, cut at max_tokens
                assert stored.height == 4 and stored["cut_at_max_tokens"].all()
                assert (stored["counted_completion_tokens"] == 64).all() and (
                    stored["finish_reason"] == "length"
                ).all()
                assert max(len(c) for c in stored["content"]) < 1000
                # Each 5-byte word goes in an event of over 100 bytes: the 4 whole streams are over 160 MB.
                # The closed connections stopped the provider within a quarter of that (what loopback's socket
                # buffers took: a few MB each); the client itself read a few KB of each.
                assert server.stream_bytes < 0.25 * 4 * 400_000 * 100
                assert pl.read_parquet(layout_of(path).tokens)["n_tokens"].max() < 64 + 64
            else:  # a body larger than max_tokens allows: not read, refused, charged
                failures = journal.failures.read(keep="last")
                assert stored.height == 0 and set(failures["error_kind"]) == {"oversized"}
                assert journal.prior_usage().completion_tokens >= 4 * 64


def test_two_targets_on_one_storage_root_never_mix(tmp_path, instance, chat, smollm2_dir):
    rows = rows_of(["q1", "q2", "q3"], ["p1", "p2", "p3"])
    other_weights = tmp_path / "other-target"
    shutil.copytree(smollm2_dir, other_weights)
    with FakeOpenRouter(key=KEY) as a_server, FakeOpenRouter(key=KEY, model="other/model") as b_server:
        a = project(tmp_path / "a", rows, a_server, top={"storage": {"root": str(tmp_path / "shared")}})
        b = project(
            tmp_path / "b",
            rows,
            b_server,
            openrouter={"model": "other/model"},
            top={"storage": {"root": str(tmp_path / "shared")}, "target": {"model": str(other_weights)}},
        )
        assert run(a, instance).success and len(a_server.hits) == 3
        layout = layout_of(a)
        before = pl.read_parquet(layout.tokens)

        # The other target refuses before any request, naming both; its tokens stage refuses too.
        refused = run(b, instance)
        assert not refused.success and b_server.hits == []
        message = failure_text(refused)
        assert "another target" in message and str(other_weights) in message and "builtin:smollm2" in message
        assert not run(b, instance, selection=["tokens"]).success
        assert pl.read_parquet(layout.tokens).equals(before)  # not rewritten with another target's answers
        states = (
            build_definitions(load_config(b), str(b))
            .resolve_implicit_global_asset_job_def()
            .execute_in_process(
                partition_key="B1",
                instance=instance,
                asset_selection=[dg.AssetKey("hidden_states")],
                raise_on_error=False,
            )
        )
        assert not states.success and "not to the config's target" in failure_text(states)  # before any GPU
        assert not layout.hidden_states_dir.exists() or not list(layout.hidden_states_dir.glob("shard-*"))
        held = run_check(b, instance, "responses", "responses_from_target")  # the answers are not B's
        assert not held.passed and str(other_weights) in held.metadata["target_conflicts"].text
        assert run_check(a, instance, "responses", "responses_from_target").passed

        # A fresh answer set: the first target's answers set aside, every prompt asked of the new one.
        fresh = {"ops": {"responses": {"config": {"fresh_answers": True}}}}
        assert run(b, instance, fresh).success and len(b_server.hits) == 3
        assert set(aside(layout).values()) == {TARGET_CHANGED}
        assert set(ResponseJournal(layout).responses.read()["model"]) == {"other/model"}

        # Back to the first target: refused again, unless fresh; its own answers come back, nothing is bought.
        assert not run(a, instance).success
        assert run(a, instance, fresh).success and len(a_server.hits) == 3
        assert set(ResponseJournal(layout).responses.read()["model"]) == {MODEL}
