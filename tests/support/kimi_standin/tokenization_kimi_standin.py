"""Slow tiktoken-backed tokenizer in the shape of Moonshot's Kimi K2/K2.5 ``tokenization_kimi.py``.

This file is copied verbatim into a tokenizer folder and loaded by ``AutoTokenizer`` through
``auto_map`` with ``trust_remote_code=True``; it must therefore only import third-party packages.
It reproduces the quirks that matter to callers of the real tokenizer: a pure-Python
``PreTrainedTokenizer`` (``is_fast`` is False, no tokenizer.json), an ``encode`` that takes
``allow_special_tokens``, 256 reserved special ids right after the base vocabulary, and token
strings in GPT-2 byte-level form.
"""

from __future__ import annotations

import binascii
import os
import shutil
from pathlib import Path
from typing import Any

import tiktoken
from transformers import PreTrainedTokenizer

_CJK = "一-龥぀-ゟ゠-ヿ"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable character map, so every byte sequence has a string form."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_mergeable_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """Parse a ``tiktoken.model`` file (``base64(bytes) rank`` per line).

    Done by hand rather than with ``tiktoken.load.load_tiktoken_bpe``, which keys a cache in the
    system temp dir on the path string and may return a stale copy for a reused path.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                token, rank = line.split()
                ranks[binascii.a2b_base64(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    """Kimi-shaped tokenizer: tiktoken BPE plus 256 reserved special ids after the base vocabulary."""

    vocab_files_names = {"vocab_file": "tiktoken.model"}  # noqa: RUF012 - mirrors the HF class attribute
    model_input_names = ["input_ids", "attention_mask"]  # noqa: RUF012
    num_reserved_special_tokens = 256
    pat_str = "|".join(
        [
            r"\p{N}{1,3}",
            "[" + _CJK + "]+",
            r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+""",
            r"[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}&&[^" + _CJK + r"]]+",
            r" ?[\p{P}\p{S}]+[\r\n]*",
            r"\s*[\r\n]+",
            r"\s+(?![^\s\p{N}" + _CJK + "])",
            r"\s+",
            # HF's Split keeps unmatched spans (format/control/private-use characters such as a ZWJ)
            # as their own pieces, while tiktoken would silently drop them; match them explicitly.
            r"[^\s\p{L}\p{M}\p{N}\p{P}\p{S}]+(?![\p{L}\p{M}&&[^" + _CJK + "]])",
        ]
    )

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        added_tokens_decoder: dict[int, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_file = vocab_file
        ranks = read_mergeable_ranks(vocab_file)
        # max+1 rather than len(): the source vocabulary may have holes (ids it used for its own specials).
        self.num_base_tokens = max(ranks.values()) + 1
        names = {int(i): str(token) for i, token in (added_tokens_decoder or {}).items()}
        first, stop = self.num_base_tokens, self.num_base_tokens + self.num_reserved_special_tokens
        self.special_tokens: dict[str, int] = {
            names.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, stop)
        }
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=self.pat_str,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        # latin-1 maps byte b to chr(b), so one translate() gives the byte-level string of a token.
        table = {byte: char for byte, char in self.byte_encoder.items()}
        self.decoder: dict[int, str] = {
            rank: tok.decode("latin-1").translate(table) for tok, rank in ranks.items()
        }
        self.decoder.update({i: name for name, i in self.special_tokens.items()})
        self.encoder: dict[str, int] = {token: i for i, token in self.decoder.items()}
        self._unk_id = self.encoder.get(str(unk_token))
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=added_tokens_decoder or {},
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Like Kimi: plain tiktoken encoding, unless HF keyword arguments ask for the generic path."""
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Goes through encode() with specials allowed, as the real tokenizer does.
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int | None:
        return self.encoder.get(token, self._unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, str(self.unk_token))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for token in tokens:
            if token in self.special_tokens:
                out += token.encode("utf-8")
            else:
                out += bytes(self.byte_decoder[char] for char in token)
        return out.decode("utf-8", errors="replace")

    def decode(self, token_ids: Any, **kwargs: Any) -> str:
        """Raw tiktoken decode without options (keeps special tokens); HF decode with them."""
        if kwargs:
            return super().decode(token_ids, **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self.model.decode(ids)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        if not os.path.isdir(save_directory):
            raise NotADirectoryError(save_directory)
        prefix = f"{filename_prefix}-" if filename_prefix else ""
        target = os.path.join(save_directory, prefix + self.vocab_files_names["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
