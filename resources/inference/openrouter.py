"""OpenRouter (and any OpenAI-compatible chat-completions endpoint: vLLM, SGLang's OpenAI API, `transformers
serve`).

Built from `backends.openrouter` of eagle3.yaml. The API key is read from the environment variable the config
names, at run time, and lives only in the session's headers: it never reaches run config, logs, metadata or
files.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from eagle3_assets.config import OpenRouterConfig
from eagle3_assets.core.generation.binding import openrouter_served
from eagle3_assets.core.generation.protocol import (
    Completion,
    CompletionRequest,
    ErrorKind,
    InferenceError,
    describe,
)
from eagle3_assets.core.target_model.chat import ChatTokenizer
from eagle3_assets.core.target_model.tool_calls import ToolCall, wire_message

from .http import HttpSession, classify, dumps, get_json, make_session, post_json, secret_forms
from .streaming import StreamClient

TokenCounter = Callable[[str], int]


def _usage_tokens(usage: dict, content: str, reasoning: str | None) -> tuple[int, bool]:
    """completion_tokens from usage, and whether the server sent none for a real answer (the backend's own
    count stands in: `OpenRouterBackend._own_count`)."""
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(value, int | float) and (value > 0 or not (content or reasoning)):
        return int(value), False
    return 0, bool(content or reasoning)


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
    quantization: Any = None,
    tool_calls: list[ToolCall] | None = None,
) -> Completion:
    if finish == "error":
        raise InferenceError(ErrorKind.SERVER, "the provider ended the answer with an error", status=200)
    usage = usage if isinstance(usage, dict) else {}
    completion_tokens, estimated = _usage_tokens(usage, content, reasoning)
    if not content and not reasoning and not tool_calls:
        # OpenRouter does not bill these (zero-completion insurance); a retry usually gets a real answer.
        raise InferenceError(
            ErrorKind.SERVER,
            f"empty completion: neither text nor tool calls (finish_reason={finish!r})",
            status=200,
            billed_tokens=completion_tokens or None,
        )
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
        quantization=str(quantization) if isinstance(quantization, str) and quantization else None,
        tool_calls=tool_calls or [],
    )


def _message_calls(calls: Any) -> list[ToolCall]:
    """A message's `tool_calls` as the answer's calls, the arguments' text as it came; a call without a name
    is a malformed answer (retried), not a call."""
    if not calls:
        return []
    if not isinstance(calls, list):
        raise InferenceError(ErrorKind.MALFORMED, f"tool_calls is not a list: {describe(calls)}", status=200)
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise InferenceError(
                ErrorKind.MALFORMED, f"a tool call without a name: {describe(call)}", status=200
            )
        args = fn.get("arguments") if isinstance(fn, dict) else None
        text = args if isinstance(args, str) else ("" if args is None else dumps(args).decode())
        out.append(ToolCall(name, text, call.get("id") if isinstance(call.get("id"), str) else None))
    return out


class StreamedCalls:
    """Tool calls from streamed deltas: each delta names its call by `index`; the first carries the id and
    name, the rest pieces of the arguments' text, appended exactly as they came."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: Any) -> None:
        if not isinstance(deltas, list):
            return
        for d in deltas:
            if not isinstance(d, dict):
                continue
            at = d.get("index", len(self.calls))
            call = self.calls.setdefault(at, {"id": None, "name": "", "arguments": []})
            if d.get("id"):
                call["id"] = d["id"]
            fn = d.get("function") or {}
            if fn.get("name"):
                call["name"] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                call["arguments"].append(fn["arguments"])

    def result(self) -> list[ToolCall]:
        out = []
        for at in sorted(self.calls):
            c = self.calls[at]
            if not c["name"]:
                raise InferenceError(ErrorKind.MALFORMED, f"streamed tool call {at} has no name", status=200)
            out.append(ToolCall(c["name"], "".join(c["arguments"]), c["id"]))
        return out


def _quantization(body: dict) -> Any:
    """Which quantization served the answer, where the provider says so (a top-level `quantization`, or in
    OpenRouter's `openrouter_metadata`); the chat-completion schema itself has no such field."""
    meta = body.get("openrouter_metadata")
    return body.get("quantization") or (meta.get("quantization") if isinstance(meta, dict) else None)


def parse_chat_completion(body: dict, fallback_model: str) -> Completion:
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
        quantization=_quantization(body),
        tool_calls=_message_calls(message.get("tool_calls")),
    )


def _token_ids(ids: Any) -> list[int] | None:
    """vLLM (`return_token_ids`) and recent SGLang return the generated ids beside the text."""
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ids
    return None


class StopReading(Exception):
    """The answer is already longer than `max_tokens` could make it: reading stops (the connection is closed,
    which ends the generation where the provider honours it) and what arrived is kept up to the limit."""


# Characters past which a streamed answer is counted with the target tokenizer: first at this many per token
# of `max_tokens` (real text runs about 4), then at each doubling. A provider that ignores max_tokens is
# caught within twice its limit, and memory holds at most that much of an answer.
CHECK_CHARS_PER_TOKEN = 8
# Without a tokenizer yet (the first answers of a run), reading stops here whatever the text.
HARD_CHARS_PER_TOKEN = 64


def over_limit(tokens: int, max_tokens: int) -> bool:
    """Longer than `max_tokens` by our own count, beyond the few tokens a re-tokenization may differ by."""
    return tokens > max_tokens + max(8, max_tokens // 50)


class StreamedAnswer:
    """Folds the chunks of a streamed chat completion into one answer, counting tokens as they arrive, and
    stops reading an answer that grows past what `max_tokens` allows (`StopReading`)."""

    __slots__ = (
        "chars",
        "content",
        "count",
        "finish",
        "ids",
        "model",
        "native_finish",
        "next_check",
        "provider",
        "reasoning",
        "request",
        "request_id",
        "stopped",
        "tool_calls",
        "usage",
    )

    def __init__(self, request: CompletionRequest, count: TokenCounter | None = None):
        self.request = request
        self.count = count  # the target tokenizer's count, once it is loaded
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.ids: list[int] | None = None
        self.finish: Any = None
        self.native_finish: Any = None
        self.usage: dict = {}
        self.model: Any = None
        self.provider: Any = None
        self.request_id: Any = None
        self.chars = 0
        self.next_check = CHECK_CHARS_PER_TOKEN * request.max_tokens + 1024
        self.stopped = False  # reading stopped at the limit
        self.tool_calls = StreamedCalls()

    def __call__(self, events: list[dict], headers: Any) -> None:
        # Called with each batch of a stream's events (tens of thousands of events a second over all streams):
        # the common case (a delta of content) first, with as few lookups as it takes; the rare fields after.
        content, tokens, chars = self.content, 0, 0
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
                            chars += len(text)
                            tokens += 1  # ≥ one token per non-empty chunk: a floor for the budget
                        if len(delta) > 1 or not text:
                            thought = delta.get("reasoning") or delta.get("reasoning_content")
                            if thought:
                                self.reasoning.append(thought)
                                chars += len(thought)
                                if not text:
                                    tokens += 1
                            calls = delta.get("tool_calls")
                            if calls:
                                self.tool_calls.add(calls)
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
            self.chars += chars
        if self.chars >= self.next_check:
            self._check_length()

    def _check_length(self) -> None:
        """Count what arrived; stop reading when it is past the limit, else look again at twice the size."""
        limit = self.request.max_tokens
        if self.count is not None:
            n = self.count("".join(self.reasoning) + "".join(self.content))
            self.request.streamed_tokens = max(self.request.streamed_tokens, n)
            past = over_limit(n, limit)
        else:
            past = self.chars > HARD_CHARS_PER_TOKEN * limit + 65536
        if past:
            self.stopped = True
            raise StopReading(f"more than max_tokens={limit} arrived; reading stopped")
        self.next_check *= 2

    def _finish(self, choice: dict) -> None:
        ids = choice.get("token_ids")
        if isinstance(ids, list):  # vLLM streams each event's ids: extended in place, not copied per event
            if self.ids is None:
                self.ids = []
            self.ids.extend(ids)
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.native_finish = choice.get("native_finish_reason")

    def completion(self, fallback_model: str) -> Completion:
        if self.finish is None and not self.stopped:
            raise InferenceError(
                ErrorKind.CONNECTION, "the stream ended before the answer finished", status=200
            )
        return _completion(
            content="".join(self.content),
            reasoning="".join(self.reasoning) or None,
            finish="length" if self.stopped else self.finish,
            native_finish=self.native_finish,
            usage=self.usage,
            body_model=self.model,
            fallback_model=fallback_model,
            provider=self.provider,
            request_id=self.request_id,
            output_ids=None if self.stopped else _token_ids(self.ids),
            tool_calls=self.tool_calls.result(),
        )


# Answers shorter than this are counted on the event loop; longer ones in a worker thread (the tokenizers
# release the GIL), so that one long answer does not hold up every stream.
COUNT_INLINE_CHARS = 2048


def max_answer_bytes(max_tokens: int) -> int:
    """The largest body a non-streamed answer of `max_tokens` may have: HARD_CHARS_PER_TOKEN characters a
    token, each up to 6 bytes of escaped JSON, and room for the envelope. A larger body is not read."""
    return HARD_CHARS_PER_TOKEN * 6 * max_tokens + 1_048_576


def _cut(chat: ChatTokenizer, reasoning: str | None, content: str, limit: int) -> tuple[str | None, str]:
    """The answer up to `limit` tokens, reasoning first (it comes first), decoded from the target tokenizer's
    ids of each part."""
    encode, decode = chat.encoder.encode_texts, chat.encoder.decode
    thought = encode([reasoning])[0] if reasoning else []
    if len(thought) >= limit:
        return decode(list(thought[:limit])), ""
    rest = limit - len(thought)
    return reasoning, decode(list(encode([content])[0][:rest])) if content else ""


def _wire(message: dict[str, Any]) -> dict[str, Any]:
    """An earlier answer's reasoning under both names servers read: `reasoning` (OpenRouter) and
    `reasoning_content` (what Kimi's and Qwen3's templates render, as vLLM and SGLang pass it)."""
    if message.get("reasoning") and "reasoning_content" not in message:
        return {**message, "reasoning_content": message["reasoning"]}
    return message


class OpenRouterBackend:
    name = "openrouter"
    wants_prompt_ids = False

    def __init__(self, cfg: OpenRouterConfig, chat: ChatTokenizer):
        self.cfg = cfg
        self.model = cfg.model
        self.served = openrouter_served(cfg)
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        # Every answer is counted with the target tokenizer (the budget charges the larger of that and the
        # provider's usage); a deferred tokenizer is loaded in a worker thread when the run starts.
        self.chat = chat
        self._tokenizer: asyncio.Future | None = None
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
            "messages": [_wire(wire_message(m)) for m in request.messages],
            "max_tokens": request.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if request.tools:
            body["tools"] = request.tools
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
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
        if self._tokenizer is None:  # loads while the first requests are out
            self._tokenizer = asyncio.ensure_future(asyncio.to_thread(lambda: self.chat.encoder))
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
            body = await post_json(
                self._session,
                self.url,
                self._payload(request),
                self._secrets,
                max_bytes=max_answer_bytes(request.max_tokens),
                billed_tokens=request.max_tokens,
            )
            return await self._own_count(parse_chat_completion(body, self.cfg.model), request)
        assert self._streams is not None
        loaded = self._tokenizer is not None and self._tokenizer.done() and not self._tokenizer.exception()
        answer = StreamedAnswer(request, self.chat.count_tokens if loaded else None)
        with contextlib.suppress(StopReading):  # the connection is closed; what arrived is kept to the limit
            await self._streams.post(dumps(self._payload(request)), answer)
        return await self._own_count(answer.completion(self.cfg.model), request)

    async def _own_count(self, c: Completion, request: CompletionRequest) -> Completion:
        """Our own count of what arrived (reasoning included); an answer past `max_tokens` by it is cut at
        the limit (the budget charges the larger of this count and the provider's usage)."""
        if self._tokenizer is not None:
            await self._tokenizer
        text = (c.reasoning or "") + c.content + "".join(t.name + t.arguments for t in c.tool_calls)
        count = self.chat.count_tokens
        n = count(text) if len(text) < COUNT_INLINE_CHARS else await asyncio.to_thread(count, text)
        if c.usage_estimated:
            c.completion_tokens = n
        if over_limit(n, request.max_tokens):
            c.reasoning, c.content = _cut(self.chat, c.reasoning, c.content, request.max_tokens)
            c.finish_reason, c.cut_at_max_tokens, c.output_ids = "length", True, None
            c.native_finish_reason = f"cut here: {n:,} tokens arrived for max_tokens={request.max_tokens:,}"
            n = request.max_tokens
        c.counted_tokens = n
        return c

    async def close(self) -> None:
        if self._streams is not None:
            await self._streams.close()
            self._streams = None
        if self._session is not None:
            await self._session.close()
            self._session = None
