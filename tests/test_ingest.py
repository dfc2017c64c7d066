"""prompts: the three source formats, stable ids, duplicates and the quarantine."""

from __future__ import annotations

import json

import polars as pl

from eagle3_assets.config import DatasetConfig
from eagle3_assets.core.prompts.ingest import content_id, ingest, write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout

from .support.projects import REPO, write_jsonl


def test_three_formats_normalise_to_messages(tmp_path):
    sharegpt = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {
                "id": "a",
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "Hello"},
                    {"from": "human", "value": "Bye?"},
                    {"from": "gpt", "value": "dropped trailing answer"},
                ],
            },
        ],
    )
    r = ingest(sharegpt, "sharegpt")
    assert r.prompts["messages"][0].to_list() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye?"},
    ]
    inst = write_jsonl(
        tmp_path / "i.jsonl",
        [{"instruction": "Sort this", "input": "3 1 2"}, {"q": "custom field", "ctx": ""}],
    )
    r = ingest(inst, "instruction")
    assert r.prompts["messages"][0].to_list() == [{"role": "user", "content": "Sort this\n\n3 1 2"}]
    assert "missing field 'instruction'" in r.quarantine["reason"][0]
    r = ingest(inst, "instruction", {"instruction": "q", "input": "ctx"})
    assert r.prompts["messages"].to_list()[-1] == [{"role": "user", "content": "custom field"}]
    msgs = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "multi"}, {"type": "text", "text": "part"}],
                    }
                ]
            }
        ],
    )
    assert ingest(msgs, "messages").prompts["messages"][0].to_list() == [
        {"role": "user", "content": "multipart"}
    ]


def test_ids_are_stable_and_duplicates_dropped(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "same"}]},
        {"id": 7, "messages": [{"role": "user", "content": "x"}]},
        {"messages": [{"role": "user", "content": "same"}]},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    first, second = ingest(path, "messages"), ingest(path, "messages")
    assert first.prompts["id"].to_list() == second.prompts["id"].to_list()
    assert first.prompts["id"].to_list() == [content_id([{"role": "user", "content": "same"}]), "7"]
    assert first.outcomes["duplicate"] == 1
    assert first.quarantine.filter(pl.col("reason").str.starts_with("duplicate of")).height == 1


def test_bad_rows_are_quarantined_with_reasons_and_the_rest_goes_on(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "fine"}]})
    lines = [
        good.encode(),
        b'{"messages": [{"role": "user", "content": "unterminated',
        json.dumps({"messages": [{"role": "robot", "content": "beep"}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "   "}]}).encode(),
        json.dumps({"messages": [{"role": "assistant", "content": "only an answer"}]}).encode(),
        json.dumps({"text": "no messages"}).encode(),
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',  # latin-1 byte: invalid UTF-8
        b'{"messages": [{"role": "user", "content": "\\ud800 lone surrogate"}]}',
        json.dumps({"messages": [{"role": "system", "content": "sys"}]}).encode(),
        json.dumps(["not", "an", "object"]).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    r = write_prompts(
        path, DatasetLayout(tmp_path, "out"), DatasetConfig(source=str(path), format="messages")
    )
    assert r.prompts.height == 1 and r.n_source_rows == len(lines)
    reasons = pl.read_parquet(out / "quarantine.parquet")["reason"].to_list()
    expected = [
        "bad JSON",
        "unknown role 'robot'",
        "empty content",
        "no user turn",
        "missing field 'messages'",
        "invalid UTF-8",
        "lone surrogate",
        "no user turn",
        "not an object",
    ]
    assert len(reasons) == len(expected)
    for want in expected:
        assert any(want in got for got in reasons), (want, reasons)
    assert pl.read_parquet(out / "prompts.parquet").schema["messages"] == pl.List(
        pl.Struct({"role": pl.String, "content": pl.String})
    )


def test_parquet_and_json_sources(tmp_path):
    rows = [{"id": "q1", "instruction": "Add 2 and 3", "input": ""}]
    pl.DataFrame(rows).write_parquet(tmp_path / "s.parquet")
    (tmp_path / "s.json").write_text(json.dumps(rows))
    for name in ("s.parquet", "s.json"):
        r = ingest(tmp_path / name, "instruction")
        assert r.prompts["id"].to_list() == ["q1"]


def test_demo_sources_cover_all_formats_and_quarantine_their_bad_rows():
    b1 = ingest(REPO / "prompts/B1.jsonl", "sharegpt")
    assert b1.outcomes["quarantined"] == 2 and b1.prompts.height >= 20
    b4 = ingest(REPO / "prompts/B4.jsonl", "instruction")
    assert b4.outcomes["duplicate"] == 1 and b4.outcomes["quarantined"] == 1


def test_the_sources_own_answer_is_kept_beside_the_prompt(tmp_path):
    """The trailing assistant turn is not sent to the target, but kept as source_answer (the acceptance gate
    trains on it to show what regenerating answers buys); rows without one have null."""
    rows = {
        "messages": [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]},
            {"messages": [{"role": "user", "content": "bye"}]},
        ],
        "sharegpt": [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}],
        "instruction": [
            {"instruction": "add", "input": "", "response": "def add(a, b): return a + b"},
            {"instruction": "sub", "output": "a - b"},
            {"instruction": "mul"},
        ],
    }
    expected = {
        "messages": ["hello!", None],
        "sharegpt": ["a"],
        "instruction": ["def add(a, b): return a + b", "a - b", None],
    }
    for fmt, src in rows.items():
        result = ingest(write_jsonl(tmp_path / f"{fmt}.jsonl", src), fmt)
        assert result.prompts["source_answer"].to_list() == expected[fmt], fmt
        assert all(m[-1]["role"] == "user" for m in result.prompts["messages"].to_list())
    named = ingest(tmp_path / "instruction.jsonl", "instruction", {"response": "output"})
    assert named.prompts["source_answer"].to_list() == [None, "a - b", None]


def test_tool_turns_pass_through_as_the_source_has_them(tmp_path):
    """An agent trace's tool results stay in the conversation as `tool` turns (OpenAI messages), and
    ShareGPT's `observation` (LLaMA-Factory), `tool` and `function_response` speakers become them; the rules
    on how a conversation ends are unchanged."""
    messages = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {
                "id": "m1",
                "messages": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "Calling get_weather(Paris)."},
                    {
                        "role": "tool",
                        "tool_call_id": "call_1",
                        "name": "get_weather",
                        "content": "18C, sunny",
                    },
                    {"role": "user", "content": "And tomorrow?"},
                    {"role": "assistant", "content": "dropped trailing answer"},
                ],
            },
            {
                "id": "m2",  # ends with a tool result: no user turn for the target to answer
                "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Calling."},
                    {"role": "tool", "content": "18C"},
                ],
            },
        ],
    )
    r = ingest(messages, "messages")
    assert r.prompts["id"].to_list() == ["m1"]
    assert r.prompts["messages"][0].to_list() == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Calling get_weather(Paris)."},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert r.quarantine["reason"].to_list() == ["conversation ends with a tool turn, not a user turn"]

    sharegpt = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {
                "id": f"s-{speaker}",
                "conversations": [
                    {"from": "human", "value": "Weather?"},
                    {"from": "gpt", "value": "Calling get_weather."},
                    {"from": speaker, "value": f"18C ({speaker})"},
                    {"from": "human", "value": "Thanks. Tomorrow?"},
                ],
            }
            for speaker in ("observation", "tool", "function_response")
        ],
    )
    r = ingest(sharegpt, "sharegpt")
    assert r.quarantine.height == 0
    assert [[m["role"] for m in msgs] for msgs in r.prompts["messages"].to_list()] == [
        ["user", "assistant", "tool", "user"]
    ] * 3
    assert r.prompts["messages"][0].to_list()[2] == {"role": "tool", "content": "18C (observation)"}
