"""Agentic rows: tools and tool calls from the source to exact, masked ids, through a real HTTP provider.

The provider is the OpenRouter-shaped server on loopback (`fake_servers`), answering with calls as OpenAI
does, streamed as deltas or whole; the targets are the tool-rendering families of `tool_templates`, templates
written here in each family's documented shape (Kimi's is the stand-in, `kimi_standin`): they prove the
rebuild of a template of that shape, not any vendor's own template file.
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from eagle3_assets.config import DatasetConfig
from eagle3_assets.core.prompts.fingerprints import prompt_fingerprint
from eagle3_assets.core.prompts.ingest import PROMPT_SCHEMA, ingest, write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.target_model.chat import Answer, ChatTokenizer
from eagle3_assets.core.target_model.tool_calls import (
    ToolCall,
    calls_json,
    parse_calls,
    template_message,
    unparsed_call,
)
from eagle3_assets.core.tokens.build import build_tokens

from .support.engine_runs import KEY, KEY_ENV, run, stored
from .support.fake_servers import FakeOpenRouter
from .support.projects import write_jsonl
from .support.tool_templates import kimi_tools, llama31_tools, qwen_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]


def _call(call_id: str, city: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


def trace_row(rid: str = "t1") -> dict:
    """An agent trace as OpenAI-style datasets hold it: a call, its result, a reply, a new question."""
    return {
        "id": rid,
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("c1", "Paris")]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 degrees."},
            {"role": "user", "content": "And in Oslo?"},
        ],
    }


# -- 1. ingest -----------------------------------------------------------------------------------------------
def test_ingest_keeps_tools_calls_and_results(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [trace_row()])
    r = ingest(src, "messages")
    assert r.quarantine.height == 0
    row = r.prompts.row(0, named=True)
    assert json.loads(row["tools"]) == TOOLS
    call, result = row["messages"][2], row["messages"][3]
    assert parse_calls(call["tool_calls"]) == [ToolCall("get_weather", '{"city": "Paris"}', "c1")]
    assert (result["tool_call_id"], result["name"], result["content"]) == (
        "c1",
        "get_weather",
        '{"temp": 21}',
    )
    # the tools are part of what the request sends: another tool set is another prompt
    other = write_jsonl(tmp_path / "b.jsonl", [{**trace_row(), "tools": [WEATHER, {"name": "x"}]}])
    assert ingest(other, "messages").prompts["fingerprint"][0] != row["fingerprint"]


def test_sharegpt_function_calls_map_to_the_same_messages(tmp_path):
    row = {
        "id": "g1",
        "tools": json.dumps([WEATHER["function"]]),  # ShareGPT dumps: bare definitions, as a JSON string
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {
                "from": "function_call",
                "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}),
            },
            {"from": "observation", "value": '{"temp": 3}'},
            {"from": "gpt", "value": "3 degrees."},
        ],
    }
    r = ingest(write_jsonl(tmp_path / "g.jsonl", [row]), "sharegpt")
    assert r.quarantine.height == 0
    p = r.prompts.row(0, named=True)
    assert json.loads(p["tools"]) == TOOLS
    msgs = p["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]  # the final reply is the target's
    assert parse_calls(msgs[1]["tool_calls"]) == [ToolCall("get_weather", '{"city": "Oslo"}', "call_0")]
    assert (msgs[2]["tool_call_id"], msgs[2]["name"]) == ("call_0", "get_weather")
    assert p["source_answer"] == "3 degrees."


def test_bad_calls_are_quarantined_with_their_reason(tmp_path):
    def with_call(rid, call, tools=TOOLS):
        row = trace_row(rid)
        row["messages"][2]["tool_calls"] = [call]
        row["tools"] = tools
        return row

    rows = [
        with_call("malformed", {"id": "c1", "function": {"arguments": "{}"}}),
        with_call("unknown", {"id": "c1", "function": {"name": "get_stock", "arguments": "{}"}}),
        with_call("notjson", {"id": "c1", "function": {"name": "get_weather", "arguments": "{city: Paris"}}),
        with_call("nottools", _call("c1", "Paris"), tools=None),
        {
            **trace_row("badid"),
            "messages": [
                *trace_row()["messages"][:3],
                {"role": "tool", "tool_call_id": "zz", "content": "x"},
            ],
        },
        trace_row("good"),
    ]
    r = ingest(write_jsonl(tmp_path / "q.jsonl", rows), "messages")
    reasons = dict(zip(r.quarantine["id"].to_list(), r.quarantine["reason"].to_list(), strict=True))
    assert r.prompts["id"].to_list() == ["good"]
    assert "malformed tool call" in reasons["malformed"]
    assert "unknown tool 'get_stock'" in reasons["unknown"]
    assert "not valid JSON" in reasons["notjson"]
    assert "unknown tool 'get_weather'" in reasons["nottools"]
    assert "unknown call id 'zz'" in reasons["badid"]


def test_dataset_tools_from_the_config_and_plain_datasets_unchanged(tmp_path):
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    row = trace_row()
    del row["tools"]
    src = write_jsonl(tmp_path / "d.jsonl", [row])
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages", tools=[WEATHER["function"]]))
    assert json.loads(pl.read_parquet(layout.prompts)["tools"][0]) == TOOLS
    # Read back as a prompts table, never as a damaged one (its messages hold more fields than plain ones).
    again = write_prompts(src, layout, DatasetConfig(source=str(src), format="messages", tools=[WEATHER]))
    assert again.set_aside == []
    # A dataset without tools is stored exactly as before: the same columns and fingerprints.
    plain = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    r = ingest(plain, "messages")
    assert dict(r.prompts.schema) == PROMPT_SCHEMA
    assert r.prompts["fingerprint"][0] == prompt_fingerprint([{"role": "user", "content": "hi"}])


# -- 4. tokens: each family's template, exactly ------------------------------------------------------------
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": calls_json([ToolCall("get_weather", '{"city": "Paris"}', "functions.get_weather:0")]),
    },
    {
        "role": "tool",
        "content": '{"temp": 21}',
        "tool_call_id": "functions.get_weather:0",
        "name": "get_weather",
    },
    {"role": "assistant", "content": "It is 21 degrees."},
    {"role": "user", "content": "And Oslo?"},
]
CALL = Answer("", None, True, (ToolCall("get_weather", '{"city": "Oslo"}', "functions.get_weather:1"),))
REPLY = Answer("Sunny, 3 degrees.")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return {
        "qwen_tools": qwen_tools(),
        "llama31_tools": llama31_tools(),
        "kimi_tools": kimi_tools(tmp_path_factory.mktemp("kimi")),
    }


def _reference(tok, messages, tools, gen):
    out = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=gen)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.parametrize("family", ["qwen_tools", "llama31_tools", "kimi_tools"])
@pytest.mark.parametrize("answer", [CALL, REPLY], ids=["call", "reply"])
def test_rebuilt_ids_equal_apply_chat_template_with_tools(families, family, answer):
    tok = families[family]
    chat = ChatTokenizer(tok)
    res = chat.tokenize([(HISTORY, answer)], tools=[TOOLS])[0]
    assert not isinstance(res, Exception), res
    ids = res.input_ids.tolist()
    rendered = [template_message(m) for m in HISTORY] + [chat.tool_renderer.answer_message(answer)]
    reference = _reference(tok, rendered, TOOLS, False)
    # The whole conversation is apply_chat_template's (a template may write text after the last end-of-turn,
    # e.g. ChatML's newline, which no model writes).
    assert ids == reference[: len(ids)]
    assert chat.encoder.decode(reference[len(ids) :]).strip() == ""
    assert ids[: res.answer_start] == _reference(tok, [template_message(m) for m in HISTORY], TOOLS, True)
    trained = chat.encoder.decode([i for i, m in zip(ids, res.loss_mask.tolist(), strict=True) if m])
    untrained = chat.encoder.decode([i for i, m in zip(ids, res.loss_mask.tolist(), strict=True) if not m])
    # The loss covers the target's turn, its calls included, up to its end-of-turn token; never a tool
    # definition or a tool result.
    assert trained.endswith(chat.eot_token)
    if answer is CALL:
        assert '"Oslo"' in trained and "get_weather" in trained
    else:
        assert "Sunny, 3 degrees." in trained
    assert "The weather of a city" in untrained and "The weather of a city" not in trained
    assert '{"temp": 21}' in untrained and "21" not in trained
    assert res.loss_mask[: res.answer_start].sum() == 0


def test_train_all_masks_every_target_turn_and_no_tool_result(families):
    chat = ChatTokenizer(families["qwen_tools"])
    res = chat.tokenize([(HISTORY, CALL)], train_all=True, tools=[TOOLS])[0]
    assert not isinstance(res, Exception), res
    ids, mask = res.input_ids.tolist(), res.loss_mask.tolist()
    trained = chat.encoder.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert '"Paris"' in trained and "It is 21 degrees." in trained and '"Oslo"' in trained
    assert "temp" not in trained and "Weather in Paris?" not in trained


# -- 2. requests and answers through a real HTTP provider --------------------------------------------------
def _agent(prompt: str, body: dict):
    """The provider's answers: a call when asked about weather, nothing at all for 'blank' prompts (an empty
    answer), a reply after a tool result."""
    if "blank" in prompt:
        return {"content": None}, "stop"
    if prompt.startswith("{") or not body.get("tools"):  # after a tool result, or offered none: a reply
        return {"content": "Done: " + prompt}, "stop"
    city = prompt.split()[-1].rstrip("?")
    return {"content": None, "tool_calls": [_call(f"call_{city}", city)]}, "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calls_answered_stored_and_tokenized(tmp_path, monkeypatch, stream):
    monkeypatch.setenv(KEY_ENV, KEY)
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    rows = [
        {
            "id": "w1",
            "tools": TOOLS,
            "tool_choice": "auto",
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        },
        {"id": "b1", "tools": TOOLS, "messages": [{"role": "user", "content": "blank please"}]},
        {"id": "p1", "messages": [{"role": "user", "content": "plain question"}]},
        trace_row("t1"),
    ]
    src = write_jsonl(tmp_path / "B1.jsonl", rows)
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    chat = ChatTokenizer(qwen_tools())
    with FakeOpenRouter(key=KEY, answer_message=_agent) as server:
        run(layout, server, chat, retries=1, stream=stream, reasoning=None)
        bodies = {h.body["messages"][-1]["content"]: h.body for h in server.hits}
    sent = bodies["Weather in Oslo?"]
    assert sent["tools"] == TOOLS and sent["tool_choice"] == "auto"
    assert "tools" not in bodies["plain question"]  # a row without tools is sent as it always was
    history = bodies["And in Oslo?"]["messages"]
    assert history[2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert history[3] == {
        "role": "tool",
        "content": '{"temp": 21}',
        "tool_call_id": "c1",
        "name": "get_weather",
    }
    responses, failures = stored(layout)
    by_id = {r["id"]: r for r in responses.to_dicts()}
    # A call is an answer: stored with its arguments exactly as they came (streamed in pieces or whole).
    assert parse_calls(by_id["w1"]["tool_calls"]) == [
        ToolCall("get_weather", '{"city": "Oslo"}', "call_Oslo")
    ]
    assert by_id["w1"]["finish_reason"] == "tool_calls" and by_id["w1"]["content"] == ""
    assert by_id["p1"]["tool_calls"] is None
    # An answer with neither text nor calls is never an answered prompt: a retryable failure.
    assert "b1" not in by_id
    fail = failures.filter(pl.col("id") == "b1").row(0, named=True)
    assert fail["error_kind"] == "server" and not fail["permanent"] and fail["attempts"] == 2
    assert "neither text nor tool calls" in fail["message"]
    build_tokens(layout, chat, log=lambda m: None, workers=1)
    tokens = pl.read_parquet(layout.tokens)
    row = tokens.filter(pl.col("id") == "w1").row(0, named=True)
    trained = chat.encoder.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
    assert (
        trained
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    )
    assert not row["answer_empty"]
    assert set(tokens["id"].to_list()) == {"w1", "p1", "t1"}


def test_a_call_left_inside_the_reasoning_is_asked_again_never_stored(tmp_path, monkeypatch):
    """Kimi's reasoning can run straight into its calls without `</think>`: the server's reasoning parser then
    returns the whole turn, call marks included, as reasoning and no `tool_calls`. Stored, it would train a
    `</think>` the model never wrote and no call. It is a retried fault; the next answer's call is stored."""
    monkeypatch.setenv(KEY_ENV, KEY)
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    rows = [{"id": "k1", "tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Oslo?"}]}]
    src = write_jsonl(tmp_path / "B1.jsonl", rows)
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    tries: list[str] = []
    run_on = (
        "I should look it up.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
    )

    def kimi_like(prompt: str, body: dict):
        tries.append(prompt)
        if len(tries) == 1:
            return {"content": None, "reasoning": run_on}, "stop"
        return {"content": None, "tool_calls": [_call("functions.get_weather:0", "Oslo")]}, "tool_calls"

    chat = ChatTokenizer(kimi_tools(tmp_path / "kimi"))
    with FakeOpenRouter(key=KEY, answer_message=kimi_like) as server:
        run(layout, server, chat, retries=0, reasoning=None)  # no retry: the failure row is kept
        responses, failures = stored(layout)
        assert responses.height == 0
        fail = failures.row(0, named=True)
        assert fail["error_kind"] == "malformed" and not fail["permanent"]
        assert "left unparsed in the answer's reasoning" in fail["message"]
        run(layout, server, chat, retries=0, reasoning=None)  # the next run asks again
    responses, _ = stored(layout)
    assert len(tries) == 2
    row = responses.row(0, named=True)
    assert parse_calls(row["tool_calls"]) == [
        ToolCall("get_weather", '{"city": "Oslo"}', "functions.get_weather:0")
    ]
    assert not row["reasoning"]
    # Without tools offered the same marks are text like any other (a question about Kimi's format).
    assert unparsed_call(None, "the format is <tool_call>") is not None
    from eagle3_assets.core.generation.protocol import Completion, CompletionRequest

    plain = CompletionRequest("p", [{"role": "user", "content": "?"}], 10)
    talk = Completion("the format is <|tool_call_begin|>", "stop", 5, 5, "m")
    assert talk.defect(plain) is None


# -- 3. agent traces turn by turn, and 5. the report and the blocking check -------------------------------
STOCK = {"type": "function", "function": {"name": "get_stock", "parameters": {"type": "object"}}}


def _trace(rid: str, question: str, first: dict) -> dict:
    """user -> the source's first assistant turn (`first`) -> its tool result -> a reply -> a new question."""
    calls = first.get("tool_calls")
    msgs = [{"role": "user", "content": question}, first]
    if calls:
        msgs.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp": 21}'})
    msgs += [{"role": "assistant", "content": "It is 21 degrees."}, {"role": "user", "content": "And Oslo?"}]
    return {"id": rid, "tools": [WEATHER, STOCK], "messages": msgs}


def _trace_agent(prompt: str, body: dict):
    """Calls get_weather for a city, get_stock when asked about stock, replies after a tool result."""
    if prompt.startswith("{"):
        return {"content": "Done."}, "stop"
    if "stock" in prompt:
        return {
            "content": None,
            "tool_calls": [_call("call_s", "x") | {"function": {"name": "get_stock", "arguments": "{}"}}],
        }, "tool_calls"
    city = prompt.split()[-1].rstrip("?")
    return {"content": "Let me look.", "tool_calls": [_call(f"call_{city}", city)]}, "tool_calls"


def test_turns_all_splices_results_after_the_same_call_and_stops_where_the_target_diverges(
    tmp_path, monkeypatch
):
    from eagle3_assets.config import OpenRouterConfig, SamplingConfig
    from eagle3_assets.core.generation.run import GenerationPlan, generate_responses
    from eagle3_assets.core.generation.tool_splice import TOOL_DIVERGED
    from eagle3_assets.core.report.summary import build_report
    from resources.inference.openrouter import OpenRouterBackend

    from .support.engine_runs import fast_settings

    monkeypatch.setenv(KEY_ENV, KEY)
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    rows = [
        _trace(
            "same",
            "Weather in Paris?",
            {"role": "assistant", "content": "", "tool_calls": [_call("c1", "Paris")]},
        ),
        _trace(
            "other",
            "stock price?",
            {"role": "assistant", "content": "", "tool_calls": [_call("c1", "Paris")]},
        ),
        _trace("nocall", "Tell me about Rome", {"role": "assistant", "content": "Rome is old."}),
    ]
    src = write_jsonl(tmp_path / "B1.jsonl", rows)
    ds = DatasetConfig(source=str(src), format="messages", turns="all", max_tokens=100)
    write_prompts(src, layout, ds)
    chat = ChatTokenizer(qwen_tools())
    with FakeOpenRouter(key=KEY, answer_message=_trace_agent) as server:
        cfg = OpenRouterConfig(base_url=server.base_url, api_key_env=KEY_ENV, reasoning=None, max_retries=1)
        settings = fast_settings(8, 1, backoff_max_s=0.1, flush_interval_s=0.2, progress_interval_s=0.5)
        plan = GenerationPlan("B1", ds, SamplingConfig())
        generate_responses(layout, plan, OpenRouterBackend(cfg, chat), chat, settings, log=lambda m: None)
        bodies = [h.body for h in server.hits]
    responses, failures = stored(layout)
    answered = set(responses["id"].to_list())
    # The target called what the source called: its result follows, addressed to the target's own call.
    assert {"same#t1", "same#t2", "same#t3"} <= answered
    turn2 = next(b for b in bodies if b["messages"][-1]["role"] == "tool")
    assert turn2["messages"][-1] == {
        "role": "tool",
        "content": '{"temp": 21}',
        "tool_call_id": "call_Paris",
        "name": "get_weather",
    }
    assert turn2["messages"][1]["tool_calls"][0]["id"] == "call_Paris"
    # It called another tool, or a tool where the source replied: the conversation stops after that turn.
    assert "other#t1" in answered and "other#t2" not in answered
    assert "nocall#t1" in answered and "nocall#t2" not in answered
    stopped = failures.filter(pl.col("error_kind") == TOOL_DIVERGED)
    assert sorted(stopped["id"].to_list()) == ["nocall#t2", "other#t2"]
    assert (
        "get_stock where the source called get_weather"
        in stopped.filter(pl.col("id") == "other#t2")["message"][0]
    )
    assert stopped["permanent"].all()
    # A second run asks nothing again: complete and stopped conversations stay as they are.
    with FakeOpenRouter(key=KEY, answer_message=_trace_agent) as server:
        cfg = OpenRouterConfig(base_url=server.base_url, api_key_env=KEY_ENV, reasoning=None, max_retries=1)
        generate_responses(layout, plan, OpenRouterBackend(cfg, chat), chat, settings, log=lambda m: None)
        assert server.hits == []
    build_tokens(layout, chat, log=lambda m: None, workers=1)
    tokens = pl.read_parquet(layout.tokens)
    assert tokens.height == 5 and not pl.read_parquet(layout.tokens_errors).height
    report = build_report(layout, ds)
    t = report.tool_calls
    assert t is not None
    assert (t.answers_with_calls, t.calls, t.conversations_stopped_at_divergence) == (4, 4, 2)
    assert t.calls_to_tools_not_offered == 0 and t.arguments_not_json == 0
    # Stopped conversations are bad data for this target, not failed requests.
    from eagle3_assets.core.report.validation import counted_failures

    assert counted_failures(failures) == (0, 2)


def test_the_blocking_check_fails_on_an_answer_with_neither_text_nor_calls(tmp_path):
    from eagle3_assets.assets.tokens import answer_features
    from eagle3_assets.core.report.summary import build_report
    from eagle3_assets.core.report.validation import answers_have_text_or_calls
    from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable

    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    rows = [
        {"id": i, "tools": TOOLS, "messages": [{"role": "user", "content": f"q {i}"}]}
        for i in ("a", "b", "c")
    ]
    src = write_jsonl(tmp_path / "B1.jsonl", rows)
    ds = DatasetConfig(source=str(src), format="messages")
    write_prompts(src, layout, ds)

    def frame(*rows):
        return pl.DataFrame([dict.fromkeys(RESPONSE_SCHEMA) | r for r in rows], schema=RESPONSE_SCHEMA)

    def answer(rid, content, calls):
        return {
            "id": rid,
            "backend": "openrouter",
            "model": "m",
            "content": content,
            "finish_reason": "stop",
            "completion_tokens": 3,
            "tool_calls": calls,
        }

    good_call = calls_json([ToolCall("get_weather", '{"city": "Rome"}', "x1")])
    bad_calls = calls_json([ToolCall("get_weather", "{city", "x2"), ToolCall("rm_rf", "{}", "x3")])
    answers = [answer("a", "", good_call), answer("b", "fine", bad_calls)]
    table = JournalTable(layout.responses_dir, RESPONSE_SCHEMA)
    table.append(frame(*answers))
    chat = ChatTokenizer(qwen_tools())
    build_tokens(layout, chat, log=lambda m: None, workers=1)
    assert answers_have_text_or_calls(answer_features(layout)).passed
    # An empty answer stored by something else (an import, an earlier version): the check fails and names it.
    table.append(frame(answer("c", "", None)))
    build_tokens(layout, chat, log=lambda m: None, workers=1)
    verdict = answers_have_text_or_calls(answer_features(layout))
    assert not verdict.passed and verdict.metadata["examples"] == "c"
    t = build_report(layout, ds).tool_calls
    assert t is not None
    assert (t.answers_with_calls, t.calls, t.arguments_not_json, t.calls_to_tools_not_offered) == (2, 3, 1, 1)
    assert t.calls_per_answer_with_calls == 1.5


def test_backends_taking_ids_get_the_prompt_rendered_with_its_tools(tmp_path):
    """SGLang's native API (and the embedded model) take token ids: the prompt is the target's template
    rendered with the row's tools, exactly apply_chat_template's ids."""
    from eagle3_assets.config import BUILTIN_SMOLLM2, SamplingConfig, SGLangConfig
    from eagle3_assets.core.generation.engine_settings import EngineSettings
    from eagle3_assets.core.generation.run import GenerationPlan, generate_responses
    from resources.inference.sglang import SGLangBackend

    from .support.fake_servers import FakeSGLang

    tok = qwen_tools()
    chat = ChatTokenizer(tok)
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    rows = [trace_row("t1"), {"id": "p1", "messages": [{"role": "user", "content": "plain"}]}]
    src = write_jsonl(tmp_path / "B1.jsonl", rows)
    ds = DatasetConfig(source=str(src), format="messages", max_tokens=32)
    write_prompts(src, layout, ds)
    with FakeSGLang(tok, chat.eot_id) as server:
        backend = SGLangBackend(
            SGLangConfig(base_url=server.base_url, max_concurrency=2), chat, BUILTIN_SMOLLM2
        )
        settings = EngineSettings(max_concurrency=2, backoff_base_s=0.01, flush_interval_s=0.2)
        generate_responses(
            layout, GenerationPlan("B1", ds, SamplingConfig()), backend, chat, settings, lambda m: None
        )
        sent = [b["input_ids"] for b in server.generate_bodies]
    prompt = pl.read_parquet(layout.prompts).filter(pl.col("id") == "t1").row(0, named=True)
    rendered = [template_message(m) for m in prompt["messages"]]
    expected = _reference(tok, rendered, TOOLS, True)
    assert expected in sent
    assert "The weather of a city" in tok.decode(expected) and '"city": "Paris"' in tok.decode(expected)
    plain = _reference(tok, [{"role": "user", "content": "plain"}], None, True)
    assert plain in sent and "<tools>" not in tok.decode(plain)


def test_tool_definitions_count_toward_the_targets_context(tmp_path):
    """A prompt whose text fits but whose tool definitions do not is quarantined before it is sent: the
    prompt is counted as the template renders it, tools included."""
    from eagle3_assets.core.prompts.context import ChatCounter, ContextGuard

    chat = ChatTokenizer(qwen_tools())
    many = [
        {"name": f"tool_{i}", "description": "does a thing " * 20, "parameters": {"type": "object"}}
        for i in range(8)
    ]
    rows = [
        {"id": "short", "tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Rome?"}]},
        {"id": "long", "tools": many, "messages": [{"role": "user", "content": "Weather in Rome?"}]},
    ]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    fits = len(chat.prompt_ids([[{"role": "user", "content": "Weather in Rome?"}]], [TOOLS])[0])
    r = ingest(src, "messages", guard=ContextGuard(fits + 50, lambda: ChatCounter(chat)))
    assert r.prompts["id"].to_list() == ["short"]
    assert "exceeds the target's context" in r.quarantine["reason"][0]


def test_imported_answers_keep_their_calls_and_an_empty_one_is_refused(tmp_path):
    """`eagle3 import-responses`: an answer produced elsewhere keeps its calls, stays bound to its tools
    prompt, and an answer with neither text nor calls is rejected, never stored."""
    from eagle3_assets.core.generation.binding import IMPORTED, AnswerRules
    from eagle3_assets.core.generation.importer import import_responses
    from eagle3_assets.core.generation.journal import ResponseJournal
    from eagle3_assets.core.generation.served_models import ServedModels

    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    rows = [
        {"id": i, "tools": TOOLS, "messages": [{"role": "user", "content": f"Weather in {i}?"}]}
        for i in ("Rome", "Oslo")
    ]
    src = write_jsonl(tmp_path / "B1.jsonl", rows)
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    answers = write_jsonl(
        tmp_path / "answers.jsonl",
        [
            {
                "id": "Rome",
                "model": "m",
                "content": None,
                "finish_reason": "tool_calls",
                "tool_calls": [_call("r1", "Rome")],
            },
            {"id": "Oslo", "model": "m", "content": "", "finish_reason": "stop"},
        ],
    )
    chat = ChatTokenizer(qwen_tools())
    summary = import_responses(layout, answers, chat, ServedModels(("m",)))
    assert summary.imported == 1 and sum(summary.rejected.values()) == 1
    assert "neither text nor tool calls" in next(iter(summary.rejected))
    responses, _ = stored(layout)
    row = responses.row(0, named=True)
    assert row["id"] == "Rome" and parse_calls(row["tool_calls"]) == [
        ToolCall("get_weather", '{"city": "Rome"}', "r1")
    ]
    # bound to the prompt with its tools: it stands
    rules = AnswerRules("last", {IMPORTED: None}, {IMPORTED: ServedModels(("m",))})
    assert not ResponseJournal(layout).standing(rules).aside


def test_the_acceptance_gate_renders_a_tools_prompt_as_the_token_row_has_it(families):
    """The gate checks each sample's answer span against its generation prompt rendered afresh: a tools row's
    prompt is rendered with its tools (without them it would not be the prompt the answer followed)."""
    import dataclasses

    from eagle3_assets.core.acceptance.samples import GateSample, boundary_problems, rendered_prompts

    chat = ChatTokenizer(families["kimi_tools"])
    row = chat.tokenize([(HISTORY, CALL)], tools=[TOOLS])[0]
    sample = GateSample("t1", HISTORY, row.input_ids, row.loss_mask, tools=TOOLS)
    assert boundary_problems([sample], rendered_prompts(chat, [sample]), chat.stop_ids) == {}
    without = dataclasses.replace(sample, tools=None)
    assert boundary_problems([without], rendered_prompts(chat, [without]), chat.stop_ids)


def test_parallel_calls_are_spliced_by_position_and_name():
    """A turn with two calls: each source result follows the target's call at its position when the names
    match, addressed to the target's ids; another order or number of calls is a divergence."""
    from eagle3_assets.core.generation.conversations import TurnAnswer, turn_messages
    from eagle3_assets.core.generation.tool_splice import divergence

    source = [
        {"role": "user", "content": "Weather in Paris and the ACME stock?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": calls_json(
                [ToolCall("get_weather", "{}", "s1"), ToolCall("get_stock", "{}", "s2")]
            ),
        },
        {"role": "tool", "content": "21", "tool_call_id": "s1", "name": "get_weather"},
        {"role": "tool", "content": "99", "tool_call_id": "s2", "name": "get_stock"},
        {"role": "assistant", "content": "21 degrees; ACME at 99."},
    ]
    same = (ToolCall("get_weather", '{"city": "Paris"}', "t1"), ToolCall("get_stock", '{"s": "ACME"}', "t2"))
    msgs = turn_messages(source, 2, [TurnAnswer("", None, same)])
    assert [(m["content"], m["tool_call_id"]) for m in msgs[2:]] == [("21", "t1"), ("99", "t2")]
    assert divergence(source, 1, same) is None
    assert "get_stock, get_weather where the source called get_weather, get_stock" in (
        divergence(source, 1, tuple(reversed(same))) or ""
    )
    assert divergence(source, 1, same[:1]) is not None
    assert divergence(source, 4, ()) is None  # a reply where the source replied


def test_the_dagster_check_on_the_embedded_target_passes_then_fails_on_an_empty_answer(tmp_path):
    """The training-data job on a tools dataset, answered by the embedded SmolLM2 (its template has no tools
    section: it sees none, and its raw text is the answer). The blocking check passes on its answers; an
    empty answer stored by something else makes it fail."""
    import dagster as dg

    from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable

    from .support.projects import make_project, run_training_data_job

    rows = [
        {"id": "w", "tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Rome?"}]},
        {
            "id": "r",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [_call("c1", "Rome")]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 25}'},
            ],
        },
    ]
    path = make_project(tmp_path, {"B1": {"rows": rows, "max_tokens": 12}})

    def checks(instance):
        result = run_training_data_job(path, "B1", instance)
        return {e.check_name: e for e in result.get_asset_check_evaluations()}

    with dg.instance_for_test() as instance:
        first = checks(instance)
        assert first["tokens_answers_have_text_or_calls"].passed
        layout = DatasetLayout(tmp_path / "data", "B1")
        responses = pl.read_parquet(layout.responses_dir / "*.parquet")
        assert set(responses["id"].to_list()) == {"w", "r"}
        tokens = pl.read_parquet(layout.tokens)
        assert tokens.height == 2 and tokens["n_loss_tokens"].min() > 0
        # an answer with neither text nor calls, stored by an earlier version
        table = JournalTable(layout.responses_dir, RESPONSE_SCHEMA)
        empty = responses.filter(pl.col("id") == "w").with_columns(
            pl.lit("").alias("content"), pl.lit(None, pl.String).alias("reasoning")
        )
        for f in layout.responses_dir.glob("*.parquet"):
            f.unlink()
        table.append(pl.concat([empty, responses.filter(pl.col("id") == "r")]).select(list(RESPONSE_SCHEMA)))
        second = checks(instance)
        verdict = second["tokens_answers_have_text_or_calls"]
        assert not verdict.passed and verdict.metadata["examples"].value == "w"
