"""Encode plain text with the target tokenizer so that no added or special token is ever matched inside it.

Control tokens (`<|im_end|>`, `<think>`, …) must come from the chat template alone: a user who types
"<|im_end|>" wrote text. Fast tokenizers get a clone whose added tokens are all special, encoded with
`encode_special_tokens=True` (Rust, batched, all cores). Slow tokenizers (Kimi's tiktoken class) are driven through
their base tokenization in a thread pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol


class TextEncoder(Protocol):
    control_ids: dict[str, int]  # every added token string -> id (the strings a template may emit)
    special_ids: set[int]  # ids of tokens marked special
    is_fast: bool

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _added_tokens(tok: Any) -> tuple[dict[str, int], set[int]]:
    decoder = getattr(tok, "added_tokens_decoder", None) or {}
    control = {t.content: int(i) for i, t in decoder.items()}
    special = {int(i) for i, t in decoder.items() if getattr(t, "special", False)}
    for s in getattr(tok, "all_special_tokens", []) or []:
        i = tok.convert_tokens_to_ids(s)
        if isinstance(i, int) and i >= 0:
            control.setdefault(s, i)
            special.add(i)
    return control, special


class FastTextEncoder:
    is_fast = True

    def __init__(self, tok: Any):
        from tokenizers import Tokenizer

        self.control_ids, self.special_ids = _added_tokens(tok)
        spec = json.loads(tok.backend_tokenizer.to_str())
        for t in spec.get("added_tokens", []):
            t["special"] = True  # so encode_special_tokens turns off matching for all of them
        self._raw = Tokenizer.from_str(json.dumps(spec))
        self._raw.encode_special_tokens = True
        self._tok = tok

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        # encode_batch_fast skips offset tracking, which nothing here needs.
        return [e.ids for e in self._raw.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class SlowTextEncoder:
    """Python tokenizers: base tokenization without the added-token split, over a thread pool."""

    is_fast = False

    def __init__(self, tok: Any, workers: int | None = None):
        self.control_ids, self.special_ids = _added_tokens(tok)
        self._tok = tok
        self._pool = ThreadPoolExecutor(max_workers=workers or max(1, (os.cpu_count() or 2)))
        self._encode_one = self._pick_method(tok)

    def _pick_method(self, tok: Any):
        def via_base(text: str) -> list[int]:
            # `_tokenize` is the model's own tokenization, before any added-token matching.
            return tok.convert_tokens_to_ids(tok._tokenize(text)) if text else []

        def via_no_special(text: str) -> list[int]:
            # Kimi's TikTokenTokenizer: encode(..., allow_special_tokens=False) -> tiktoken disallowed_special=().
            return tok.encode(text, allow_special_tokens=False) if text else []

        def via_split(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []

        probe = "a<|im_end|>b" if "<|im_end|>" in self.control_ids else "ab"
        control = set(self.control_ids.values())
        for method in (via_no_special, via_split, via_base):
            try:
                ids = method(probe)
            except Exception:
                continue
            if ids and not (set(ids) & control) and self.decode(ids) == probe:
                return method
        raise ValueError(
            f"{type(tok).__name__}: cannot encode text without matching its added tokens "
            "(neither split_special_tokens nor _tokenize keeps '<|im_end|>' as text)"
        )

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        if len(texts) < 64:
            return [self._encode_one(t) for t in texts]
        return list(self._pool.map(self._encode_one, texts, chunksize=64))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def make_text_encoder(tok: Any) -> TextEncoder:
    if getattr(tok, "is_fast", False) and hasattr(tok, "backend_tokenizer"):
        return FastTextEncoder(tok)
    return SlowTextEncoder(tok)
