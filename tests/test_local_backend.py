"""The embedded model really loads and generates, batched, behind the inference protocol."""

from __future__ import annotations

import asyncio

from eagle3_assets.config import LocalConfig, TargetConfig
from eagle3_assets.core.generation.protocol import CompletionRequest, InferenceBackend
from resources.inference.local import LocalBackend


def test_embedded_model_generates_through_the_protocol(chat):
    backend = LocalBackend(LocalConfig(batch_size=4), TargetConfig(), ".", chat)
    assert isinstance(backend, InferenceBackend)
    prompts = [[{"role": "user", "content": q}] for q in ("What is 2+2?", "Say hello.", "Name a fruit.")]
    ids = chat.prompt_ids(prompts)

    async def run():
        await backend.start()
        try:
            reqs = [
                CompletionRequest(f"r{i}", p, 24, prompt_ids=x)
                for i, (p, x) in enumerate(zip(prompts, ids, strict=True))
            ]
            return await asyncio.gather(*(backend.complete(r) for r in reqs))
        finally:
            await backend.close()

    completions = asyncio.run(run())
    for c in completions:
        assert c.output_ids and c.completion_tokens == len(c.output_ids) <= 24
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.output_ids[-1] == chat.eot_id
        assert c.content.strip()
        assert (
            chat.encoder.decode(c.output_ids[: len(c.output_ids) - (c.finish_reason == "stop")]) == c.content
        )
    assert completions[0].model == "SmolLM2-135M-Instruct"
