"""The target model's tokenizer and chat template (`target:` in eagle3.yaml), loaded once per process."""

from __future__ import annotations

import json
from contextlib import suppress

from eagle3_assets.config import ProjectConfig, TargetConfig
from eagle3_assets.core.prompts.context import ChatCounter, ContextGuard
from eagle3_assets.core.storage.files import write_json
from eagle3_assets.core.target_model.chat import ChatRecipe, ChatTokenizer, DeferredChat, chat_tokenizer
from eagle3_assets.core.target_model.context import ContextLimit, context_limit
from eagle3_assets.core.target_model.loading import pin_problems, resolve
from eagle3_assets.core.target_model.preflight import exactness, passed_record, special_token_problems


class Target:
    """Renders and tokenizes conversations exactly as the target model sees them."""

    def __init__(self, cfg: ProjectConfig):
        self.cfg: TargetConfig = cfg.target
        self.base_dir = cfg.base_dir

    def chat_tokenizer(self) -> ChatTokenizer:
        return chat_tokenizer(self._recipe())

    def deferred_chat_tokenizer(self) -> ChatTokenizer:
        """The same tokenizer, loaded only when something uses it (DeferredChat says when that is never)."""
        return DeferredChat(self._recipe())  # type: ignore[return-value]  # a lazy stand-in with its interface

    def context_limit(self) -> ContextLimit:
        """The most tokens a request may hold (`target.context_length`, else the model's config.json)."""
        return context_limit(self.cfg, self.base_dir)

    def context_guard(self) -> ContextGuard:
        """What the prompts stage screens prompts with: the context, and the tokenizer only if a prompt is
        too large for its byte size to show that it fits (most datasets never load it there)."""
        limit = self.context_limit()
        return ContextGuard(limit.tokens, lambda: ChatCounter(self.chat_tokenizer()), limit.source)

    def _recipe(self) -> ChatRecipe:
        t = self.cfg
        return ChatRecipe(
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
        record = passed_record(self._recipe(), self.cfg.end_of_turn_id)
        if record is not None and record.exists():
            return []  # these files, template settings and rules passed before: no tokenizer load needed
        try:
            chat = self.chat_tokenizer()
            problems = special_token_problems(chat, self.cfg.end_of_turn_id) or exactness(chat)[0]
        except Exception as e:
            return [f"target.tokenizer {self.cfg.tokenizer!r} cannot be used: {e}"]
        if not problems and record is not None:
            with suppress(OSError):  # a read-only cache: preflight then loads the tokenizer every time
                write_json({"tokenizer": self.cfg.tokenizer}, record)
        return problems

    def warnings(self) -> list[str]:
        """What preflight reports without stopping: rows or options this family cannot rebuild exactly."""
        try:
            return exactness(self.chat_tokenizer())[1]
        except Exception:
            return []
