"""How many tokens the target holds (its context), and the most bytes of text one of its tokens can cover.

The prompts stage uses both to refuse prompts that cannot fit before any is sent, without tokenizing text
that obviously fits (a token covers at least one byte) or text that obviously cannot (no token covers more
than the vocabulary's longest).

Where the context comes from: `target.context_length` when set (the serving engine's limit where it is lower
than the model's, e.g. vLLM's `--max-model-len`), else `max_position_embeddings` in the config.json of
`target.model` (then of `target.tokenizer`): the embedded SmolLM2's converted folder, a local folder, or a
hub repository's config.json (one small file, fetched or taken from the Hugging Face cache as the tokenizer's
files are, at `target.revision`). Multimodal checkpoints (Kimi-K2.5) keep it in `text_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import DOCS_CONFIG, TargetConfig
from .loading import TargetError, resolve

# Names configs give the number of positions, in the order they are trusted; language-model sub-configs first.
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")


@dataclass(frozen=True)
class ContextLimit:
    tokens: int
    source: str  # where the figure came from, for messages and metadata


def context_limit(target: TargetConfig, base_dir: str | Path | None = None) -> ContextLimit:
    """The target's context in tokens, or TargetError naming what was tried and the key that fixes it."""
    if target.context_length is not None:
        return ContextLimit(target.context_length, "target.context_length")
    tried: list[str] = []
    for ref in dict.fromkeys([target.model, target.tokenizer]):
        try:
            config = json.loads(config_json(ref, target.revision, base_dir).read_text(encoding="utf-8"))
        except Exception as e:  # a folder without config.json, the hub out of reach, a file that is not JSON
            tried.append(f"{ref}: {type(e).__name__}: {e}")
            continue
        found = context_in_config(config)
        if found is not None:
            return ContextLimit(found[1], f"{found[0]} in the config.json of {ref}")
        tried.append(f"{ref}: its config.json names none of {', '.join(CONTEXT_FIELDS)}")
    raise TargetError(
        "cannot tell the target's context length (" + "; ".join(tried) + "): set target.context_length to "
        f"the most tokens a request may hold (see {DOCS_CONFIG})"
    )


def config_json(ref: str, revision: str | None, base_dir: str | Path | None) -> Path:
    """The config.json of a model reference: in its folder (the embedded model's converted copy, a local
    folder), else the hub repository's, from the cache or fetched (a few KB)."""
    local = Path(resolve(ref, base_dir))
    if local.is_dir():
        path = local / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {local}")
        return path
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(ref, "config.json", revision=revision))


def context_in_config(config: dict[str, Any]) -> tuple[str, int] | None:
    """(field, positions) from a model's config.json: a language-model sub-config's own figure first (a
    multimodal wrapper may state another), then the top level."""
    for sub in (*(config.get(k) for k in NESTED_CONFIGS), config):
        if not isinstance(sub, dict):
            continue
        for name in CONTEXT_FIELDS:
            value = sub.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return name, value
    return None


def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE vocabularies (GPT-2, Llama-3, Qwen, SmolLM2, Kimi's tiktoken) write
    bytes as: one character per byte."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}  # '!'..'~', '¡'..'¬', '®'..'ÿ'

    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return frozenset(chars)


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def longest_token_bytes(tokenizer: Any) -> int:
    """At least as many bytes of text as any one token of the vocabulary covers (added tokens apart: text is
    encoded without matching them). For a byte-level vocabulary a token's length in characters is its length
    in bytes; otherwise its UTF-8 length overstates it (SentencePiece's "▁" is 3 bytes for one space, a byte
    token "<0x0A>" 6 for one), which keeps a lower bound on token counts sound."""
    added = set(getattr(tokenizer, "added_tokens_encoder", None) or {})
    vocab = [t for t in tokenizer.get_vocab() if t not in added]
    if not vocab:
        raise TargetError("the tokenizer's vocabulary is empty")
    if all(isinstance(t, bytes) for t in vocab):
        return max(len(t) for t in vocab)
    texts = [t if isinstance(t, str) else str(t) for t in vocab]
    if set().union(*map(set, texts)) <= BYTE_LEVEL_ALPHABET:
        return max(len(t) for t in texts)
    return max(len(t.encode("utf-8", "surrogatepass")) for t in texts)
