"""The prompts of `turns: all` rows: each regenerated turn as the model saw it when it wrote that turn.

A regenerated conversation is stored as one response row per turn (`<id>#t<k>`). Turn k's prompt is the source
before slot k with the target's own answers (and their reasoning) in the earlier slots: exactly the request
that was sent, rebuilt from the stored answers.

Two shapes of token rows, decided per conversation by the template itself (`ChatTokenizer.keeps_history`):
- the template keeps the history verbatim (ChatML) and every earlier turn finished: each earlier turn renders
  in the final conversation exactly as it did while it was written, so **one row per conversation** (named by
  its last stored turn, `<id>#t<K>`) trains every turn, loss on each, and each earlier turn's reference ids
  are compared with its own span;
- the template rewrites history (Kimi K2.5 and Qwen3 drop earlier turns' reasoning; a template not proven to
  write texts verbatim is treated so): **one row per turn**, rendered as the model saw it, loss on that turn
  only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import polars as pl

from ..generation.conversations import (
    TurnAnswer,
    assistant_slots,
    split_turn_id,
    stored_turn_answers,
    turn_id,
    turn_messages,
)
from ..prompts.tools import RowTools
from ..storage.layout import DatasetLayout
from ..storage.tables import RESPONSE_SCHEMA, JournalTable
from ..target_model.chat import Answer, ChatTokenizer
from ..target_model.tool_calls import finished as is_finished
from ..target_model.tool_calls import parse_calls
from ..target_model.tool_render import tools_of

MESSAGE = pl.Struct({"role": pl.String, "content": pl.String, "reasoning": pl.String})
# An earlier turn of a conversation row: the ids the model produced for it and whether it finished.
HISTORY_REF = pl.Struct({"output_ids": pl.List(pl.Int64), "finished": pl.Boolean})
TURN_COLUMNS: dict[str, pl.DataType] = {"all_turns": pl.Boolean(), "history_refs": pl.List(HISTORY_REF)}


def _stored_turns(
    layout: DatasetLayout, ids: set[str], exclude: Collection[str] = ()
) -> dict[str, dict[int, tuple]]:
    """The stored answers of later turns, by conversation id and turn: (answer, finish reason, output ids);
    answers of `exclude` (no longer standing) left out."""
    table = JournalTable(layout.responses_dir, RESPONSE_SCHEMA)
    if not table.files():
        return {}
    stored = (
        table.scan(["id", "content", "reasoning", "finish_reason", "output_ids", "tool_calls"])
        .unique(subset=["id"], keep="first")
        .collect()
    )
    turns: dict[str, dict[int, tuple]] = {}
    for rid, content, reasoning, finish, out_ids, calls in stored.iter_rows():
        if rid in ids or rid in exclude:
            continue
        parsed = split_turn_id(rid)
        if parsed is not None and parsed[0] in ids:
            turns.setdefault(parsed[0], {})[parsed[1]] = (
                TurnAnswer(content or "", reasoning, tuple(parse_calls(calls))),
                finish,
                out_ids,
            )
    return turns


def with_turn_prompts(
    prompts: pl.DataFrame,
    layout: DatasetLayout,
    chat: ChatTokenizer | None = None,
    exclude: Collection[str] = (),
) -> pl.DataFrame:
    """`prompts` (id, messages) plus the rows of regenerated conversations (a turn is rebuilt from its
    predecessors' answers, so only the stored turns 1..K without a gap count), with `all_turns` (train
    every assistant turn of the row) and `history_refs` (the earlier turns' produced ids, for a
    conversation row)."""
    base = prompts.select(
        "id",
        pl.col("messages").list.eval(pl.element().struct.with_fields(reasoning=pl.lit(None, pl.String))),
        *(["tools"] if "tools" in prompts.columns else []),
    ).with_columns(
        pl.lit(False).alias("all_turns"),
        pl.lit(None, dtype=TURN_COLUMNS["history_refs"]).alias("history_refs"),
    )
    turns = _stored_turns(layout, set(prompts["id"].to_list()), exclude)
    if not turns:
        return base
    source = dict(zip(prompts["id"].to_list(), prompts["messages"].to_list(), strict=True))
    agentic = "tools" in prompts.columns
    offered = dict(zip(prompts["id"].to_list(), RowTools.of(prompts).tools, strict=True))
    struct = base.schema["messages"].inner  # type: ignore[attr-defined]
    fields = [f.name for f in struct.fields]  # the prompts' own fields, in their order, and `reasoning`
    keep = chat.template_has_reasoning if chat is not None else True
    out_id: list[str] = []
    out_msgs: list[list[dict]] = []
    out_all: list[bool] = []
    out_refs: list[list[dict] | None] = []
    out_tools: list[str | None] = []

    def add(rid: str, msgs: list[dict], all_turns: bool, refs: list[dict] | None) -> None:
        out_id.append(rid)
        out_msgs.append([{f: m.get(f) for f in fields} for m in msgs])
        out_all.append(all_turns)
        out_refs.append(refs)
        out_tools.append(offered[split_turn_id(rid)[0]])  # type: ignore[index]

    for cid, got in turns.items():
        last = 0
        while last + 1 in got:
            last += 1
        if not last:
            continue
        answers = [got[k][0] for k in range(1, last + 1)]
        final = turn_messages(source[cid], last, answers[:-1], keep)
        finished = is_finished(got[last][1])
        # An earlier turn cut by max_tokens renders closed in the history (the template ends every turn): the
        # row would train an end-of-turn the model never wrote there. Such conversations get a row per turn.
        mergeable = all(is_finished(got[k][1]) for k in range(1, last))
        # Reasoning the model wrote in an earlier turn that the history does not show: that turn as written is
        # not in the final conversation.
        mergeable = mergeable and (keep or not any(a.reasoning for a in answers[:-1]))
        if (
            last > 1
            and mergeable
            and chat is not None
            and chat.keeps_history(
                final, Answer(answers[-1].content, answers[-1].reasoning, finished, answers[-1].tool_calls)
            )
        ):
            refs = [{"output_ids": got[k][2], "finished": is_finished(got[k][1])} for k in range(1, last)]
            add(turn_id(cid, last), final, True, refs)
            continue
        for k in range(1, last + 1):
            add(turn_id(cid, k), turn_messages(source[cid], k, answers[: k - 1], keep), False, None)
    columns = {"id": out_id, "messages": out_msgs, "all_turns": out_all, "history_refs": out_refs}
    schema: dict[str, pl.DataType] = {"id": pl.String(), "messages": pl.List(struct), **TURN_COLUMNS}
    if agentic:
        columns["tools"], schema["tools"] = out_tools, pl.String()
    turn_rows = pl.DataFrame(columns, schema=schema)
    return pl.concat([base, turn_rows.select(base.columns)])


def row_prompts(
    layout: DatasetLayout, prompts: pl.DataFrame, ids: Iterable[str], keep_reasoning: bool = True
) -> dict[str, dict[str, Any]]:
    """For each token row of `ids`: `messages`, the prompt as the model saw it when it wrote the row's (last)
    turn, and `source_answer`, the source's own answer to that turn. A prompt's own row is as prompts.parquet
    has it; a turn row `<id>#t<k>` (a turn's row, or a conversation row named by its last turn: the same
    prompt) is the request of turn k rebuilt from the source and the stored answers to turns 1..k-1
    (`keep_reasoning`: the template has a field for earlier turns' reasoning,
    `ChatTokenizer.template_has_reasoning`), its source answer the source's assistant text in slot k (the
    prompt's `source_answer` for the final slot). Reads only the answers these rows need. A row that is
    neither, or whose earlier answers are not stored, is left out."""
    wanted = list(ids)
    has_source = "source_answer" in prompts.columns
    agentic = "tools" in prompts.columns
    columns = ["id", "messages", *(["source_answer"] if has_source else []), *(["tools"] if agentic else [])]
    direct = set(prompts.filter(pl.col("id").is_in(wanted))["id"].to_list())
    turns = {
        rid: parsed for rid in wanted if rid not in direct and (parsed := split_turn_id(rid)) is not None
    }
    need = direct | {c for c, _ in turns.values()}
    rows = {
        r["id"]: r
        for r in prompts.filter(pl.col("id").is_in(list(need))).select(columns).iter_rows(named=True)
    }
    out: dict[str, dict[str, Any]] = {
        rid: {
            "messages": rows[rid]["messages"],
            "source_answer": rows[rid].get("source_answer"),
            "tools": tools_of(rows[rid].get("tools")),
        }
        for rid in direct
    }
    history_ids = {turn_id(c, j) for c, k in turns.values() if c in rows for j in range(1, k)}
    answers = stored_turn_answers(JournalTable(layout.responses_dir, RESPONSE_SCHEMA), history_ids)
    for rid, (cid, k) in turns.items():
        row = rows.get(cid)
        if row is None:
            continue
        source = row["messages"]
        slots = assistant_slots(source)
        history = [a for j in range(1, k) if (a := answers.get(turn_id(cid, j))) is not None]
        if k > len(slots) or len(history) < k - 1:
            continue
        out[rid] = {
            "messages": turn_messages(source, k, history, keep_reasoning),
            "source_answer": source[slots[k - 1]]["content"]
            if slots[k - 1] < len(source)
            else row.get("source_answer"),
            "tools": tools_of(row.get("tools")),
        }
    return out
