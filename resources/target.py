"""The target model's tokenizer and chat template (`target:` in eagle3.yaml), loaded once per process."""

from __future__ import annotations

import json

from eagle3_assets.config import ProjectConfig, TargetConfig
from eagle3_assets.core.target.chat import ChatRecipe, ChatTokenizer, chat_tokenizer
from eagle3_assets.core.target.loading import pin_problems, resolve
from eagle3_assets.core.target.preflight import exactness, special_token_problems


class Target:
    """Renders and tokenizes conversations exactly as the target model sees them."""

    def __init__(self, cfg: ProjectConfig):
        self.cfg: TargetConfig = cfg.target
        self.base_dir = cfg.base_dir

    def chat_tokenizer(self) -> ChatTokenizer:
        t = self.cfg
        return chat_tokenizer(
            ChatRecipe(
                resolve(t.tokenizer, self.base_dir),
                t.trust_remote_code,
                t.revision,
                json.dumps(t.chat_template_kwargs, sort_keys=True),
                t.end_of_turn_token,
                t.think_open,
                t.think_close,
            )
        )

    def problems(self) -> list[str]:
        """Preflight: code and weights pinned, the tokenizer loads, and its end-of-turn token is what the
        template really writes."""
        pins = pin_problems(self.cfg, self.base_dir)
        if pins:
            return pins
        try:
            chat = self.chat_tokenizer()
            problems = special_token_problems(chat, self.cfg.end_of_turn_id)
            return problems or exactness(chat)[0]
        except Exception as e:
            return [f"target.tokenizer {self.cfg.tokenizer!r} cannot be used: {e}"]

    def warnings(self) -> list[str]:
        """What preflight reports without stopping: rows or options this family cannot rebuild exactly."""
        try:
            return exactness(self.chat_tokenizer())[1]
        except Exception:
            return []
