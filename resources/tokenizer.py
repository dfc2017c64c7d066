"""The target model's tokenizer and chat template (`target:` in eagle3.yaml), loaded once per process."""

from __future__ import annotations

import json
from functools import lru_cache

from eagle3_assets.config import ProjectConfig, TargetConfig
from eagle3_assets.core.chat_tokens import ChatTokenizer
from eagle3_assets.core.target import load_tokenizer, pin_problems, resolve


class Target:
    """Renders and tokenizes conversations exactly as the target model sees them."""

    def __init__(self, cfg: ProjectConfig):
        self.cfg: TargetConfig = cfg.target
        self.base_dir = cfg.base_dir

    def chat_tokenizer(self) -> ChatTokenizer:
        t = self.cfg
        return _chat_tokenizer(
            resolve(t.tokenizer, self.base_dir),
            t.trust_remote_code,
            t.revision,
            json.dumps(t.chat_template_kwargs, sort_keys=True),
            t.end_of_turn_token,
            t.think_open,
            t.think_close,
        )

    def problems(self) -> list[str]:
        """Preflight: code and weights pinned, the tokenizer loads, and its end-of-turn token is what the
        template really writes."""
        pins = pin_problems(self.cfg, self.base_dir)
        if pins:
            return pins
        try:
            return self.chat_tokenizer().special_token_problems(self.cfg.end_of_turn_id)
        except Exception as e:
            return [f"target.tokenizer {self.cfg.tokenizer!r} cannot be used: {e}"]


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
