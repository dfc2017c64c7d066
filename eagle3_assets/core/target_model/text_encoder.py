"""Encode plain text with the target tokenizer so that no added or special token is ever matched inside it.

Control tokens (`<|im_end|>`, `<think>`, …) must come from the chat template alone: a user who types
"<|im_end|>" wrote text. Fast tokenizers get a clone whose added tokens are all special, encoded with
`encode_special_tokens=True` (Rust, batched, all cores). Slow tokenizers (Kimi's tiktoken class) are driven
through their base tokenization in a thread pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import orjson

from ..storage.files import available_cores


class TextEncoder(Protocol):
    control_ids: dict[str, int]  # every added token string -> id (the strings a template may emit)
    special_ids: set[int]  # ids of tokens marked special
    lstrip_ids: set[int]  # added tokens that absorb the whitespace on their left (AddedToken.lstrip)
    rstrip_ids: set[int]  # ... and on their right (AddedToken.rstrip)
    is_fast: bool

    def encode_texts(self, texts: Sequence[str], at_start: Sequence[bool] | None = None) -> list[list[int]]:
        """Each text as the tokenizer encodes it between control tokens; `at_start[i]` marks a text that opens
        the whole input (where a Metaspace tokenizer with prepend_scheme "first" adds its "▁")."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _added_tokens(tok: Any) -> tuple[dict[str, int], set[int], set[int], set[int]]:
    decoder = getattr(tok, "added_tokens_decoder", None) or {}
    control = {t.content: int(i) for i, t in decoder.items()}
    special = {int(i) for i, t in decoder.items() if getattr(t, "special", False)}
    lstrip = {int(i) for i, t in decoder.items() if getattr(t, "lstrip", False)}
    rstrip = {int(i) for i, t in decoder.items() if getattr(t, "rstrip", False)}
    for s in getattr(tok, "all_special_tokens", []) or []:
        i = tok.convert_tokens_to_ids(s)
        if isinstance(i, int) and i >= 0:
            control.setdefault(s, i)
            special.add(i)
    return control, special, lstrip, rstrip


def _without_first_prepend(node: Any) -> bool:
    """Turn Metaspace prepend_scheme "first" into "never" in a pre-tokenizer spec; True if there was one."""
    if not isinstance(node, dict):
        return False
    found = False
    if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
        node["prepend_scheme"] = "never"
        found = True
    for child in node.get("pretokenizers", []) or []:
        found |= _without_first_prepend(child)
    return found


class FastTextEncoder:
    is_fast = True

    def __init__(self, tok: Any):
        from tokenizers import Tokenizer

        self.control_ids, self.special_ids, self.lstrip_ids, self.rstrip_ids = _added_tokens(tok)
        spec = orjson.loads(tok.backend_tokenizer.to_str())  # orjson: a 128k vocabulary parses in a blink
        for t in spec.get("added_tokens", []):
            t["special"] = True  # so encode_special_tokens turns off matching for all of them
        self._raw = self._build(Tokenizer, spec)
        # Metaspace with prepend_scheme "first" (Llama-2/Mistral conversions) adds "▁" only to the text that
        # opens the whole input, never to text after a control token: text in the middle gets a clone that
        # never adds it.
        pre = orjson.loads(orjson.dumps(spec.get("pre_tokenizer")))  # a copy of the small part that changes
        self._raw_mid = (
            self._build(Tokenizer, {**spec, "pre_tokenizer": pre}) if _without_first_prepend(pre) else None
        )
        self._tok = tok

    @staticmethod
    def _build(cls: Any, spec: dict) -> Any:
        raw = cls.from_str(orjson.dumps(spec).decode())
        raw.encode_special_tokens = True
        return raw

    def encode_texts(self, texts: Sequence[str], at_start: Sequence[bool] | None = None) -> list[list[int]]:
        if not texts:
            return []
        # encode_batch_fast skips offset tracking, which nothing here needs.
        if self._raw_mid is None or at_start is None:
            raw = self._raw if self._raw_mid is None else self._raw_mid
            return [e.ids for e in raw.encode_batch_fast(list(texts), add_special_tokens=False)]
        out: list[list[int]] = [[] for _ in texts]
        for raw, want in ((self._raw, True), (self._raw_mid, False)):
            idx = [i for i, s in enumerate(at_start) if s is want]
            if idx:
                for i, e in zip(
                    idx, raw.encode_batch_fast([texts[i] for i in idx], add_special_tokens=False), strict=True
                ):
                    out[i] = e.ids
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class SlowTextEncoder:
    """Python tokenizers: base tokenization without the added-token split, over a thread pool."""

    is_fast = False

    def __init__(self, tok: Any, workers: int | None = None):
        self.control_ids, self.special_ids, self.lstrip_ids, self.rstrip_ids = _added_tokens(tok)
        self._tok = tok
        self._pool = ThreadPoolExecutor(max_workers=workers or available_cores())
        self._encode_one = self._pick_method(tok)

    def _pick_method(self, tok: Any):
        def via_base(text: str) -> list[int]:
            # `_tokenize` is the model's own tokenization, before any added-token matching.
            return tok.convert_tokens_to_ids(tok._tokenize(text)) if text else []

        def via_no_special(text: str) -> list[int]:
            # Kimi's TikTokenTokenizer: encode(..., allow_special_tokens=False) -> tiktoken
            # disallowed_special=().
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

    def encode_texts(self, texts: Sequence[str], at_start: Sequence[bool] | None = None) -> list[list[int]]:
        if len(texts) < 64:
            return [self._encode_one(t) for t in texts]
        return list(self._pool.map(self._encode_one, texts, chunksize=64))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def make_text_encoder(tok: Any) -> TextEncoder:
    if getattr(tok, "is_fast", False) and hasattr(tok, "backend_tokenizer"):
        return FastTextEncoder(tok)
    return SlowTextEncoder(tok)
