"""Fingerprints of what a request sends: canonical JSON, hashed, stable across processes and versions."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

FINGERPRINT_CHARS = 32


def digest(obj: Any) -> str:
    """sha256 of `obj` as canonical JSON (keys sorted, no spaces), its first FINGERPRINT_CHARS hex digits."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:FINGERPRINT_CHARS]


def prompt_fingerprint(messages: Sequence[Mapping[str, Any]]) -> str:
    """The messages of a request as sent; a field without a value is left out, so a new optional field never
    changes the fingerprint of messages that do not have it."""
    return digest([{k: v for k, v in m.items() if v is not None and v != ""} for m in messages])


def request_fingerprint(
    messages: Sequence[Mapping[str, Any]], tools: str | None = None, tool_choice: str | None = None
) -> str:
    """The messages of a request with the tools it offers; a request without tools is fingerprinted exactly
    as `prompt_fingerprint` always did, so no stored answer of a dataset without tools is asked again."""
    if tools is None and tool_choice is None:
        return prompt_fingerprint(messages)
    return digest(
        {
            "messages": [{k: v for k, v in m.items() if v is not None and v != ""} for m in messages],
            "tools": tools,
            "tool_choice": tool_choice,
        }
    )
