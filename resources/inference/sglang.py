"""A local SGLang server through its native `/generate` API.

The prompt goes as `input_ids` rendered by the target's chat template here (the same function the tokens stage
uses), so prompt tokens are exact, and the server's `output_ids` come back as ground truth for the tokens
stage. SGLang's `max_new_tokens` defaults to 128, so it is always sent.
"""

from __future__ import annotations

from typing import Any

from eagle3_assets.config import SGLangConfig
from eagle3_assets.core.generation.binding import sglang_served
from eagle3_assets.core.generation.protocol import (
    Completion,
    CompletionRequest,
    ErrorKind,
    InferenceError,
    describe,
)
from eagle3_assets.core.target_model.chat import ChatTokenizer

from .http import CONTEXT_MARKERS, HttpSession, get_json, make_session, post_json


def split_reasoning(
    text: str, started_in_thinking: bool, think_open: str, think_close: str
) -> tuple[str, str | None]:
    """(content, reasoning) of raw generated text in the `<think>…</think>` form."""
    if started_in_thinking:
        head, sep, tail = text.partition(think_close)
        return (tail, head) if sep else ("", text)
    if text.startswith(think_open):
        head, sep, tail = text[len(think_open) :].partition(think_close)
        return (tail, head) if sep else ("", head)  # cut off while still thinking: all of it is reasoning
    return text, None


class SGLangBackend:
    name = "sglang"
    wants_prompt_ids = True

    def __init__(self, cfg: SGLangConfig, chat: ChatTokenizer, target_model: str):
        self.cfg = cfg
        self.chat = chat
        self.base = cfg.base_url.rstrip("/")
        self.model = "sglang"
        self.served = sglang_served(cfg, target_model)
        self._session: HttpSession | None = None
        self._think_open_id = chat.encoder.control_ids.get(chat.think_open)

    async def start(self) -> None:
        if self._session is None:
            self._session = make_session(self.cfg.request_timeout_s)

    async def preflight(self) -> list[str]:
        async with make_session(30) as session:
            try:
                status, _ = await get_json(session, f"{self.base}/health")
            except Exception as e:
                return [
                    f"cannot reach SGLang at {self.base} ({type(e).__name__}: {e}); start the server "
                    "(python -m sglang.launch_server --model-path …) or fix backends.sglang.base_url"
                ]
            if status != 200:
                return [f"SGLang at {self.base}/health answered HTTP {status}; the server is not ready yet"]
            status, info = await get_json(session, f"{self.base}/model_info")
            if status != 200 or not isinstance(info, dict):
                return [f"SGLang at {self.base}/model_info answered HTTP {status}; is this an SGLang server?"]
            self.model = str(info.get("model_path") or "sglang")
        if not self.served.accepts(self.model):
            return [
                f"SGLang at {self.base} serves {self.model!r}, not the target ({self.served.describe()}): "
                "serve target.model, or list the path in backends.sglang.accepted_models if it is the "
                "target's checkpoint"
            ]
        return []

    def _payload(self, request: CompletionRequest) -> dict[str, Any]:
        s = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": request.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "skip_special_tokens": False,
        }
        if s.top_k is not None:
            params["top_k"] = s.top_k
        if s.seed is not None:
            params["sampling_seed"] = s.seed
        if self.chat.eot_id is not None:
            params["stop_token_ids"] = [self.chat.eot_id]
        params.update(self.cfg.extra_sampling_params)
        return {"input_ids": request.prompt_ids, "sampling_params": params}

    async def complete(self, request: CompletionRequest) -> Completion:
        if request.prompt_ids is None:
            raise InferenceError(ErrorKind.BAD_REQUEST, "SGLang needs prompt_ids")
        assert self._session is not None, "start() was not called"
        body = await post_json(self._session, f"{self.base}/generate", self._payload(request))
        meta = body.get("meta_info")
        ids = body.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(ids, list):
            raise InferenceError(
                ErrorKind.MALFORMED, f"no output_ids/meta_info in {describe(body)}", status=200
            )
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind == "abort":
            message = str(finish.get("message") or describe(finish))
            if any(m in message.lower() for m in CONTEXT_MARKERS):
                raise InferenceError(ErrorKind.CONTEXT_LENGTH, message, status=200)
            raise InferenceError(ErrorKind.SERVER, f"request aborted: {message}", status=200)
        ids = [int(i) for i in ids]
        cut = len(ids) > request.max_tokens  # a server that ignores max_new_tokens: kept up to the limit
        if cut:
            ids, kind = ids[: request.max_tokens], "length"
        # The text is decoded from ids here, where special tokens are known (the server may drop or keep
        # them).
        text_ids = ids[:-1] if kind == "stop" and ids and ids[-1] == self.chat.eot_id else ids
        text = self.chat.encoder.decode(text_ids)
        started_thinking = bool(request.prompt_ids) and request.prompt_ids[-1] == self._think_open_id
        content, reasoning = split_reasoning(
            text, started_thinking, self.chat.think_open, self.chat.think_close
        )
        return Completion(
            content=content,
            reasoning=reasoning,
            finish_reason="stop"
            if kind == "stop"
            else "length"
            if kind == "length"
            else str(kind or "unknown"),
            native_finish_reason=describe(finish, 200) if finish else None,
            prompt_tokens=int(meta.get("prompt_tokens") or len(request.prompt_ids)),
            completion_tokens=int(meta.get("completion_tokens") or len(ids)),
            counted_tokens=len(ids),
            cut_at_max_tokens=cut,
            cached_tokens=meta.get("cached_tokens"),
            model=self.model,
            request_id=str(meta.get("id")) if meta.get("id") is not None else None,
            output_ids=ids,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
