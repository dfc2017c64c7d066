"""Inference: the configured backend (`backend:` and its `backends.<name>` section), all driven by one
engine."""

from __future__ import annotations

from eagle3_assets.config import DOCS_BACKENDS, ProjectConfig
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.protocol import InferenceBackend
from eagle3_assets.core.target_model.chat import ChatTokenizer

from .local import LocalBackend
from .openrouter import OpenRouterBackend
from .sglang import SGLangBackend


class Inference:
    """Builds the backend of one run from the config; the engine's concurrency ceiling and retries come with
    it."""

    def __init__(self, cfg: ProjectConfig):
        self.name = cfg.backend
        self.section = getattr(cfg.backends, cfg.backend)
        self._cfg = cfg

    @property
    def max_concurrency(self) -> int:
        if self.name == "local":
            return 2 * self.section.batch_size  # enough waiting callers to fill every batch
        return self.section.max_concurrency

    def engine_settings(self, max_concurrency: int | None = None) -> EngineSettings:
        """`max_concurrency` from a launch may lower the configured ceiling, never raise it."""
        ceiling = self.max_concurrency
        if max_concurrency is not None and max_concurrency > ceiling:
            raise ValueError(
                f"max_concurrency {max_concurrency} is above the ceiling of backends.{self.name} "
                f"({ceiling}); raise it in the config file (see {DOCS_BACKENDS}) or launch with a lower value"
            )
        return EngineSettings(
            max_concurrency=max_concurrency or ceiling, max_retries=self.section.max_retries
        )

    def create_backend(self, chat: ChatTokenizer) -> InferenceBackend:
        """A fresh backend for one run; it opens its connections in `start()` inside the engine's loop."""
        if self.name == "openrouter":
            return OpenRouterBackend(self.section, chat)
        if self.name == "sglang":
            return SGLangBackend(self.section, chat, self._cfg.target.model)
        return LocalBackend(self.section, self._cfg.target, self._cfg.base_dir, chat)


__all__ = ["Inference", "LocalBackend", "OpenRouterBackend", "SGLangBackend"]
