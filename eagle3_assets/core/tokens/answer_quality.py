"""Per-answer quality flags the tokens stage stores beside each row, for the report to count."""

from __future__ import annotations

import pyarrow as pa

DEGENERATE_MIN_CHARS = 400
# LZ4-compressed / raw. Measured: natural prose and code >= 0.37 (short answers ~0.9); an answer that is 80%
# one repeated phrase 0.15-0.18, 90% 0.08-0.11; a text that is one phrase repeated ~0.04. LZ4 instead of zlib:
# 10x faster (zlib took ~4% of the tokens stage's CPU) with the same verdicts (zlib-6 below 0.12 flags the
# same 80% mark).
DEGENERATE_MAX_RATIO = 0.17
_LZ4 = pa.Codec("lz4_raw")


def compression_ratio(text: str) -> float:
    """LZ4-compressed size over raw size (1.0 for an empty text)."""
    raw = text.encode("utf-8")
    return len(_LZ4.compress(raw, asbytes=True)) / len(raw) if raw else 1.0


def is_degenerate(text: str | None) -> bool:
    """Long answers that compress extremely well are loops of the same n-grams."""
    if not text or len(text) < DEGENERATE_MIN_CHARS:
        return False
    return compression_ratio(text) < DEGENERATE_MAX_RATIO
