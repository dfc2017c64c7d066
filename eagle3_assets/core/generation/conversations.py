"""`turns: all`: every assistant turn of a conversation answered by the target, in order, as a chain.

A conversation's assistant slots are where its source has an assistant turn, and after its last user turn.
Turn k's request carries the source's system, user and tool messages before slot k and, in place of the
source's assistant texts, the target's own answers to turns 1..k-1, with their reasoning where the chat
template has a field for it (it then keeps or drops it, as it does when the model serves; sent as `reasoning`
and `reasoning_content`). Each turn is stored as its own response row, `<conversation id>#t<k>`; the next turn
is sent as soon as the previous answer lands, so thousands of conversations advance side by side in the
engine's window without waiting for each other. A resumed run continues each conversation after its last
stored turn; a turn that fails for good ends its conversation's regeneration.

Agent traces (`tool_splice`): after a target's turn that calls tools, the source's results are spliced in
when the target called the same tools as the source at that point (by position and name), re-addressed to
the target's own call ids; where it called something else, the conversation stops there (TOOL_DIVERGED).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import polars as pl

from ..prompts.fingerprints import request_fingerprint
from ..target_model.tool_calls import ToolCall, calls_json, parse_calls
from .protocol import Completion, CompletionRequest, Sampling
from .tool_splice import TOOL_DIVERGED, call_ids, divergence

if TYPE_CHECKING:
    from ..storage.tables import JournalTable

TURN_SEP = "#t"
# The failure kind of a conversation cut by its template: a turn after the first that the chat template
# refuses (roles that do not alternate as it demands). The turns before it are answered and stored; the rest
# is bad input, recorded with its reason and not counted as a failed request
# (core.report.validation.counted_failures).
TEMPLATE_REST = "template_rest"


def turn_id(conversation: str, k: int) -> str:
    return f"{conversation}{TURN_SEP}{k}"


def split_turn_id(rid: str) -> tuple[str, int] | None:
    """(conversation id, turn) of a turn row's id; None for a row of `turns: last`."""
    head, sep, tail = rid.rpartition(TURN_SEP)
    if not sep or not tail.isdigit() or not head:
        return None
    return head, int(tail)


def assistant_slots(messages: list[dict]) -> list[int]:
    """Indices where an assistant turn goes: each source assistant turn, then after the last message (a prompt
    ends with a user turn; its answer is the final slot)."""
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant"] + [len(messages)]


@dataclass(frozen=True)
class TurnAnswer:
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    def message(self, keep_reasoning: bool = True) -> dict:
        msg: dict[str, str | None] = {"role": "assistant", "content": self.content}
        if self.reasoning and keep_reasoning:
            msg["reasoning"] = self.reasoning
        if self.tool_calls:  # absent from an answer without calls: its fingerprint is as it always was
            msg["tool_calls"] = calls_json(self.tool_calls)
        return msg


def turn_messages(
    messages: list[dict], k: int, answers: list[TurnAnswer], keep_reasoning: bool = True
) -> list[dict]:
    """The request of turn k (1-based): the source before slot k, the target's answers in the earlier slots
    (with their reasoning where the template has a field for it; a template without one never shows it to the
    model)."""
    slots = assistant_slots(messages)
    if not 1 <= k <= len(slots) or len(answers) < k - 1:
        raise ValueError(f"turn {k} of a conversation with {len(slots)} turns and {len(answers)} answers")
    out: list[dict] = []
    j = 0
    ids: dict[str, str] = {}  # the source's call ids -> the target's, after a target's turn with calls
    for i, m in enumerate(messages[: slots[k - 1]]):
        if i in slots[: k - 1]:
            out.append(answers[j].message(keep_reasoning))
            ids = call_ids(messages, i, answers[j].tool_calls)
            j += 1
        elif m.get("role") == "tool" and m.get("tool_call_id") in ids:
            out.append({**m, "tool_call_id": ids[m["tool_call_id"]]})
        else:
            out.append(m)
    return out


def turn_fingerprint(
    source: list[dict],
    k: int,
    answers: list[TurnAnswer],
    tools: str | None = None,
    tool_choice: str | None = None,
) -> str:
    """Turn k's request, fingerprinted: the source before slot k with the target's own answers to turns
    1..k-1 (and their reasoning, whether or not the template shows it to the model), and the tools offered."""
    msgs = turn_messages(source, k, answers[: k - 1], keep_reasoning=True)
    return request_fingerprint(msgs, tools, tool_choice)


@dataclass
class Chain:
    """One conversation in flight: its source messages and the target's answers so far."""

    id: str
    messages: list[dict]
    answers: list[TurnAnswer] = field(default_factory=list)
    tools: str | None = None  # the tools offered (compact JSON, the source's key order), sent with every turn
    tool_choice: str | None = None

    @property
    def n_turns(self) -> int:
        return len(assistant_slots(self.messages))

    @property
    def next_turn(self) -> int | None:
        k = len(self.answers) + 1
        return k if k <= self.n_turns else None


class Chains:
    """The lane's follow-up source: first requests for every conversation with a turn left, then, as each
    answer lands, that conversation's next turn (rendered to ids here when the backend takes ids)."""

    def __init__(
        self,
        chains: list[Chain],
        max_tokens: int,
        sampling: Sampling,
        render: Callable[[list[dict], list[dict] | None], list[int] | Exception] | None,
        skip: Callable[[str, str, str], None],
        keep_reasoning: bool = True,
    ):
        self.keep_reasoning = keep_reasoning  # the template renders earlier turns' reasoning (a field for it)
        self.chains = {c.id: c for c in chains}
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.render = render
        self.skip = skip  # (turn id, kind, message): a turn the template refuses ends its conversation

    def first_requests(self) -> Iterator[CompletionRequest]:
        for chain in list(self.chains.values()):  # answers landing meanwhile remove finished chains
            request = self._request(chain)
            if request is not None:
                yield request

    def follow(self, request: CompletionRequest, completion: Completion) -> CompletionRequest | None:
        """The answer to `request` landed: the conversation's next turn, or None when it is complete."""
        parsed = split_turn_id(request.id)
        if parsed is None or parsed[0] not in self.chains:
            return None
        chain = self.chains[parsed[0]]
        chain.answers.append(
            TurnAnswer(completion.content or "", completion.reasoning, tuple(completion.tool_calls))
        )
        if chain.next_turn is None:
            del self.chains[chain.id]
            return None
        return self._request(chain)

    def _request(self, chain: Chain) -> CompletionRequest | None:
        k = chain.next_turn
        if k is None:
            return None
        if k > 1:
            slot = assistant_slots(chain.messages)[k - 2]
            why = divergence(chain.messages, slot, chain.answers[k - 2].tool_calls)
            if why is not None:
                # The target's turn k-1 does not fit the source's tool results: its turns 1..k-1 stand, the
                # rest is not asked (no result is glued to a call it does not answer).
                n = chain.n_turns
                self.skip(turn_id(chain.id, k), TOOL_DIVERGED, f"turn {k - 1} of {n}: {why}")
                self.chains.pop(chain.id, None)
                return None
        msgs = turn_messages(chain.messages, k, chain.answers, self.keep_reasoning)
        tools = json.loads(chain.tools) if chain.tools else None
        prompt_ids = None
        if self.render is not None:
            rendered = self.render(msgs, tools)
            if isinstance(rendered, Exception):
                # Turn 1 refused: nothing of the prompt is answered, a lost prompt like any failure
                # ("template"). A later turn: the conversation is regenerated up to it and the rest recorded
                # (TEMPLATE_REST).
                n = chain.n_turns
                why = f"turn {k} of {n}: {rendered}"
                if k > 1:
                    done = "turn 1" if k == 2 else f"turns 1-{k - 1}"
                    left = f"turn {k}" if k == n else f"turns {k}-{n}"
                    why += f" ({done} answered and stored; {left} not sent)"
                self.skip(turn_id(chain.id, k), "template" if k == 1 else TEMPLATE_REST, why)
                self.chains.pop(chain.id, None)
                return None
            prompt_ids = rendered
        return CompletionRequest(
            turn_id(chain.id, k),
            msgs,
            self.max_tokens,
            self.sampling,
            prompt_ids,
            fingerprint=turn_fingerprint(chain.messages, k, chain.answers, chain.tools, chain.tool_choice),
            tools=tools,
            tool_choice=json.loads(chain.tool_choice) if chain.tool_choice else None,
        )


def stored_turn_answers(responses: JournalTable, ids: Collection[str]) -> dict[str, TurnAnswer]:
    """Turn id -> the stored answer (text and reasoning) of each of `ids` that has one: the history a
    conversation's next turn is sent with, and a turn row's prompt is rebuilt from. Reads only those ids."""
    if not ids or not responses.files():
        return {}
    stored = (
        responses.scan(["id", "content", "reasoning", "tool_calls"])
        .filter(pl.col("id").is_in(list(ids)))
        .unique(subset=["id"], keep="first")
        .collect()
    )
    return {
        rid: TurnAnswer(content or "", reasoning, tuple(parse_calls(calls)))
        for rid, content, reasoning, calls in stored.iter_rows()
    }
