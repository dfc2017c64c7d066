"""OpenRouter (and any OpenAI-compatible chat-completions endpoint: vLLM, SGLang's OpenAI API, `transformers serve`).

The API key is read from the environment variable the config names, at run time, and lives only in the session's
headers: it is not a field of the resource, so it never reaches run config, logs, metadata or files.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

import aiohttp

from eagle3_assets.core.protocol import Completion, CompletionRequest, ErrorKind, InferenceError, describe

from .base import InferenceResource
from .http import get_json, make_session, post_json


def parse_chat_completion(body: dict, fallback_model: str) -> Completion:
    """An OpenAI-style chat completion body as a Completion, or a classified error."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise InferenceError(ErrorKind.MALFORMED, f"no choices in the response: {describe(body)}", status=200)
    choice = choices[0]
    if isinstance(choice.get("error"), dict):
        from .http import classify

        raise classify(200, {"error": choice["error"]}, None)
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    if finish == "error":
        raise InferenceError(
            ErrorKind.SERVER, f"the provider ended the answer with an error: {describe(choice)}", status=200
        )
    content = message.get("content") or ""
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    usage = body.get("usage") or {}
    completion_tokens = int(usage.get("completion_tokens") or 0)
    if not content and not reasoning and completion_tokens == 0:
        # OpenRouter does not bill these (zero-completion insurance); a retry usually gets a real answer.
        raise InferenceError(ErrorKind.SERVER, f"empty completion (finish_reason={finish!r})", status=200)
    details = usage.get("completion_tokens_details") or {}
    prompt_details = usage.get("prompt_tokens_details") or {}
    cost = usage.get("cost")
    provider = body.get("provider")
    return Completion(
        content=content,
        reasoning=reasoning if reasoning else None,
        finish_reason=str(finish or "unknown"),
        native_finish_reason=choice.get("native_finish_reason"),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=completion_tokens,
        reasoning_tokens=details.get("reasoning_tokens"),
        cached_tokens=prompt_details.get("cached_tokens"),
        cost_usd=float(cost) if isinstance(cost, int | float) else None,
        model=str(body.get("model") or fallback_model),
        provider=str(provider) if provider else None,
        request_id=body.get("id"),
        output_ids=_token_ids(choice),
    )


def _token_ids(choice: dict) -> list[int] | None:
    """vLLM (`return_token_ids`) and recent SGLang return the generated ids beside the text."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ids
    return None


class OpenRouterBackend:
    name = "openrouter"
    wants_prompt_ids = False

    def __init__(self, cfg: OpenRouterInference):
        self.cfg = cfg
        self.model = cfg.model
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self._session: aiohttp.ClientSession | None = None
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
            "messages": request.messages,
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
        body.update(self.cfg.extra_body)
        return body

    async def start(self) -> None:
        if self._session is None:
            key = os.environ.get(self.cfg.api_key_env)
            self._secrets = (key.encode(),) if key else ()
            self._session = make_session(self.cfg.request_timeout_s, self._headers())

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
                    f"cannot reach {base}/models ({type(e).__name__}: {e}); check backends.openrouter.base_url "
                    "and the network"
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
        body = await post_json(self._session, self.url, self._payload(request), self._secrets)
        return parse_chat_completion(body, self.cfg.model)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class OpenRouterInference(InferenceResource):
    """OpenRouter or any OpenAI-compatible endpoint. The key comes from the environment variable `api_key_env`."""

    base_url: str = "https://openrouter.ai/api/v1"
    api_key_env: str = "OPENROUTER_API_KEY"
    model: str = "moonshotai/kimi-k2.5"
    provider: dict[str, Any] = {}
    reasoning: dict[str, Any] | None = {"enabled": True}
    extra_body: dict[str, Any] = {}
    request_timeout_s: float = 900.0
    max_concurrency: int = 2000
    max_retries: int = 8
    app_url: str = "https://github.com/eagle3-assets"
    app_title: str = "eagle3-assets"

    @property
    def backend_name(self) -> str:
        return "openrouter"

    def create_backend(self, chat_tokenizer: Any = None) -> OpenRouterBackend:
        return OpenRouterBackend(self)
