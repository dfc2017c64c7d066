"""The prompts of `turns: all` rows: turn k of a conversation as the model saw it when it wrote that turn.

A regenerated conversation is stored as one response row per turn (`<id>#t<k>`). Its prompt is the source before
slot k with the target's own answers (and their reasoning) in the earlier slots: exactly the request that was sent,
rebuilt from the stored answers, so each turn's row renders what the model saw, loss on that turn only. Templates
that drop earlier turns' reasoning from the history (Kimi K2.5, Qwen3) render it that way by themselves.
"""

from __future__ import annotations

import polars as pl

from ..generation.conversations import TurnAnswer, split_turn_id, turn_id, turn_messages
from ..storage.layout import DatasetLayout
from ..storage.tables import RESPONSE_SCHEMA, JournalTable

MESSAGE = pl.Struct({"role": pl.String, "content": pl.String, "reasoning": pl.String})


def with_turn_prompts(prompts: pl.DataFrame, layout: DatasetLayout) -> pl.DataFrame:
    """`prompts` (id, messages), plus a row per stored turn of a regenerated conversation whose earlier turns are
    all stored (a turn is rebuilt from its predecessors' answers)."""
    table = JournalTable(layout.responses_dir, RESPONSE_SCHEMA)
    if not table.files():
        return prompts
    ids = set(prompts["id"].to_list())
    stored = table.scan(["id", "content", "reasoning"]).unique(subset=["id"], keep="first").collect()
    turns: dict[str, dict[int, TurnAnswer]] = {}
    for rid, content, reasoning in stored.iter_rows():
        if rid in ids:
            continue
        parsed = split_turn_id(rid)
        if parsed is not None and parsed[0] in ids:
            turns.setdefault(parsed[0], {})[parsed[1]] = TurnAnswer(content or "", reasoning)
    if not turns:
        return prompts
    source = dict(
        zip(prompts["id"].to_list(), prompts["messages"].to_list(), strict=True)
    )  # only conversations with turns are looked at
    rows_id: list[str] = []
    rows_msgs: list[list[dict]] = []
    for cid, answers in turns.items():
        k = 1
        while k in answers:
            history = [answers[j] for j in range(1, k)]
            msgs = turn_messages(source[cid], k, history)
            rows_id.append(turn_id(cid, k))
            rows_msgs.append(
                [{"role": m["role"], "content": m["content"], "reasoning": m.get("reasoning")} for m in msgs]
            )
            k += 1
    turn_rows = pl.DataFrame(
        {"id": rows_id, "messages": rows_msgs}, schema={"id": pl.String, "messages": pl.List(MESSAGE)}
    )
    base = prompts.select(
        "id", pl.col("messages").list.eval(pl.element().struct.with_fields(reasoning=pl.lit(None, pl.String)))
    )
    return pl.concat([base, turn_rows])
