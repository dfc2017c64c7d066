"""A guard for the steps past generation, which must run on a target that never fits in one process."""

from __future__ import annotations

import pytest


class FullTargetGuard:
    """Refuses to load the whole target in this process and records the depth of every decoder forward:
    what the steps past generation may run of a target that never fits (pieces of the checkpoint, never the
    whole)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        import transformers
        from transformers.models.llama import modeling_llama

        from eagle3_assets.core.target_model import loading

        self.depths: list[int] = []
        forward = modeling_llama.LlamaModel.forward

        def counted(model, *args, **kwargs):
            self.depths.append(len(model.layers))
            return forward(model, *args, **kwargs)

        def refuse(*args, **kwargs):
            raise AssertionError(f"the whole target was loaded in the step's process: {args[:1]}")

        loading.shared_model.cache_clear()  # a copy loaded earlier (by generation) is not reused either
        monkeypatch.setattr(modeling_llama.LlamaModel, "forward", counted)
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
        monkeypatch.setattr(loading, "load_model", refuse)
        monkeypatch.setattr(loading, "shared_model", refuse)
