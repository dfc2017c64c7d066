"""Prompts that cannot fit the target's context, quarantined before any is sent.

A request holds the prompt and the answer, so a prompt of as many tokens as the context (or more) can never be
answered: a server refuses it, or worse, truncates it silently. Counting every prompt with the target's
tokenizer would make the prompts stage load it for every dataset, and a 50 MB hostile prompt would be encoded
whole. So each prompt is bounded first, from its UTF-8 size alone:

- at most `bytes + TEMPLATE_TOKENS_PER_MESSAGE × messages + TEMPLATE_TOKENS_FIXED` tokens, since a token of
  text covers at least one byte and the allowances cover what the chat template adds (role headers, a default
  system prompt, the generation prompt). Under the context: kept, and most datasets never load the tokenizer;
- at least `ceil(bytes / longest)` tokens, where no token of the vocabulary covers more than `longest` bytes.
  At or over the context: quarantined without encoding it ("at least N tokens").

Only prompts between the two bounds are counted exactly, with the target's chat template
(`ChatTokenizer.prompt_ids`, the ids the model would be given), so the text encoded per prompt is at most
context × longest bytes (SmolLM2: 8,192 × 81 B ≈ 660 KB).

Assumptions, stated where they are relied on: the upper bound holds for byte-level BPE and SentencePiece
vocabularies whose normaliser does not expand text (NFKC can, on text full of compatibility characters); the
lower bound holds for a template that writes every message's text (one that drops a message could make it
refuse a prompt that fits).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import polars as pl

from ..target_model.context import longest_token_bytes

if TYPE_CHECKING:
    from ..target_model.chat import ChatTokenizer

TEMPLATE_TOKENS_PER_MESSAGE = 32
TEMPLATE_TOKENS_FIXED = 1024
EXACT_BATCH = 64  # prompts per exact count (bounded memory: each is under context × longest bytes)
# Every context reason names the target's context in these words: how the metadata groups them, and how a
# rebuild without a tokenizer finds the verdicts an earlier ingestion wrote (`RecordedVerdicts`).
CONTEXT_MARK = "the target's context"
CONTEXT_CLASS = "prompt longer than the target's context"

Messages = list[dict[str, Any]]


class TokenCounter(Protocol):
    """What the guard needs of the target's tokenizer, asked only for prompts near or over the limit."""

    def longest_token_bytes(self) -> int: ...

    def prompt_lengths(
        self, prompts: Sequence[Messages], tools: Sequence[list[dict] | None] | None = None
    ) -> list[int]: ...


class PromptGuard(Protocol):
    """Decides, for (id, messages) pairs (and each prompt's tool definitions, compact JSON, where it has any),
    which prompts may not be sent: a reason each, None to keep it."""

    def verdicts(
        self, prompts: Sequence[tuple[str, Messages]], tools: Sequence[str | None] | None = None
    ) -> list[str | None]: ...


class ChatCounter:
    """TokenCounter over the target's ChatTokenizer: exact counts of the generation prompt as the model is
    given it."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat = chat
        self._longest: int | None = None

    def longest_token_bytes(self) -> int:
        if self._longest is None:
            self._longest = longest_token_bytes(self.chat.tok)
        return self._longest

    def prompt_lengths(
        self, prompts: Sequence[Messages], tools: Sequence[list[dict] | None] | None = None
    ) -> list[int]:
        out = []
        for messages, ids in zip(prompts, self.chat.prompt_ids(prompts, tools), strict=True):
            if isinstance(ids, Exception):
                # A template that refuses this conversation (the tokens stage records why): its texts alone
                # are counted, which is no more than the prompt would be.
                out.append(sum(self.chat.count_tokens(m["content"]) for m in messages))
            else:
                out.append(len(ids))
        return out


@dataclass
class ContextGuard:
    """Refuses prompts of `context` tokens or more (no room left for an answer); `counter` builds the
    tokenizer's counter, called only when some prompt is too large for the byte bound to keep it."""

    context: int
    counter: Callable[[], TokenCounter]
    source: str = ""
    counted_exactly: int = 0
    refused_unencoded: int = 0
    tokenizer_loaded: bool = field(default=False)

    def verdicts(
        self, prompts: Sequence[tuple[str, Messages]], tools: Sequence[str | None] | None = None
    ) -> list[str | None]:
        offered = list(tools) if tools is not None else [None] * len(prompts)
        # The tool definitions are rendered into the prompt too: their bytes count.
        sizes = [
            content_bytes(m) + len((t or "").encode("utf-8"))
            for (_, m), t in zip(prompts, offered, strict=True)
        ]
        out: list[str | None] = [None] * len(prompts)
        near = [
            i
            for i, (size, (_, messages)) in enumerate(zip(sizes, prompts, strict=True))
            if upper_bound(size, len(messages)) >= self.context
        ]
        if not near:
            return out
        counter = self.counter()
        self.tokenizer_loaded = True
        longest = counter.longest_token_bytes()
        exact = []
        for i in near:
            at_least = -(-sizes[i] // longest)
            if at_least >= self.context:
                out[i] = self.reason(at_least, sizes[i])
                self.refused_unencoded += 1
            else:
                exact.append(i)
        for start in range(0, len(exact), EXACT_BATCH):
            batch = exact[start : start + EXACT_BATCH]
            lengths = counter.prompt_lengths(
                [prompts[i][1] for i in batch], [json.loads(t) if (t := offered[i]) else None for i in batch]
            )
            for i, n in zip(batch, lengths, strict=True):
                if n >= self.context:
                    out[i] = self.reason(n)
            self.counted_exactly += len(batch)
        return out

    def reason(self, tokens: int, size: int | None = None) -> str:
        """The quarantine reason: the count (or its lower bound, with the size it came from) and the limit."""
        if size is not None:
            return (
                f"prompt of at least {tokens:,} tokens ({size:,} bytes) exceeds {CONTEXT_MARK} of "
                f"{self.context:,} tokens"
            )
        if tokens == self.context:
            return (
                f"prompt of {tokens:,} tokens fills {CONTEXT_MARK} of {self.context:,}, leaving no room for "
                "an answer"
            )
        return f"prompt of {tokens:,} tokens exceeds {CONTEXT_MARK} of {self.context:,} tokens"


@dataclass(frozen=True)
class RecordedVerdicts:
    """The context verdicts an earlier ingestion wrote to quarantine.parquet, by prompt id: how a stage that
    rebuilds a damaged prompts.parquet from the source (without the tokenizer) keeps those prompts out."""

    reasons: dict[str, str]

    @classmethod
    def read(cls, quarantine: pl.DataFrame | None) -> RecordedVerdicts:
        if quarantine is None or quarantine.height == 0:
            return cls({})
        rows = quarantine.filter(pl.col("reason").str.contains(CONTEXT_MARK, literal=True))
        return cls(dict(zip(rows["id"].to_list(), rows["reason"].to_list(), strict=True)))

    def verdicts(
        self, prompts: Sequence[tuple[str, Messages]], tools: Sequence[str | None] | None = None
    ) -> list[str | None]:
        return [self.reasons.get(pid) for pid, _ in prompts]


def content_bytes(messages: Messages) -> int:
    """The bytes of the messages' texts, a call's JSON included."""
    return sum(
        len(m["content"].encode("utf-8")) + len((m.get("tool_calls") or "").encode("utf-8")) for m in messages
    )


def upper_bound(size: int, n_messages: int) -> int:
    """The most tokens a prompt of `size` bytes of text in `n_messages` messages can take, template
    included."""
    return size + TEMPLATE_TOKENS_PER_MESSAGE * n_messages + TEMPLATE_TOKENS_FIXED
