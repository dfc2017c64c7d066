"""SGLang's native API, OpenAI-compatible servers, and importing responses produced elsewhere."""

from __future__ import annotations

import json
import shutil

import polars as pl

from eagle3_assets.config import BUILTIN_SMOLLM2, OpenRouterConfig, SGLangConfig
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.importer import import_responses
from eagle3_assets.core.generation.protocol import Sampling
from eagle3_assets.core.generation.run import generate_responses
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable
from eagle3_assets.core.tokens.build import build_tokens
from resources.inference.openrouter import OpenRouterBackend, parse_chat_completion
from resources.inference.sglang import SGLangBackend, split_reasoning

from .support.engine_runs import IMPORTED_AS_TARGET, KEY_ENV, SMOLLM2, dataset, make_plan
from .support.fake_servers import FakeOpenRouter, FakeSGLang

SETTINGS = dict(backoff_base_s=0.01, backoff_max_s=0.05, flush_interval_s=0.2, progress_interval_s=1)


def test_sglang_native_generate_with_exact_prompt_ids(tmp_path, chat, smol_tok):
    texts = ["What is 6 times 7?", "List two colours.", "Why is the sky blue?"]
    layout = dataset(tmp_path, texts)
    with FakeSGLang(smol_tok, chat.eot_id, fail_first=2) as server:
        backend = SGLangBackend(
            SGLangConfig(base_url=server.base_url, max_concurrency=4), chat, BUILTIN_SMOLLM2
        )
        plan = make_plan("B1", 64, 10_000, sampling=Sampling(temperature=0.7, top_p=0.9, top_k=20))
        summary = generate_responses(
            layout,
            plan,
            backend,
            chat,
            EngineSettings(max_concurrency=4, **SETTINGS),
            log=lambda m: None,
        )
    assert server.calls[:2] == ["health", "model_info"]  # checked before the first request
    assert summary.report.errors["overloaded"] == 2
    prompts = pl.read_parquet(layout.prompts)
    expected_ids = dict(zip(prompts["id"], chat.prompt_ids(prompts["messages"].to_list()), strict=True))
    sent = [b["input_ids"] for b in server.generate_bodies]
    assert all(ids in sent for ids in expected_ids.values())
    params = server.generate_bodies[-1]["sampling_params"]
    assert params["max_new_tokens"] == 64 and params["temperature"] == 0.7 and params["top_k"] == 20
    responses = JournalTable(layout.responses_dir, RESPONSE_SCHEMA).read()
    assert responses.height == 3 and set(responses["backend"]) == {"sglang"}
    assert set(responses["model"]) == {"HuggingFaceTB/SmolLM2-135M-Instruct"}  # as /model_info names it
    for row in responses.iter_rows(named=True):
        assert row["output_ids"][-1] == chat.eot_id and row["finish_reason"] == "stop"
        assert row["content"].startswith("Echo of ")
    s = build_tokens(layout, chat, log=lambda m: None)
    assert s.n_reference == 3 and s.n_match == 3  # the server's ids are the rebuilt ids


def test_sglang_truncation_and_reasoning_split():
    assert split_reasoning("plan</think>answer", True, "<think>", "</think>") == ("answer", "plan")
    assert split_reasoning("still thinking", True, "<think>", "</think>") == ("", "still thinking")
    assert split_reasoning("<think>a</think>b", False, "<think>", "</think>") == ("b", "a")
    assert split_reasoning("plain", False, "<think>", "</think>") == ("plain", None)


def test_openai_compatible_bodies_parse():
    vllm = {
        "id": "cmpl-1",
        "model": "m",
        "choices": [
            {
                "finish_reason": "length",
                "message": {"content": "hi", "reasoning_content": "think"},
                "token_ids": [5, 6],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    c = parse_chat_completion(vllm, "fallback")
    assert (c.content, c.reasoning, c.finish_reason, c.output_ids, c.cost_usd, c.provider) == (
        "hi",
        "think",
        "length",
        [5, 6],
        None,
        None,
    )


def test_import_counts_toward_budget_and_serves_as_reference(tmp_path, chat, smol_tok, monkeypatch):
    texts = ["alpha question", "beta question", "gamma question", "delta question"]
    layout = dataset(tmp_path, texts)
    prompts = pl.read_parquet(layout.prompts)
    ids = prompts["id"].to_list()
    answer = "Imported answer."
    answer_ids = [*smol_tok(answer, add_special_tokens=False)["input_ids"], chat.eot_id]
    rows = [
        {"id": ids[0], "response": answer, "output_ids": answer_ids, "usage": {"completion_tokens": 400}},
        {
            "messages": [
                {"role": "user", "content": "beta question"},
                {"role": "assistant", "content": "From messages.", "reasoning": "r"},
            ]
        },
        {"prompt": "gamma question", "content": "By prompt text.", "model": "smollm2-135m-instruct"},
        {"prompt": "no such prompt", "content": "x"},
        {"id": ids[0], "response": "twice"},
        {"prompt": "delta question", "content": "Another model's answer.", "model": "evil/other-model-7b"},
        "not json",
    ]
    src = tmp_path / "import.jsonl"
    src.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    # The operator says the rows that name no model are the target's; a row naming another model is refused.
    s = import_responses(layout, src, chat, IMPORTED_AS_TARGET, model=SMOLLM2)
    assert s.imported == 3 and sum(s.rejected.values()) == 4
    rejected = pl.read_parquet(s.rejected_path)["reason"].to_list()
    assert any("no prompt has this text" in r for r in rejected)
    assert any("already has a response" in r for r in rejected)
    assert any("'evil/other-model-7b', not the target" in r for r in rejected)
    responses = JournalTable(layout.responses_dir, RESPONSE_SCHEMA).read()
    by_id = {r["id"]: r for r in responses.iter_rows(named=True)}
    assert by_id[ids[0]]["completion_tokens"] == 400 and by_id[ids[0]]["source"] == "imported:import.jsonl"
    assert by_id[ids[1]]["reasoning"] == "r" and by_id[ids[1]]["model"] == SMOLLM2
    assert by_id[ids[2]]["model"] == "smollm2-135m-instruct" and by_id[ids[2]]["completion_tokens"] > 0
    assert all(r["prompt_fingerprint"] for r in by_id.values())  # each bound to the prompt it matched
    # Without a model for rows that name none, those rows are refused (the operator must say whose they are).
    layout2 = DatasetLayout(tmp_path / "other", "B1").ensure()
    shutil.copy(layout.prompts, layout2.prompts)
    s = import_responses(layout2, src, chat, IMPORTED_AS_TARGET)
    assert any("names no model" in r for r in pl.read_parquet(s.rejected_path)["reason"].to_list())
    tokens = build_tokens(layout, chat, log=lambda m: None)
    assert tokens.n_reference == 1 and tokens.n_match == 1

    # The imported 400+ tokens already exceed a 300-token budget: nothing more is sent.
    monkeypatch.setenv(KEY_ENV, "k")
    with FakeOpenRouter(key="k") as server:
        backend = OpenRouterBackend(OpenRouterConfig(base_url=server.base_url, api_key_env=KEY_ENV), chat)
        plan = make_plan("B1", 50, 300)
        out = generate_responses(
            layout,
            plan,
            backend,
            chat,
            EngineSettings(max_concurrency=2, **SETTINGS),
            log=lambda m: None,
        )
        assert out.stop_reason == "budget" and server.hits == []
