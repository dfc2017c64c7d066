"""A tools dataset answered end to end by a real engine: vLLM's CPU build serving SmolLM2-135M with its Hermes
tool-call parser (`--enable-auto-tool-choice --tool-call-parser hermes`, the Qwen2.5/Hermes-style template of
`tool_templates` passed with `--chat-template`: SmolLM2's own has no tools section), through the `openrouter`
backend (OpenAI-compatible, streamed), then tokenized and compared with the ids vLLM returned.

What the small model does, honestly: offered the tool alone it answers in prose or code, never a call. In a
conversation that shows it calls (user asks, assistant calls, four times over) it copies the form and calls
`get_weather` with the right city; that is what the `turns: last` rows use. A `turns: all` trace starts
without such examples, so the target answers its first turn in text where the source called: the trace stops
there.
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.config import DatasetConfig, OpenRouterConfig, SamplingConfig
from eagle3_assets.core.generation.run import GenerationPlan, generate_responses
from eagle3_assets.core.generation.tool_splice import TOOL_DIVERGED
from eagle3_assets.core.prompts.ingest import write_prompts
from eagle3_assets.core.report.summary import build_report
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.target_model.chat import ChatTokenizer
from eagle3_assets.core.target_model.loading import builtin_dir
from eagle3_assets.core.target_model.tool_calls import parse_calls, wire_message
from eagle3_assets.core.tokens.build import build_tokens
from resources.inference.openrouter import OpenRouterBackend
from resources.side_env import clean_env
from resources.vllm.cpu_build import vllm_cpu_python
from resources.vllm.server import ServeSpec, free_port, launch

from .support.engine_runs import fast_settings, stored
from .support.projects import write_jsonl
from .support.tool_templates import QWEN_TOOLS_TEMPLATE
from .support.vllm_server import require_runnable

pytestmark = pytest.mark.slow

SERVED = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}
SHOWN = ["Paris", "London", "Rome", "Vienna"]  # the calls a conversation shows before its question


def _call(i: int, city: str) -> dict:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


def _shown_calls() -> list[dict]:
    msgs: list[dict] = []
    for i, city in enumerate(SHOWN):
        msgs += [
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [_call(i, city)]},
        ]
    return msgs


@pytest.fixture(scope="module")
def tool_server():
    """vLLM serving SmolLM2 with the Hermes tool-call parser (its own server: the session's extraction servers
    parse no tools)."""
    require_runnable()
    root = Path(tempfile.mkdtemp(prefix="eagle3-vllm-tools-"))
    template = root / "tools.jinja"
    template.write_text(QWEN_TOOLS_TEMPLATE)
    spec = ServeSpec(
        model=str(builtin_dir("smollm2")),
        aux_layers=[1, 14, 26],
        num_layers=30,
        storage_path=str(root / "unused"),
        mode="plain",
        served_model_name=SERVED,
        port=free_port(),
        dtype="float32",
        max_model_len=2048,
        cpu=True,
        extra_args=[
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--chat-template",
            str(template),
        ],
    )
    server = launch(spec, str(vllm_cpu_python(nice=True)), root / "server.log", clean_env(), 900)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def target() -> ChatTokenizer:
    """The target as the tokens stage reads it: SmolLM2's tokenizer with the template the server renders."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(builtin_dir("smollm2")))
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    return ChatTokenizer(tok)


def _generate(layout, ds, server, chat) -> None:
    cfg = OpenRouterConfig(
        base_url=server.base_url,
        api_key_env="EAGLE3_TEST_NO_KEY",
        model=SERVED,
        reasoning=None,
        stream=True,  # the calls arrive as deltas, assembled here
        extra_body={"return_token_ids": True},  # the ids the model produced, for the reference comparison
        max_retries=1,
    )
    plan = GenerationPlan(layout.key, ds, SamplingConfig(temperature=0.0))
    settings = fast_settings(4, 1, backoff_max_s=0.2, flush_interval_s=0.5, progress_interval_s=5)
    generate_responses(layout, plan, OpenRouterBackend(cfg, chat), chat, settings, log=lambda m: None)


def test_vllm_answers_a_tools_dataset_with_calls_stored_and_exact_ids(tmp_path, tool_server, target):
    cities = ["Oslo", "Madrid", "Lisbon"]
    rows = [
        {
            "id": c,
            "tools": [WEATHER],
            "messages": [*_shown_calls(), {"role": "user", "content": f"Weather in {c}?"}],
        }
        for c in cities
    ]
    rows.append({"id": "plain", "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    src = write_jsonl(tmp_path / "B1.jsonl", rows)
    ds = DatasetConfig(source=str(src), format="messages", max_tokens=64)
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    write_prompts(src, layout, ds)
    _generate(layout, ds, tool_server, target)
    responses, failures = stored(layout)
    assert failures.height == 0, failures.to_dicts()
    by_id = {r["id"]: r for r in responses.to_dicts()}
    assert set(by_id) == {*cities, "plain"}
    assert by_id["plain"]["tool_calls"] is None and by_id["plain"]["content"]
    for city in cities:
        row = by_id[city]
        calls = parse_calls(row["tool_calls"])
        # The parser's call, assembled from the streamed deltas: the tool and the city the question named.
        assert row["finish_reason"] == "tool_calls", row
        assert [c.name for c in calls] == ["get_weather"]
        assert json.loads(calls[0].arguments) == {"city": city}
        assert row["output_ids"] is not None
    build_tokens(layout, target, log=lambda m: None, workers=1)
    tokens = pl.read_parquet(layout.tokens)
    assert not pl.read_parquet(layout.tokens_errors).height
    for row in tokens.filter(pl.col("id").is_in(cities)).iter_rows(named=True):
        # The rebuilt call equals the ids vLLM produced, end-of-turn included; the loss is on exactly them.
        assert row["reference_match"] is True, row["mismatch"]
        trained = [i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        text = target.encoder.decode(trained)
        assert text.startswith('<tool_call>\n{"name": "get_weather"') and text.endswith(
            "</tool_call><|im_end|>"
        )
    # The prompt too: the ids vLLM rendered from the request equal the ones rebuilt from the stored prompt.
    prompt = pl.read_parquet(layout.prompts).filter(pl.col("id") == "Oslo").row(0, named=True)
    tools = json.loads(prompt["tools"])
    body = {
        "model": SERVED,
        "messages": [wire_message(m) for m in prompt["messages"]],
        "tools": tools,
        "max_tokens": 1,
        "return_token_ids": True,
    }
    with urllib.request.urlopen(
        urllib.request.Request(
            f"{tool_server.base_url}/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        ),
        timeout=120,
    ) as resp:
        served = json.load(resp)["prompt_token_ids"]
    assert served == target.prompt_ids([prompt["messages"]], [tools])[0]
    report = build_report(layout, ds)
    assert report.tool_calls is not None and report.tool_calls.answers_with_calls == 3
    assert report.tool_calls.calls_to_tools_not_offered == 0 and report.tool_calls.arguments_not_json == 0


def test_vllm_on_an_agent_trace_turn_by_turn(tmp_path, tool_server, target):
    """`turns: all`: the target's first turn decides. It replies in text where the source called (what SmolLM2
    does without examples): the trace stops there, recorded; had it called get_weather, the source's result
    would follow its call."""
    trace = {
        "id": "trace",
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [_call(0, "Oslo")]},
            {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 3}'},
            {"role": "assistant", "content": "It is 3 degrees in Oslo."},
            {"role": "user", "content": "Thanks!"},
        ],
    }
    src = write_jsonl(tmp_path / "B2.jsonl", [trace])
    ds = DatasetConfig(source=str(src), format="messages", turns="all", max_tokens=48)
    layout = DatasetLayout(tmp_path / "data", "B2").ensure()
    write_prompts(src, layout, ds)
    _generate(layout, ds, tool_server, target)
    responses, failures = stored(layout)
    first = responses.filter(pl.col("id") == "trace#t1").row(0, named=True)
    calls = [c.name for c in parse_calls(first["tool_calls"])]
    if calls == ["get_weather"]:
        assert "trace#t2" in set(responses["id"].to_list())  # the result followed the target's own call
    else:
        stop = failures.filter(pl.col("error_kind") == TOOL_DIVERGED).row(0, named=True)
        assert stop["id"] == "trace#t2" and stop["permanent"]
        assert responses.height == 1
        assert build_report(layout, ds).tool_calls.conversations_stopped_at_divergence == 1
