"""Import responses produced elsewhere (another pipeline, a batch API, a teammate's run) into a dataset.

Each JSONL row names its prompt by `id`, by `messages` (a trailing assistant turn is then the answer) or by a
`prompt` string (the prompt's last user turn), and carries the answer as `response`/`content`, with optional
`reasoning`, `output_ids`, `usage` {prompt_tokens, completion_tokens, cost}, `finish_reason`, `model`,
`provider`. Imported rows count toward the budget like generated ones and their output ids serve as references
for tokens. Every row must name the model that wrote it (its `model`, or the import's default), and that model
must be one the config accepts as the target: another model's answers are never trained. Rows that match no
prompt, a prompt already answered, or another model are reported and written to imports/ with the reason.
Each imported answer is bound to the prompt it matched as it stands (`binding`): edited later, it is asked
again.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from ..prompts.fingerprints import prompt_fingerprint
from ..prompts.ingest import RowError, content_id, iter_source_rows, normalise_row, read_prompts
from ..prompts.tools import normalise_calls
from ..storage.files import write_parquet
from ..storage.layout import DatasetLayout
from ..storage.tables import IMPORT_REJECTED_SCHEMA
from ..target_model.chat import ChatTokenizer
from ..target_model.tool_calls import ToolCall, finished
from .binding import IMPORTED
from .journal import JournalWriter, ResponseJournal
from .protocol import Completion
from .served_models import ServedModels

REJECTED_SCHEMA = IMPORT_REJECTED_SCHEMA


@dataclass
class ImportSummary:
    source: str
    rows: int = 0
    imported: int = 0
    completion_tokens: int = 0
    rejected: Counter = field(default_factory=Counter)
    rejected_path: Path | None = None


class _PromptIndex:
    def __init__(self, prompts: pl.DataFrame, system_prompt: str | None = None):
        self.system_prompt = system_prompt  # the dataset's own, added to imported messages as ingest adds it
        self.ids = set(prompts["id"].to_list())
        self.messages = dict(zip(prompts["id"].to_list(), prompts["messages"].to_list(), strict=True))
        # As ingest fingerprinted each prompt (with its tools, where it has any).
        self.fingerprints = (
            dict(zip(prompts["id"].to_list(), prompts["fingerprint"].to_list(), strict=True))
            if "fingerprint" in prompts.columns
            else {}
        )
        self.by_hash: dict[str, str] = {}
        last_user: dict[str, list[str]] = {}
        for pid, msgs in zip(prompts["id"].to_list(), prompts["messages"].to_list(), strict=True):
            self.by_hash[content_id(msgs)] = pid
            last_user.setdefault(msgs[-1]["content"], []).append(pid)
        self.by_last_user = last_user

    def fingerprint(self, pid: str) -> str:
        """The prompt an imported answer is bound to: as it stands now."""
        return self.fingerprints.get(pid) or prompt_fingerprint(self.messages[pid])

    def match(self, row: dict) -> tuple[str, dict]:
        """(prompt id, answer fields) of one import row, or RowError."""
        answer = dict(row)
        if isinstance(row.get("messages"), list):
            msgs = list(row["messages"])
            if (
                msgs
                and isinstance(msgs[-1], dict)
                and msgs[-1].get("role") == "assistant"
                and not (row.get("response") or row.get("content"))
            ):
                answer["response"] = msgs[-1].get("content")
                answer.setdefault("reasoning", msgs[-1].get("reasoning") or msgs[-1].get("reasoning_content"))
                answer.setdefault("tool_calls", msgs[-1].get("tool_calls"))
        rid = row.get("id")
        if rid is not None:
            if str(rid) in self.ids:
                return str(rid), answer
            raise RowError(f"id {rid!r} is not a prompt of this dataset")
        if isinstance(row.get("messages"), list):
            normalised = normalise_row(
                {"messages": row["messages"]}, "messages", system_prompt=self.system_prompt
            )
            pid = self.by_hash.get(content_id(normalised))
            if pid:
                return pid, answer
            raise RowError("no prompt has these messages")
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            hits = self.by_last_user.get(prompt, [])
            if len(hits) == 1:
                return hits[0], answer
            raise RowError(
                "no prompt has this text" if not hits else f"{len(hits)} prompts end with this text"
            )
        raise RowError("a row needs one of: id, messages, prompt")


def _completion(
    answer: dict, chat: ChatTokenizer, default_model: str | None, served: ServedModels
) -> Completion:
    content = answer.get("response", answer.get("content"))
    calls = normalise_calls(answer["tool_calls"], "tool_calls", None) if answer.get("tool_calls") else []
    if content is None and calls:
        content = ""  # a call alone is an answer
    if not isinstance(content, str):
        raise RowError("missing answer text (response or content)")
    reasoning = answer.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RowError("reasoning must be a string")
    if not (content or reasoning or calls):
        raise RowError("an answer with neither text nor tool calls (nothing to train)")
    ids = answer.get("output_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) and i >= 0 for i in ids)):
        raise RowError("output_ids must be a list of non-negative integers")
    finish = str(answer.get("finish_reason") or "stop")
    usage: dict[str, Any] = answer["usage"] if isinstance(answer.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens")
    if not isinstance(tokens, int):
        if ids is not None:
            tokens = len(ids)
        else:  # count with the target tokenizer so the budget is honest
            tokens = len(chat.encoder.encode_texts([_answer_text(content, reasoning, calls)])[0]) + finished(
                finish
            )
    cost = usage.get("cost")
    model = answer.get("model") or default_model
    if not model:
        raise RowError(
            "the row names no model: give the model that wrote the answers (a `model` field, or --model)"
        )
    if not served.accepts(str(model)):
        raise RowError(f"answer from model {model!r}, not the target (accepted: {served.describe()})")
    counted = (
        len(ids)
        if ids is not None
        else len(chat.encoder.encode_texts([_answer_text(content, reasoning, calls)])[0])
    )
    return Completion(
        content=content,
        reasoning=reasoning or None,
        finish_reason=finish,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(tokens),
        counted_tokens=counted,
        cost_usd=float(cost) if isinstance(cost, int | float) else None,
        model=str(model),
        provider=answer.get("provider"),
        output_ids=ids,
        tool_calls=calls,
    )


def _answer_text(content: str, reasoning: str | None, calls: list[ToolCall]) -> str:
    """What the answer wrote, as counted: reasoning, content and each call's name and arguments."""
    return (reasoning or "") + content + "".join(c.name + c.arguments for c in calls)


def import_responses(
    layout: DatasetLayout,
    source: Path,
    chat: ChatTokenizer,
    served: ServedModels,
    model: str | None = None,
    system_prompt: str | None = None,
) -> ImportSummary:
    """Import `source` into the dataset's journal. `served`: the names the config accepts as the target
    (`binding.served_models(cfg)[IMPORTED]`); `model`: the model of rows that name none."""
    prompts = read_prompts(layout.prompts)
    index = _PromptIndex(prompts, system_prompt)
    journal = ResponseJournal(layout)
    summary = ImportSummary(source=str(source))
    rejected: list[dict[str, Any]] = []
    with journal.responses.exclusive(f"an import or generation for dataset {layout.key}"):
        journal.finalize()
        done = journal.done_ids()
        writer = JournalWriter(
            journal, IMPORTED, run_id=f"import-{int(time.time())}", source=f"imported:{source.name}"
        )
        seen: set[str] = set()
        for row_no, row, error in iter_source_rows(source):
            summary.rows += 1
            try:
                if error:
                    raise RowError(error)
                if not isinstance(row, dict):
                    raise RowError("row is not an object")
                pid, answer = index.match(row)
                if pid in done or pid in seen:
                    raise RowError(f"prompt {pid} already has a response")
                c = _completion(answer, chat, model, served)
                c.prompt_fingerprint = index.fingerprint(pid)
            except RowError as e:
                rejected.append({"source_row": row_no, "reason": str(e)})
                summary.rejected[str(e).split(" (")[0][:60]] += 1
                continue
            seen.add(pid)
            writer.add_completion(pid, c)
            summary.imported += 1
            summary.completion_tokens += c.completion_tokens
            if writer.pending >= 50_000:
                writer.flush_sync()
        writer.flush_sync()
        journal.finalize()
    if rejected:
        path = layout.imports_dir / f"rejected-{source.stem}-{int(time.time())}.parquet"
        write_parquet(pl.DataFrame(rejected, schema=REJECTED_SCHEMA), path)
        summary.rejected_path = path
    return summary
