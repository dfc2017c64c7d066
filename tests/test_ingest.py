"""prompts: the three source formats, stable ids, duplicates and the quarantine."""

from __future__ import annotations

import json

import polars as pl
import pytest

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
    """An agent trace's tool results stay in the conversation as `tool` turns (OpenAI messages) with their
    call's id and name, and
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
    # A tool result keeps its call's id and name (tests/test_tool_calls.py: with the calls themselves).
    plain = {"tool_calls": None, "tool_call_id": None, "name": None}
    assert r.prompts["messages"][0].to_list() == [
        {"role": "user", "content": "Weather in Paris?", **plain},
        {"role": "assistant", "content": "Calling get_weather(Paris).", **plain},
        {"role": "tool", "content": "18C, sunny", **plain, "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "user", "content": "And tomorrow?", **plain},
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


def test_rows_that_break_the_parser_are_one_quarantine_row_each_and_the_rest_goes_on(tmp_path):
    """A 5,000-deep line (RecursionError in json.loads), one deep enough to load but not to walk, a number
    too long to convert, a 1 MB id, a non-text content part nested deep: each is one quarantine row with its
    true reason, and the good rows around them are prompts."""

    def good(i):
        return json.dumps({"id": f"ok{i}", "messages": [{"role": "user", "content": f"fine {i}"}]})

    deep_part = {"type": "image", "data": json.loads("[" * 40 + "]" * 40)}
    hostile = [
        ('{"messages": ' + "[" * 5000 + "]" * 5000 + "}", "nested more than 32 levels deep"),
        (json.dumps({"messages": json.loads("[" * 200 + "]" * 200)}), "nested more than 32 levels deep"),
        ('{"id": ' + "9" * 5000 + ', "messages": []}', "a number too long to read (5,000 digits"),
        (
            json.dumps({"id": "x" * 1_000_000, "messages": [{"role": "user", "content": "hi"}]}),
            "id longer than 256 characters (1,000,000)",
        ),
        (
            json.dumps({"id": "y" * 257, "messages": [{"role": "user", "content": "hi"}]}),
            "id longer than 256 characters",
        ),
        (json.dumps({"messages": [{"role": "user", "content": [deep_part]}]}), "nested more than 32 levels"),
        (
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
            "non-text content part",
        ),
        (json.dumps({"messages": [{"role": "user", "content": {"text": "an object"}}]}), "got dict"),
        (json.dumps({"messages": 12}), "missing field 'messages'"),
    ]
    lines = [good(0)]
    for i, (line, _) in enumerate(hostile, start=1):
        lines += [line, good(i)]
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join(lines) + "\n")
    r = ingest(path, "messages")
    assert r.prompts["id"].to_list() == [f"ok{i}" for i in range(len(hostile) + 1)]
    assert r.n_source_rows == len(lines) and r.quarantine.height == len(hostile)
    for (_, want), row in zip(hostile, r.quarantine.iter_rows(named=True), strict=True):
        assert want in row["reason"], (want, row["reason"])
        assert len(row["raw"]) <= 2000 and len(row["id"] or "") <= 2000
    # The importer of answers reads sources the same way: it gets the error, not an exception.
    from eagle3_assets.core.prompts.ingest import iter_source_rows

    errors = [e for _, _, e in iter_source_rows(path) if e]
    assert errors[0].startswith("nested more than 32 levels deep") and len(errors) == 4


def test_nesting_is_measured_without_recursion():
    from eagle3_assets.core.prompts.reading import MAX_NESTING, clip, nesting_depth

    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert nesting_depth(deep) == MAX_NESTING + 1  # stops past the limit
    assert nesting_depth({"messages": [{"role": "user", "content": "x"}]}) == 3
    assert nesting_depth("text") == 0
    assert len(json.dumps(clip({"a": ["x" * 10_000] * 1000}))) < 2100


def test_a_json_document_too_deep_to_parse_fails_naming_the_file_and_a_deep_row_in_one_is_quarantined(
    tmp_path,
):
    """A .json source is one document: if it cannot be parsed no row of it can be used, and the error names
    the file and the fix (one row per line). One that parses keeps its good rows when one row is deep."""
    from eagle3_assets.core.prompts.ingest import RowError

    whole = tmp_path / "deep.json"
    whole.write_text("[" + "[" * 5000 + "]" * 5000 + "]")
    with pytest.raises(RowError, match=r"deep\.json.*nested more than 32 levels deep.*\.jsonl"):
        ingest(whole, "messages")
    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "fine"}]},
        {"id": "b", "messages": json.loads("[" * 100 + "]" * 100)},
    ]
    doc = tmp_path / "rows.json"
    doc.write_text(json.dumps(rows))
    r = ingest(doc, "messages")
    assert r.prompts["id"].to_list() == ["a"] and "nested more than 32" in r.quarantine["reason"][0]


def test_parquet_values_nested_too_deep_are_quarantined_and_an_unreadable_schema_names_the_file(tmp_path):
    """Polars' reader overflows the stack (a segfault, not an exception) on a schema nested past pyarrow's
    limit: the schema is read with pyarrow first, so such a file fails with a message naming it, and the
    process lives. Within pyarrow's limit, a row whose value is deeper than MAX_NESTING is quarantined (a
    null in the deep column is not deep)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_assets.core.prompts.ingest import RowError

    def nested(levels: int) -> tuple[pa.DataType, object]:
        dtype, value = pa.int64(), 1
        for _ in range(levels):
            dtype, value = pa.list_(dtype), [value]
        return dtype, value

    dtype, value = nested(40)  # pyarrow reads up to 49 list levels
    table = pa.table(
        {
            "id": ["a", "b"],
            "messages": [[{"role": "user", "content": "deep extra"}], [{"role": "user", "content": "ok"}]],
            "extra": pa.array([value, None], type=dtype),
        }
    )
    pq.write_table(table, tmp_path / "deep.parquet")
    r = ingest(tmp_path / "deep.parquet", "messages")
    assert r.prompts["id"].to_list() == ["b"]
    assert r.quarantine["reason"].to_list() == ["nested more than 32 levels deep (column 'extra')"]

    dtype, value = nested(60)
    pq.write_table(pa.table({"extra": pa.array([value], type=dtype)}), tmp_path / "deeper.parquet")
    with pytest.raises(RowError, match=r"deeper\.parquet: not a readable Parquet file"):
        ingest(tmp_path / "deeper.parquet", "messages")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really PAR1")
    with pytest.raises(RowError, match=r"junk\.parquet: not a readable Parquet file"):
        ingest(tmp_path / "junk.parquet", "messages")
