"""The base class of every inference resource: configuration in, a protocol backend out."""

from __future__ import annotations

import dagster as dg

from eagle3_assets.core.chat_tokens import ChatTokenizer
from eagle3_assets.core.protocol import InferenceBackend


class InferenceResource(dg.ConfigurableResource):
    """An asset parameter annotated with this base accepts any backend (local, OpenRouter, SGLang)."""

    max_concurrency: int = 64
    max_retries: int = 8

    @property
    def backend_name(self) -> str:
        raise NotImplementedError

    def create_backend(self, chat_tokenizer: ChatTokenizer) -> InferenceBackend:
        """A fresh backend for one run; it opens its connections in `start()` inside the engine's loop."""
        raise NotImplementedError
