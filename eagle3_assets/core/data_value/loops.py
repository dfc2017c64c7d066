"""Degenerate loops in the suite's decoded outputs. A draft reaches a high acceptance length for nothing when
the target's output is one phrase over and over (any draft that learned the phrase is accepted): such a
figure is flagged, and set beside the draft's figure on the prompts that do not loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..tokens.answer_quality import DEGENERATE_MAX_RATIO, compression_ratio

# The tokens stage judges whole answers from 400 characters; the suite's outputs are `max_new_tokens` long
# (64 tokens, ~250 characters, by default), so a loop is judged from this many characters. Measured with the
# same LZ4 ratio: a 13-character phrase repeated over 156 characters is 0.15, a sentence or a few lines
# of code of that length 0.88-0.99.
LOOP_MIN_CHARS = 120


def is_loop(text: str) -> bool:
    """The tokens stage's degenerate-answer test (LZ4 compressibility), on an output `max_new_tokens` long."""
    return len(text) >= LOOP_MIN_CHARS and compression_ratio(text) < DEGENERATE_MAX_RATIO


def looping_prompts(
    ids: Sequence[str], outputs: Sequence[Sequence[int]], decode: Callable[[list[int]], str]
) -> list[str]:
    """The suite ids whose decoded output loops."""
    return [sid for sid, out in zip(ids, outputs, strict=True) if is_loop(decode(list(out)))]
