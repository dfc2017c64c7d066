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
from .context import CONTEXT_CLASS, CONTEXT_MARK, PromptGuard, RecordedVerdicts
from .fingerprints import prompt_fingerprint
from .reading import RAW_PREVIEW_CHARS, RowError, clip, iter_source_rows

# A tool turn (a function's result in an agent trace) passes through as the source has it: its text is kept,
# its `tool_call_id`/`name` are not (the stored message is role and content only).
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
}
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


def _from_messages(row: dict) -> list[dict]:
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
        out.append({"role": role, "content": _text(m.get("content"), f"messages[{i}]")})
    return out


def _from_sharegpt(row: dict) -> list[dict]:
    conv = row.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise RowError("missing field 'conversations' (a non-empty list)")
    out = []
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            raise RowError(f"conversations[{i}] is not an object")
        speaker = m.get("from")
        role = SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
        if role is None:
            raise RowError(
                f"conversations[{i}]: unknown role {speaker!r} "
                "(expected system, human, gpt, tool or observation)"
            )
        out.append({"role": role, "content": _text(m.get("value"), f"conversations[{i}]")})
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


def normalise_row(
    row: Any, fmt: str, fields: dict[str, Any] | None = None, system_prompt: str | None = None
) -> list[dict]:
    """One source row -> chat messages ending in a user turn, or RowError with the reason."""
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not an object")
    fields = fields or {}
    if fmt == "messages":
        msgs = _from_messages(row)
    elif fmt == "sharegpt":
        msgs = _from_sharegpt(row)
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
    if msgs[-1]["role"] != "user":
        raise RowError(f"conversation ends with a {msgs[-1]['role']} turn, not a user turn")
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
        msgs = _from_messages(row) if fmt == "messages" else _from_sharegpt(row)
    except RowError:
        return None
    if msgs and msgs[-1]["role"] == "assistant" and msgs[-1]["content"].strip():
        return msgs[-1]["content"]
    return None


def content_id(messages: list[dict]) -> str:
    """A stable id from the conversation's content (used when the source row has no id)."""
    canonical = json.dumps(
        [[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":")
    )
    return "h" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:20]


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
            msgs = normalise_row(row, self.fmt, self.fields, self.system_prompt)
        except RowError as e:
            self._quarantine(row_no, _printable(sid), str(e), row)
            return
        digest = content_id(msgs)
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
                "fingerprint": prompt_fingerprint(msgs),
            }
        )
        self.outcomes["ok"] += 1

    def _quarantine(self, row_no: int, pid: str | None, reason: str, row: Any) -> None:
        raw = _printable(preview(row))
        self.quarantine.append({"source_row": row_no, "id": pid, "reason": reason, "raw": raw})
        self.outcomes["quarantined"] += 1

    def screen(self, guard: PromptGuard) -> None:
        """Move the prompts `guard` refuses (too long for the target) to the quarantine."""
        verdicts = guard.verdicts([(p["id"], p["messages"]) for p in self.prompts])
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
        return IngestResult(
            prompts=pl.DataFrame(self.prompts, schema=PROMPT_SCHEMA),
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
) -> IngestResult:
    """Parse a whole source file into prompts and quarantine rows; `guard` then refuses the prompts the
    target cannot hold (`context.ContextGuard`)."""
    rows = _Ingestion(fmt, fields, system_prompt)
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
    result = ingest(source, dataset.format, dataset.fields.model_dump(), dataset.system_prompt, guard)
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
    column existed has none: `generation.binding.with_fingerprints` computes it)."""
    have = pq.read_schema(path).names
    return pl.read_parquet(path, columns=[*columns, *(["fingerprint"] if "fingerprint" in have else [])])
