"""The target's tokenizer and chat template, loaded once per process."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import dagster as dg

from eagle3_assets.core.chat_tokens import ChatTokenizer
from eagle3_assets.core.target import load_tokenizer, resolve


class TargetTokenizerResource(dg.ConfigurableResource):
    """Renders and tokenizes conversations exactly as the target model sees them."""

    tokenizer: str = "builtin:smollm2"
    trust_remote_code: bool = False
    revision: str | None = None
    chat_template_kwargs: dict[str, Any] = {}
    end_of_turn_token: str | None = None
    end_of_turn_id: int | None = None
    think_open: str = "<think>"
    think_close: str = "</think>"
    base_dir: str = "."

    def chat_tokenizer(self) -> ChatTokenizer:
        return _chat_tokenizer(
            resolve(self.tokenizer, self.base_dir),
            self.trust_remote_code,
            self.revision,
            json.dumps(self.chat_template_kwargs, sort_keys=True),
            self.end_of_turn_token,
            self.think_open,
            self.think_close,
        )

    def problems(self) -> list[str]:
        """Preflight: the tokenizer loads and its end-of-turn token is what the template really writes."""
        try:
            return self.chat_tokenizer().special_token_problems(self.end_of_turn_id)
        except Exception as e:
            return [f"target.tokenizer {self.tokenizer!r} cannot be used: {e}"]


@lru_cache(maxsize=4)
def _chat_tokenizer(
    ref: str,
    trust: bool,
    revision: str | None,
    kwargs_json: str,
    eot: str | None,
    think_open: str,
    think_close: str,
) -> ChatTokenizer:
    tok = load_tokenizer(ref, trust, revision)
    return ChatTokenizer(tok, json.loads(kwargs_json), eot, think_open, think_close)
