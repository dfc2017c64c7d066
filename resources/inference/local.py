"""The embedded backend: the target model in this process (SmolLM2 by default), batched generation with
transformers.

The engine calls `complete()` concurrently as it would call a server; a batcher collects waiting requests into
batches of `batch_size` and runs `generate` on a worker thread, so the engine need not know it is local.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_assets.config import LocalConfig, TargetConfig
from eagle3_assets.core.generation.binding import local_model_name, local_served
from eagle3_assets.core.generation.protocol import (
    Completion,
    CompletionRequest,
    ErrorKind,
    InferenceError,
    Sampling,
)
from eagle3_assets.core.target_model.chat import ChatTokenizer
from eagle3_assets.core.target_model.loading import pick_device, resolve, shared_model

_GENERATE_LOCK = threading.Lock()


@dataclass
class GeneratedSequence:
    ids: list[int]
    finished: bool


def generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int],
    pad_id: int,
) -> list[GeneratedSequence]:
    """Left-padded batched generation; each row is cut after its first stop id."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention[i, width - len(p) :] = 1
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "eos_token_id": list(stop_ids),
        "pad_token_id": pad_id,
    }
    if sampling.temperature > 0:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p)
        if sampling.top_k:
            kwargs["top_k"] = sampling.top_k
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    with _GENERATE_LOCK, torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device), **kwargs)
    stops = set(stop_ids)
    results = []
    for row in out[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        if cut is None:
            results.append(GeneratedSequence(row[:max_new_tokens], False))
        else:
            results.append(GeneratedSequence(row[: cut + 1], True))
    return results


class LocalBackend:
    name = "local"
    wants_prompt_ids = True

    def __init__(self, cfg: LocalConfig, target: TargetConfig, base_dir: str, chat: ChatTokenizer):
        self.model_ref = (
            target.model if target.model.startswith("builtin:") else resolve(target.model, base_dir)
        )
        self.device = cfg.device
        self.batch_size = cfg.batch_size
        self.chat = chat
        self.model = local_model_name(target.model)
        self.served = local_served(target.model)
        self.trust_remote_code = target.trust_remote_code
        self.revision = target.revision
        self._queue: asyncio.Queue | None = None
        self._batcher: asyncio.Task | None = None
        self._weights: Any = None

    async def start(self) -> None:
        self._weights = await asyncio.to_thread(
            shared_model,
            resolve(self.model_ref),
            pick_device(self.device),
            self.trust_remote_code,
            self.revision,
        )
        self._queue = asyncio.Queue()
        self._batcher = asyncio.create_task(self._run_batches())

    async def preflight(self) -> list[str]:
        problems = []
        if self.chat.eot_id is None:
            problems.append(f"the tokenizer has no id for the end-of-turn token {self.chat.eot_token!r}")
        try:
            await asyncio.to_thread(resolve, self.model_ref)
        except Exception as e:
            problems.append(f"target.model {self.model_ref!r}: {e}")
        return problems

    async def complete(self, request: CompletionRequest) -> Completion:
        if request.prompt_ids is None:
            raise InferenceError(ErrorKind.BAD_REQUEST, "the embedded backend needs prompt_ids")
        assert self._queue is not None, "start() was not called"
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((request, fut))
        return await fut

    async def _run_batches(self) -> None:
        assert self._queue is not None
        held: list[tuple[CompletionRequest, asyncio.Future]] = []
        while True:
            if not held:
                held.append(await self._queue.get())
            await asyncio.sleep(0.01)  # let concurrent callers join this batch
            while not self._queue.empty():
                held.append(self._queue.get_nowait())
            key = (held[0][0].max_tokens, held[0][0].sampling)
            batch = [h for h in held if (h[0].max_tokens, h[0].sampling) == key][: self.batch_size]
            chosen = {id(h) for h in batch}
            held = [h for h in held if id(h) not in chosen]
            batch = [h for h in batch if not h[1].cancelled()]
            if not batch:
                continue
            await self._generate(batch)

    async def _generate(self, batch: list[tuple[CompletionRequest, asyncio.Future]]) -> None:
        requests = [r for r, _ in batch]
        stop_ids = [self.chat.eot_id] if self.chat.eot_id is not None else []
        eos = self.chat.tok.eos_token_id
        if eos is not None and eos not in stop_ids:
            stop_ids.append(eos)
        pad = self.chat.tok.pad_token_id if self.chat.tok.pad_token_id is not None else stop_ids[0]
        prompts = [r.prompt_ids for r in requests if r.prompt_ids is not None]
        if len(prompts) != len(requests):  # the engine renders them: this backend says wants_prompt_ids
            raise ValueError("the embedded backend was sent a request without prompt_ids")
        try:
            results = await asyncio.to_thread(
                generate_batch,
                self._weights,
                prompts,
                requests[0].max_tokens,
                requests[0].sampling,
                stop_ids,
                pad,
            )
        except Exception as e:  # e.g. out of memory: every request of the batch may retry
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(
                        InferenceError(ErrorKind.SERVER, f"generation failed: {type(e).__name__}: {e}")
                    )
            return
        for (request, fut), seq in zip(batch, results, strict=True):
            if fut.done():
                continue
            text_ids = seq.ids[:-1] if seq.finished else seq.ids
            fut.set_result(
                Completion(
                    content=self.chat.encoder.decode(text_ids),
                    finish_reason="stop" if seq.finished else "length",
                    prompt_tokens=len(request.prompt_ids or []),
                    completion_tokens=len(seq.ids),
                    counted_tokens=len(seq.ids),  # generated here: our own count
                    model=self.model,
                    output_ids=seq.ids,
                )
            )

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
