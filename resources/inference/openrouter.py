"""OpenRouter (and any OpenAI-compatible chat-completions endpoint: vLLM, SGLang's OpenAI API, `transformers
serve`).

Built from `backends.openrouter` of eagle3.yaml. The API key is read from the environment variable the config
names, at run time, and lives only in the session's headers: it never reaches run config, logs, metadata or
files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from eagle3_assets.config import OpenRouterConfig
from eagle3_assets.core.generation.protocol import (
    Completion,
    CompletionRequest,
    ErrorKind,
    InferenceError,
    describe,
)
from eagle3_assets.core.target.chat import ChatTokenizer

from .http import HttpSession, classify, dumps, get_json, make_session, post_json, secret_forms
from .streaming import StreamClient

TokenCounter = Callable[[str], int]


def _usage_tokens(
    usage: dict, content: str, reasoning: str | None, count: TokenCounter | None
) -> tuple[int, bool]:
    """completion_tokens from usage; without usage, counted with the target tokenizer (never 0 for a real
    answer)."""
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(value, int | float) and (value > 0 or not (content or reasoning)):
        return int(value), False
    text = (reasoning or "") + content
    if not text:
        return 0, False
    return (count(text) if count is not None else max(1, len(text) // 4)), True


def _completion(
    *,
    content: str,
    reasoning: str | None,
    finish: Any,
    native_finish: Any,
    usage: dict,
    body_model: Any,
    fallback_model: str,
    provider: Any,
    request_id: Any,
    output_ids: list[int] | None,
    count: TokenCounter | None,
) -> Completion:
    if finish == "error":
        raise InferenceError(ErrorKind.SERVER, "the provider ended the answer with an error", status=200)
    usage = usage if isinstance(usage, dict) else {}
    completion_tokens, estimated = _usage_tokens(usage, content, reasoning, count)
    if not content and not reasoning and completion_tokens == 0:
        # OpenRouter does not bill these (zero-completion insurance); a retry usually gets a real answer.
        raise InferenceError(ErrorKind.SERVER, f"empty completion (finish_reason={finish!r})", status=200)
    details = usage.get("completion_tokens_details") or {}
    prompt_details = usage.get("prompt_tokens_details") or {}
    cost = usage.get("cost")
    return Completion(
        content=content,
        reasoning=reasoning if reasoning else None,
        finish_reason=str(finish or "unknown"),
        native_finish_reason=native_finish,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=completion_tokens,
        reasoning_tokens=details.get("reasoning_tokens") if isinstance(details, dict) else None,
        cached_tokens=prompt_details.get("cached_tokens") if isinstance(prompt_details, dict) else None,
        cost_usd=float(cost) if isinstance(cost, int | float) else None,
        model=str(body_model or fallback_model),
        provider=str(provider) if provider else None,
        request_id=request_id,
        output_ids=output_ids,
        usage_estimated=estimated,
    )


def parse_chat_completion(body: dict, fallback_model: str, count: TokenCounter | None = None) -> Completion:
    """An OpenAI-style chat completion body as a Completion, or a classified error."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise InferenceError(ErrorKind.MALFORMED, f"no choices in the response: {describe(body)}", status=200)
    choice = choices[0]
    if isinstance(choice.get("error"), dict):
        raise classify(200, {"error": choice["error"]})
    message = choice.get("message") or {}
    return _completion(
        content=message.get("content") or "",
        reasoning=message.get("reasoning") or message.get("reasoning_content"),
        finish=choice.get("finish_reason"),
        native_finish=choice.get("native_finish_reason"),
        usage=body.get("usage") or {},
        body_model=body.get("model"),
        fallback_model=fallback_model,
        provider=body.get("provider"),
        request_id=body.get("id"),
        output_ids=_token_ids(choice.get("token_ids")),
        count=count,
    )


def _token_ids(ids: Any) -> list[int] | None:
    """vLLM (`return_token_ids`) and recent SGLang return the generated ids beside the text."""
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ids
    return None


class StreamedAnswer:
    """Folds the chunks of a streamed chat completion into one answer, counting tokens as they arrive."""

    __slots__ = (
        "content",
        "finish",
        "ids",
        "model",
        "native_finish",
        "provider",
        "reasoning",
        "request",
        "request_id",
        "usage",
    )

    def __init__(self, request: CompletionRequest):
        self.request = request
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.ids: list[int] | None = None
        self.finish: Any = None
        self.native_finish: Any = None
        self.usage: dict = {}
        self.model: Any = None
        self.provider: Any = None
        self.request_id: Any = None

    def __call__(self, events: list[dict], headers: Any) -> None:
        # Called with each batch of a stream's events (tens of thousands of events a second over all streams):
        # the common case (a delta of content) first, with as few lookups as it takes; the rare fields after.
        content, tokens = self.content, 0
        try:
            for event in events:
                choices = event.get("choices")
                if choices:
                    choice = choices[0]
                    delta = choice.get("delta")
                    if delta:
                        text = delta.get("content")
                        if text:
                            content.append(text)
                            tokens += 1  # ≥ one token per non-empty chunk: a floor for the budget
                        if len(delta) > 1 or not text:
                            thought = delta.get("reasoning") or delta.get("reasoning_content")
                            if thought:
                                self.reasoning.append(thought)
                                if not text:
                                    tokens += 1
                    if len(choice) > 2 and (choice.get("finish_reason") or "token_ids" in choice):
                        self._finish(choice)  # (most events carry `"finish_reason": null`)
                if self.request_id is None:
                    self.request_id, self.model, self.provider = (
                        event.get("id"),
                        event.get("model"),
                        event.get("provider"),
                    )
                if event.get("error"):  # an error after the stream started (429, 5xx, timeouts)
                    raise classify(200, event, headers)
                usage = event.get("usage")
                if isinstance(usage, dict):
                    self.usage = usage
        finally:
            self.request.streamed_tokens += tokens  # the budget sees what arrived, even up to an error

    def _finish(self, choice: dict) -> None:
        ids = choice.get("token_ids")
        if isinstance(ids, list):  # vLLM streams each event's ids: extended in place, not copied per event
            if self.ids is None:
                self.ids = []
            self.ids.extend(ids)
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.native_finish = choice.get("native_finish_reason")

    def completion(self, fallback_model: str, count: TokenCounter | None) -> Completion:
        if self.finish is None:
            raise InferenceError(
                ErrorKind.CONNECTION, "the stream ended before the answer finished", status=200
            )
        return _completion(
            content="".join(self.content),
            reasoning="".join(self.reasoning) or None,
            finish=self.finish,
            native_finish=self.native_finish,
            usage=self.usage,
            body_model=self.model,
            fallback_model=fallback_model,
            provider=self.provider,
            request_id=self.request_id,
            output_ids=_token_ids(self.ids),
            count=count,
        )


def _wire(message: dict[str, Any]) -> dict[str, Any]:
    """An earlier answer's reasoning under both names servers read: `reasoning` (OpenRouter) and
    `reasoning_content` (what Kimi's and Qwen3's templates render, as vLLM and SGLang pass it)."""
    if message.get("reasoning") and "reasoning_content" not in message:
        return {**message, "reasoning_content": message["reasoning"]}
    return message


class OpenRouterBackend:
    name = "openrouter"
    wants_prompt_ids = False

    def __init__(self, cfg: OpenRouterConfig, chat: ChatTokenizer | None = None):
        self.cfg = cfg
        self.model = cfg.model
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        # Answers that come without usage are counted with the target tokenizer, never as 0 (looked up at the
        # first such answer: a deferred tokenizer is loaded only then).
        self.count_tokens: TokenCounter | None = (
            (lambda text: chat.count_tokens(text)) if chat is not None else None
        )
        self._session: HttpSession | None = None
        self._streams: StreamClient | None = None  # streamed answers (streaming.py says why not aiohttp)
        self._secrets: tuple[bytes, ...] = ()

    def _headers(self) -> dict[str, str]:
        headers = {
            "HTTP-Referer": self.cfg.app_url,
            "X-OpenRouter-Title": self.cfg.app_title,
            "X-Title": self.cfg.app_title,
        }
        key = os.environ.get(self.cfg.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _payload(self, request: CompletionRequest) -> dict[str, Any]:
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.cfg.model,
            "messages": [_wire(m) for m in request.messages],
            "max_tokens": request.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if s.top_k is not None:
            body["top_k"] = s.top_k
        if s.seed is not None:
            body["seed"] = s.seed
        if self.cfg.provider:
            body["provider"] = self.cfg.provider
        if self.cfg.reasoning is not None:
            body["reasoning"] = self.cfg.reasoning
        if self.cfg.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        body.update(self.cfg.extra_body)
        return body

    async def start(self) -> None:
        if self._session is None:
            self._secrets = secret_forms(os.environ.get(self.cfg.api_key_env))
            self._session = make_session(self.cfg.request_timeout_s, self._headers())
        if self.cfg.stream and self._streams is None:
            # Streams may run for many minutes (reasoning); what must not happen is a silent connection.
            self._streams = StreamClient(
                self.url,
                self._headers(),
                idle_timeout_s=self.cfg.stream_idle_timeout_s,
                total_timeout_s=self.cfg.request_timeout_s,
                secrets=self._secrets,
                proxies=self._session.proxies,  # the route the session's requests take
            )

    async def preflight(self) -> list[str]:
        """Key present, endpoint reachable, key accepted, model listed: each failure a one-line fix."""
        problems: list[str] = []
        base = self.cfg.base_url.rstrip("/")
        is_openrouter = (urlparse(base).hostname or "").endswith("openrouter.ai")
        if is_openrouter and not os.environ.get(self.cfg.api_key_env):
            return [
                f"the API key is missing: export {self.cfg.api_key_env}=<your key> "
                "(the config's backends.openrouter.api_key_env names the variable)"
            ]
        async with make_session(30, self._headers()) as session:
            try:
                status, body = await get_json(session, f"{base}/models")
            except Exception as e:
                return [
                    f"cannot reach {base}/models ({type(e).__name__}: {e}); check "
                    "backends.openrouter.base_url and the network"
                ]
            if status == 401:
                return [f"{base} rejected the API key in {self.cfg.api_key_env} (HTTP 401); set a valid key"]
            if status == 200 and isinstance(body, dict) and isinstance(body.get("data"), list):
                listed = {m.get("id") for m in body["data"] if isinstance(m, dict)}
                if listed and self.cfg.model not in listed:
                    close = sorted(m for m in listed if m and self.cfg.model.split("/")[-1][:6] in m)[:5]
                    problems.append(
                        f"model {self.cfg.model!r} is not listed by {base}/models; fix "
                        f"backends.openrouter.model" + (f" (similar: {', '.join(close)})" if close else "")
                    )
            elif status != 200:
                problems.append(f"{base}/models answered HTTP {status}; check backends.openrouter.base_url")
            if is_openrouter and not problems:
                status, body = await get_json(session, f"{base}/key")
                if status == 401:
                    problems.append(f"OpenRouter rejected the key in {self.cfg.api_key_env}; set a valid key")
                elif status == 200 and isinstance(body, dict):
                    data = body.get("data") or {}
                    remaining = data.get("limit_remaining")
                    if isinstance(remaining, int | float) and remaining <= 0:
                        problems.append(
                            "the OpenRouter key has no credit left (limit_remaining is 0); raise its "
                            "limit or add credits"
                        )
        return problems

    async def complete(self, request: CompletionRequest) -> Completion:
        assert self._session is not None, "start() was not called"
        if not self.cfg.stream:
            body = await post_json(self._session, self.url, self._payload(request), self._secrets)
            return parse_chat_completion(body, self.cfg.model, self.count_tokens)
        assert self._streams is not None
        answer = StreamedAnswer(request)
        await self._streams.post(dumps(self._payload(request)), answer)
        return answer.completion(self.cfg.model, self.count_tokens)

    async def close(self) -> None:
        if self._streams is not None:
            await self._streams.close()
            self._streams = None
        if self._session is not None:
            await self._session.close()
            self._session = None
