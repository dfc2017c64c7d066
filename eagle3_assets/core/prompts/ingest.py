"""Source datasets -> chat prompts with stable ids.

Every source row ends in exactly one place: a prompt, a duplicate of an earlier prompt, or the quarantine with
a reason. A bad row never stops the rest of the file (`reading` bounds what a row may hold), and a prompt the
target cannot hold is quarantined here too (`context`), so it is never sent.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from ...config import DatasetConfig
from ..storage.layout import DatasetLayout
from ..storage.quarantine import Quarantined, parquet_problem, sweep_parquet
from ..target_model.tool_calls import TOOL_FIELDS, calls_json, canonical, has_tool_fields
from .context import CONTEXT_CLASS, CONTEXT_MARK, PromptGuard, RecordedVerdicts
from .fingerprints import request_fingerprint
from .reading import RAW_PREVIEW_CHARS, RowError, clip, iter_source_rows
from .tools import (
    link_results,
    normalise_call,
    normalise_calls,
    normalise_tools,
    tool_names,
)

# A tool turn (a function's result in an agent trace) keeps its `tool_call_id` and `name`, an assistant turn
# its `tool_calls` (`tools`).
MESSAGE_ROLES = {"system", "user", "assistant", "tool"}
# ShareGPT dumps in the wild name speakers in several ways; anything else is quarantined.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "assistant",  # an assistant turn that calls a tool: `value` is the call's JSON
}
SHAREGPT_CALL_ROLES = {"function_call"}
# An id is a key, repeated in every stage's tables, turn ids (`<id>#t<k>`), logs and exports; a longer one is
# content put in the wrong field. Datasets' ids are UUIDs (36), hashes (64) or names well under this.
MAX_ID_CHARS = 256

PROMPT_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String(),
    "messages": pl.List(pl.Struct({"role": pl.String(), "content": pl.String()})),
    "source_row": pl.Int64(),
    "n_turns": pl.Int32(),
    # The source's own answer to the last turn (its trailing assistant turn, or an instruction row's response
    # field), null where it has none: the acceptance gate trains on it to show what regeneration buys.
    "source_answer": pl.String(),
    # The messages as a request sends them, hashed (`fingerprints.prompt_fingerprint`): an answer stored with
    # another fingerprint answered another question (the source row was edited since).
    "fingerprint": pl.String(),
}
# A dataset with tool rows: messages carry their calls (compact JSON), a tool result its call's id and name,
# a prompt its tool definitions and `tool_choice` (compact JSON). A dataset without any keeps PROMPT_SCHEMA.
TOOL_MESSAGE = pl.Struct(
    {"role": pl.String(), "content": pl.String(), **dict.fromkeys(TOOL_FIELDS, pl.String())}
)
TOOL_PROMPT_SCHEMA: dict[str, pl.DataType] = {
    **PROMPT_SCHEMA,
    "messages": pl.List(TOOL_MESSAGE),
    "tools": pl.String(),
    "tool_choice": pl.String(),
}
QUARANTINE_SCHEMA: dict[str, pl.DataType] = {
    "source_row": pl.Int64(),
    "id": pl.String(),
    "reason": pl.String(),
    "raw": pl.String(),
}


@dataclass
class IngestResult:
    prompts: pl.DataFrame
    quarantine: pl.DataFrame
    n_source_rows: int
    outcomes: Counter = field(default_factory=Counter)
    # damaged earlier outputs, moved to quarantine/
    set_aside: list[Quarantined] = field(default_factory=list)


# -- normalising
# -----------------------------------------------------------------------------------------------
def _text(value: Any, where: str) -> str:
    """Message content as text; OpenAI multi-part content is joined when every part is text."""
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise RowError(f"{where}: non-text content part {preview(part)[:80]!r}")
        value = "".join(parts)
    if not isinstance(value, str):
        raise RowError(f"{where}: content must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"{where}: empty content")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(f"{where}: invalid unicode (lone surrogate at {e.start})") from None
    return value


def _tool_text(value: Any, where: str) -> str:
    """A tool result's text: a JSON value the source stored as an object is written as JSON text."""
    if isinstance(value, dict | list) and not (
        isinstance(value, list) and value and isinstance(value[0], dict) and value[0].get("type") == "text"
    ):
        return json.dumps(value, ensure_ascii=False)
    return _text(value, where)


def _from_messages(row: dict, offered: set[str] | None) -> list[dict]:
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RowError("missing field 'messages' (a non-empty list)")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RowError(f"messages[{i}] is not an object")
        role = m.get("role")
        if role not in MESSAGE_ROLES:
            raise RowError(f"messages[{i}]: unknown role {role!r} (expected system, user, assistant or tool)")
        where = f"messages[{i}]"
        if role == "assistant" and m.get("tool_calls"):
            calls = normalise_calls(m["tool_calls"], where, offered)
            content = m.get("content")
            text = _text(content, where) if content not in (None, "") else ""
            out.append({"role": role, "content": text, "tool_calls": calls_json(calls)})
        elif role == "tool":
            msg = {"role": role, "content": _tool_text(m.get("content"), where)}
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise RowError(f"{where}: {key} must be a string")
                    msg[key] = m[key]
            out.append(msg)
        else:
            out.append({"role": role, "content": _text(m.get("content"), where)})
    return out


def _sharegpt_calls(value: Any, where: str, offered: set[str] | None) -> list[dict]:
    """A ShareGPT `function_call` turn (LLaMA-Factory, Glaive): its value is the call (or a list of calls)
    as JSON, `{name, arguments}`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowError(f"{where}: malformed tool call (not JSON)") from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise RowError(f"{where}: malformed tool call (empty)")
    parsed = [normalise_call(c, where, offered) for c in calls]
    return [{"role": "assistant", "content": "", "tool_calls": calls_json(parsed)}]


def _from_sharegpt(row: dict, offered: set[str] | None) -> list[dict]:
    conv = row.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise RowError("missing field 'conversations' (a non-empty list)")
    out: list[dict] = []
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            raise RowError(f"conversations[{i}] is not an object")
        speaker = m.get("from")
        low = speaker.lower() if isinstance(speaker, str) else None
        role = SHAREGPT_ROLES.get(low) if low is not None else None
        if role is None:
            raise RowError(
                f"conversations[{i}]: unknown role {speaker!r} "
                "(expected system, human, gpt, function_call, tool or observation)"
            )
        where = f"conversations[{i}]"
        if low in SHAREGPT_CALL_ROLES:
            out += _sharegpt_calls(m.get("value"), where, offered)
        elif role == "tool":
            out.append({"role": role, "content": _tool_text(m.get("value"), where)})
        else:
            out.append({"role": role, "content": _text(m.get("value"), where)})
    return out


def _from_instruction(row: dict, instruction: str, input_: str, system: str | None) -> list[dict]:
    if instruction not in row:
        raise RowError(f"missing field {instruction!r}")
    text = _text(row.get(instruction), instruction)
    extra = row.get(input_)
    if extra is not None and not isinstance(extra, str):
        raise RowError(f"field {input_!r} must be a string")
    if extra and extra.strip():
        text = f"{text}\n\n{_text(extra, input_)}"
    msgs = [{"role": "user", "content": text}]
    if system and row.get(system):
        msgs.insert(0, {"role": "system", "content": _text(row[system], system)})
    return msgs


def row_tools(row: Any, dataset_tools: list[dict] | None) -> list[dict] | None:
    """The tool definitions in force for a row: its own `tools` (a list or its JSON text), else the
    dataset's; RowError where the row's are malformed."""
    value = row.get("tools") if isinstance(row, dict) else None
    if value is None or value == "" or value == []:
        return dataset_tools or None
    return normalise_tools(value)


def row_tool_choice(row: Any) -> str | None:
    """The row's `tool_choice` as the source has it (compact JSON), None where it has none."""
    value = row.get("tool_choice") if isinstance(row, dict) else None
    return None if value is None else canonical(value)


def normalise_row(
    row: Any,
    fmt: str,
    fields: dict[str, Any] | None = None,
    system_prompt: str | None = None,
    tools: list[dict] | None = None,
) -> list[dict]:
    """One source row -> chat messages ending in a user turn (or a tool result the target answers), or
    RowError with the reason. A call to a tool that `tools` does not define is refused."""
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not an object")
    fields = fields or {}
    offered = tool_names(tools)
    if fmt == "messages":
        msgs = _from_messages(row, offered)
    elif fmt == "sharegpt":
        msgs = _from_sharegpt(row, offered)
    elif fmt == "instruction":
        msgs = _from_instruction(
            row, fields.get("instruction", "instruction"), fields.get("input", "input"), fields.get("system")
        )
    else:
        raise ValueError(f"unknown source format {fmt!r}")
    # The target model answers the last turn afresh: a trailing assistant turn is dropped.
    while msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    if not any(m["role"] == "user" for m in msgs):
        raise RowError("no user turn")
    calls = any(m.get("tool_calls") for m in msgs)
    # A trace may end with a tool result the target answers, where the result answers a call.
    if msgs[-1]["role"] not in (("user", "tool") if calls else ("user",)):
        raise RowError(f"conversation ends with a {msgs[-1]['role']} turn, not a user turn")
    if calls:
        link_results(msgs)
    if any(m["role"] == "system" for m in msgs[1:]):
        raise RowError("a system turn after the first message")
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def source_answer(row: Any, fmt: str, fields: dict[str, Any] | None = None) -> str | None:
    """The answer the source itself gives to the conversation's last turn, if any (never an error: the prompt
    stands without it)."""
    fields = fields or {}
    try:
        if fmt == "instruction":
            names = [fields["response"]] if fields.get("response") else ["response", "output"]
            for name in names:
                value = row.get(name)
                if isinstance(value, str) and value.strip():
                    return value
            return None
        msgs = _from_messages(row, None) if fmt == "messages" else _from_sharegpt(row, None)
    except RowError:
        return None
    if msgs and msgs[-1]["role"] == "assistant" and msgs[-1]["content"].strip():
        return msgs[-1]["content"]
    return None


def content_id(messages: list[dict], tools: str | None = None) -> str:
    """A stable id from the conversation's content (used when the source row has no id); a message's tool
    fields and the row's tools count where it has them."""
    parts: list[Any] = [
        [
            m["role"],
            m["content"],
            *([{f: m[f] for f in TOOL_FIELDS if m.get(f)}] if has_tool_fields([m]) else []),
        ]
        for m in messages
    ]
    if tools is not None:
        parts.append(["tools", tools])
    text = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return "h" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def preview(value: Any) -> str:
    """What the quarantine keeps of a row: the source's own text for a row that did not parse, else a JSON
    preview of a clipped copy (never the whole of a huge row), both cut to RAW_PREVIEW_CHARS."""
    if isinstance(value, str):
        return value[:RAW_PREVIEW_CHARS]
    return json.dumps(clip(value), ensure_ascii=False, default=str)[:RAW_PREVIEW_CHARS]


def _printable(text: str | None) -> str | None:
    """Quarantine text that Parquet can store even when the source held lone surrogates."""
    if text is None:
        return None
    return text[:RAW_PREVIEW_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")


def _source_id(row: Any) -> str | None:
    if isinstance(row, dict):
        value = row.get("id")
        if isinstance(value, bool) or value is None:
            return None
        if isinstance(value, int | str) and str(value).strip():
            return str(value).strip()
    return None


def check_id(sid: str | None) -> None:
    """A source id must be a short key in valid unicode (RowError with the reason otherwise)."""
    if sid is None:
        return
    if len(sid) > MAX_ID_CHARS:
        raise RowError(f"id longer than {MAX_ID_CHARS} characters ({len(sid):,})")
    if _printable(sid) != sid:
        raise RowError("id is not valid unicode")


@dataclass
class _Ingestion:
    """The rows of one source as they are read: prompts, quarantine rows and the tallies."""

    fmt: str
    fields: dict[str, Any] | None
    system_prompt: str | None
    tools: list[dict] | None = None  # the dataset's tool definitions (a row's own replace them)
    prompts: list[dict] = field(default_factory=list)
    quarantine: list[dict] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)
    seen_ids: dict[str, str] = field(default_factory=dict)  # id -> content hash
    seen_content: dict[str, str] = field(default_factory=dict)  # content hash -> id
    n_rows: int = 0

    def take(self, row_no: int, row: Any, error: str | None) -> None:
        """One source row: a prompt, a duplicate, or a quarantine row with its reason."""
        self.n_rows += 1
        sid = _source_id(row)
        try:
            if error:
                raise RowError(error)
            check_id(sid)
            tools = row_tools(row, self.tools)
            msgs = normalise_row(row, self.fmt, self.fields, self.system_prompt, tools)
        except RowError as e:
            self._quarantine(row_no, _printable(sid), str(e), row)
            return
        tools_json = canonical(tools) if tools else None
        choice = row_tool_choice(row)
        digest = content_id(msgs, tools_json)
        pid = sid or digest
        if digest in self.seen_content:
            reason = f"duplicate of {self.seen_content[digest]}"
            self.quarantine.append({"source_row": row_no, "id": pid, "reason": reason, "raw": ""})
            self.outcomes["duplicate"] += 1
            return
        if pid in self.seen_ids:
            self._quarantine(row_no, pid, f"id {pid!r} already used by another conversation", row)
            return
        self.seen_ids[pid] = digest
        self.seen_content[digest] = pid
        self.prompts.append(
            {
                "id": pid,
                "messages": msgs,
                "source_row": row_no,
                "n_turns": len(msgs),
                "source_answer": source_answer(row, self.fmt, self.fields),
                "fingerprint": request_fingerprint(msgs, tools_json, choice),
                "tools": tools_json,
                "tool_choice": choice,
            }
        )
        self.outcomes["ok"] += 1

    def _quarantine(self, row_no: int, pid: str | None, reason: str, row: Any) -> None:
        raw = _printable(preview(row))
        self.quarantine.append({"source_row": row_no, "id": pid, "reason": reason, "raw": raw})
        self.outcomes["quarantined"] += 1

    def screen(self, guard: PromptGuard) -> None:
        """Move the prompts `guard` refuses (too long for the target) to the quarantine."""
        verdicts = guard.verdicts(
            [(p["id"], p["messages"]) for p in self.prompts], [p.get("tools") for p in self.prompts]
        )
        kept = []
        for prompt, reason in zip(self.prompts, verdicts, strict=True):
            if reason is None:
                kept.append(prompt)
                continue
            self._quarantine(prompt["source_row"], prompt["id"], reason, {"messages": prompt["messages"]})
            self.outcomes["ok"] -= 1
            self.outcomes["over_context"] += 1
        self.prompts = kept

    def result(self) -> IngestResult:
        agentic = any(p["tools"] or has_tool_fields(p["messages"]) for p in self.prompts)
        if not agentic:  # stored exactly as a dataset without tools always was
            for p in self.prompts:
                del p["tools"], p["tool_choice"]
        else:
            for p in self.prompts:
                p["messages"] = [
                    {"role": m["role"], "content": m["content"], **{f: m.get(f) for f in TOOL_FIELDS}}
                    for m in p["messages"]
                ]
        return IngestResult(
            prompts=pl.DataFrame(self.prompts, schema=TOOL_PROMPT_SCHEMA if agentic else PROMPT_SCHEMA),
            quarantine=pl.DataFrame(self.quarantine, schema=QUARANTINE_SCHEMA),
            n_source_rows=self.n_rows,
            outcomes=self.outcomes,
        )


def ingest(
    path: Path,
    fmt: str,
    fields: dict[str, Any] | None = None,
    system_prompt: str | None = None,
    guard: PromptGuard | None = None,
    tools: list[dict] | None = None,
) -> IngestResult:
    """Parse a whole source file into prompts and quarantine rows; `guard` then refuses the prompts the
    target cannot hold (`context.ContextGuard`). `tools`: the dataset's tool definitions, for rows without
    their own."""
    rows = _Ingestion(
        fmt, fields, system_prompt, normalise_tools(tools, "datasets.<key>.tools") if tools else None
    )
    for row_no, row, error in iter_source_rows(path):
        rows.take(row_no, row, error)
    if guard is not None:
        rows.screen(guard)
    return rows.result()


def quarantine_reasons(quarantine: pl.DataFrame) -> dict[str, int]:
    """Counts by reason class (the text before the first ':' or ' of '), for metadata."""
    counts: Counter = Counter()
    for reason in quarantine["reason"].to_list():
        counts[reason_class(reason)] += 1
    return dict(counts.most_common())


def reason_class(reason: str) -> str:
    """A quarantine reason without the row's particulars (position, count, value), to tally reasons by."""
    if CONTEXT_MARK in reason:
        return CONTEXT_CLASS
    head = reason.split(":")[-1].strip() if reason.startswith(("messages[", "conversations[")) else reason
    return head.split(" at ")[0].split(" of ")[0].split(" (")[0]


def write_prompts(
    source: Path, layout: DatasetLayout, dataset: DatasetConfig, guard: PromptGuard | None = None
) -> IngestResult:
    """Ingest `source` (the dataset section's source, resolved) in the section's format, fields and system
    prompt, and write the partition's prompts.parquet and quarantine.parquet atomically.

    `guard` refuses prompts too long for the target (the prompts stage passes the target's). Without one (a
    later stage rebuilding a damaged prompts.parquet, with no tokenizer at hand), the prompts an earlier
    ingestion found too long stay quarantined, as its quarantine.parquet records them."""
    from ..storage.files import write_parquet

    if not source.exists():
        raise FileNotFoundError(
            f"dataset source {source} does not exist; fix datasets.<key>.source in the config"
        )
    if guard is None:
        guard = RecordedVerdicts.read(_readable(layout.quarantine, QUARANTINE_SCHEMA, ["id", "reason"]))
    result = ingest(
        source, dataset.format, dataset.fields.model_dump(), dataset.system_prompt, guard, dataset.tools
    )
    # The outputs are rewritten from the source anyway; a damaged one is set aside first, so that what
    # happened is on record (the check and the report list it) rather than silently overwritten.
    result.set_aside = sweep_parquet(
        layout.dir, [layout.prompts], "prompts", PROMPT_SCHEMA, ["id", "messages"]
    )
    result.set_aside += sweep_parquet(
        layout.dir, [layout.quarantine], "prompts", QUARANTINE_SCHEMA, ["reason"]
    )
    write_parquet(result.prompts, layout.prompts)
    write_parquet(result.quarantine, layout.quarantine)
    return result


def _readable(path: Path, schema: dict[str, pl.DataType], columns: list[str]) -> pl.DataFrame | None:
    """`columns` of a stored table, or None where it is missing or damaged (its sweep sets it aside)."""
    if not path.exists() or parquet_problem(path, schema, columns) is not None:
        return None
    return pl.read_parquet(path, columns=columns)


def ensure_prompts(source: Path, layout: DatasetLayout, dataset: DatasetConfig) -> list[Quarantined]:
    """For a stage that reads prompts.parquet: when it is damaged and the source is there, set it aside and
    write it again from the source (as the prompts stage would), so that no later stage fails on it. A missing
    one is left to the prompts stage. Returns what was set aside."""
    if not layout.prompts.exists() or not source.exists():
        return []
    if parquet_problem(layout.prompts, PROMPT_SCHEMA, ["id", "messages"]) is None:
        return []
    return write_prompts(source, layout, dataset).set_aside


def read_prompts(path: Path, columns: tuple[str, ...] = ("id", "messages")) -> pl.DataFrame:
    """`columns` of prompts.parquet, with its `fingerprint` where the file has one (a file written before the
    column existed has none: `generation.binding.with_fingerprints` computes it), and its `tools` and
    `tool_choice` where the dataset has tool rows."""
    have = pq.read_schema(path).names
    extra = [c for c in ("fingerprint", "tools", "tool_choice") if c in have and c not in columns]
    return pl.read_parquet(path, columns=[*columns, *extra])
