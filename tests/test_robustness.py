"""Failure paths found in review: journal write errors, shard writer errors, configuration-wide errors,
templates that render history differently, budgets without cost reports, top-ups after a budget stop."""

from __future__ import annotations

import asyncio
import copy
import json

import polars as pl
import pytest

from eagle3_assets.config import DatasetConfig
from eagle3_assets.core.generation.budget import Budget
from eagle3_assets.core.generation.engine import GenerationEngine
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.importer import import_responses
from eagle3_assets.core.generation.journal import JournalWriter, ResponseJournal
from eagle3_assets.core.generation.lanes import Lane
from eagle3_assets.core.generation.protocol import Completion, CompletionRequest, FatalRunError
from eagle3_assets.core.generation.topup import top_up_status
from eagle3_assets.core.hidden_states.shards import ShardWriter
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.tables import FAILURE_SCHEMA, JournalTable
from eagle3_assets.core.target_model.chat import Answer, ChatTokenizer, TemplateError
from resources.inference.sglang import split_reasoning

from .support.engine_runs import IMPORTED_AS_TARGET, KEY, KEY_ENV, SMOLLM2, dataset, run
from .support.fake_servers import FakeOpenRouter

QWEN3_LIKE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_history_rendered_differently_is_an_error_not_silent_corruption(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = QWEN3_LIKE
    chat = ChatTokenizer(tok)
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert not isinstance(chat.tokenize([(msgs, Answer("Bye!"))])[0], TemplateError)
    res = chat.tokenize([(msgs, Answer("Bye!"))], train_all=True)[0]
    assert isinstance(res, TemplateError) and "differently once later turns follow" in str(res)


class _FlakyTable:
    """A journal table whose next append fails (a full disk, a dropped network volume)."""

    def __init__(self, table: JournalTable, failures: int):
        self.table, self.failures = table, failures

    def append(self, rows):
        if self.failures:
            self.failures -= 1
            raise OSError("No space left on device")
        return self.table.append(rows)

    def __getattr__(self, name):
        return getattr(self.table, name)


def completion(i: int) -> Completion:
    return Completion(
        content=f"answer {i}",
        finish_reason="stop",
        prompt_tokens=3,
        completion_tokens=5,
        model="m",
        request_id=12345,
    )  # an int where a string belongs must not fail the flush either


def test_a_failed_journal_write_keeps_the_rows(tmp_path):
    journal = ResponseJournal(DatasetLayout(tmp_path, "B1"))
    journal.responses = _FlakyTable(journal.responses, failures=1)
    writer = JournalWriter(journal, "openrouter", "run")
    for i in range(3):
        writer.add_completion(f"p{i}", completion(i))
    with pytest.raises(OSError):
        asyncio.run(writer.flush())
    writer.add_completion("p3", completion(3))
    assert writer.pending == 4
    asyncio.run(writer.flush())
    assert sorted(journal.done_ids()) == ["p0", "p1", "p2", "p3"]


class _InstantBackend:
    name, model, wants_prompt_ids = "openrouter", "m", False
    served = None

    def __init__(self):
        self.calls = 0

    async def start(self): ...

    async def preflight(self):
        return []

    async def complete(self, request):
        self.calls += 1
        await asyncio.sleep(0.01)
        return completion(self.calls)

    async def close(self): ...


def test_the_engine_stops_buying_answers_it_cannot_store(tmp_path):
    journal = ResponseJournal(DatasetLayout(tmp_path, "B1"))
    journal.responses = _FlakyTable(journal.responses, failures=10**6)
    backend = _InstantBackend()
    engine = GenerationEngine(
        backend,
        EngineSettings(max_concurrency=4, flush_interval_s=0.05, fatal_grace_s=0.2),
        log=lambda m: None,
    )
    requests = (CompletionRequest(f"p{i}", [{"role": "user", "content": "q"}], 10) for i in range(10_000))
    lane = Lane("B1", requests, 10_000, Budget(10, 10**9), JournalWriter(journal, "openrouter", "run"))
    with pytest.raises((RuntimeError, OSError)):
        asyncio.run(engine.run([lane]))
    assert backend.calls < 1000


def test_many_permanent_errors_before_any_success_stop_the_run_and_stay_retryable(
    tmp_path, chat, monkeypatch
):
    monkeypatch.setenv(KEY_ENV, KEY)
    layout = dataset(tmp_path, [f"q{i} [[400]]" for i in range(60)])
    with FakeOpenRouter(key=KEY) as server, pytest.raises(FatalRunError, match="configuration problem"):
        run(layout, server, chat, concurrency=4)
    assert len(server.hits) < 60
    failures = JournalTable(layout.failures_dir, FAILURE_SCHEMA).read(keep="last")
    assert failures.height and not failures["permanent"].any()  # a fixed configuration sends them again


def test_shard_writer_writes_nothing_after_a_failure():
    writer = ShardWriter()
    ran = []

    def boom():
        raise RuntimeError("CUDA error: an illegal memory access")

    writer.submit(boom)
    writer.submit(lambda: ran.append("save"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        writer.close()
    assert ran == []


def test_budget_without_cost_reports_does_not_serialise_the_run():
    b = Budget(max_tokens_per_request=10, token_limit=10**9, usd_limit=5.0)
    b.settle(b.open(), 7, None, 0.1)  # SGLang, local, vLLM: no cost
    b.open()
    assert b.can_dispatch()


def test_a_dataset_stopped_by_its_budget_is_not_topped_up_again(tmp_path, chat):
    texts = [f"t{i}" for i in range(10)]
    layout = dataset(tmp_path, texts)
    ids = pl.read_parquet(layout.prompts)["id"].to_list()
    src = tmp_path / "a.jsonl"  # 3 answers of 30 tokens: 90 of 100 used, no room for another request of 64
    src.write_text(
        "\n".join(json.dumps({"id": i, "response": "x", "usage": {"completion_tokens": 30}}) for i in ids[:3])
    )
    import_responses(layout, src, chat, IMPORTED_AS_TARGET, model=SMOLLM2)
    section = DatasetConfig(source="(in code)", format="messages", budget_tokens=100, max_tokens=64)
    assert not top_up_status(layout, section).needed
    assert top_up_status(layout, section.model_copy(update={"budget_tokens": 100_000})).needed


def test_importing_by_messages_matches_a_dataset_with_a_system_prompt(tmp_path, chat):
    from eagle3_assets.core.prompts.ingest import write_prompts
    from eagle3_assets.core.storage.layout import DatasetLayout

    from .support.projects import user_rows, write_jsonl

    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    source = write_jsonl(tmp_path / "s.jsonl", user_rows(["Hello?"]))
    write_prompts(
        source, layout, DatasetConfig(source=str(source), format="messages", system_prompt="Be brief.")
    )
    src = tmp_path / "a.jsonl"
    src.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]}
        )
    )
    assert (
        import_responses(
            layout, src, chat, IMPORTED_AS_TARGET, model=SMOLLM2, system_prompt="Be brief."
        ).imported
        == 1
    )


def test_an_answer_cut_off_while_thinking_is_all_reasoning():
    assert split_reasoning("<think>still going", False, "<think>", "</think>") == ("", "still going")
