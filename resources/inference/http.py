"""HTTP plumbing shared by the server backends: one aiohttp session, error classification, Retry-After.

One `ClientSession` per run with an unlimited connector: the engine's worker count is the concurrency limit,
and aiohttp's own pool limit (100 by default) would silently cap 2000 workers at 100 requests in flight. Each
request goes through the proxy `core.storage.proxy` names for its URL (read once per session); aiohttp's own
`trust_env` stays off, so it neither decides differently (it would proxy loopback) nor reads ~/.netrc.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, quote_plus

import aiohttp
import orjson

from eagle3_assets.core.generation.protocol import ErrorKind, InferenceError, describe
from eagle3_assets.core.storage.proxy import Proxies, Proxy, refusal, target_of

# orjson parses a response body 2-4x faster than json: at thousands of answers a second it is the client's
# cost.
loads = orjson.loads
dumps = orjson.dumps


CONTEXT_MARKERS = (
    "context length",
    "context_length",
    "maximum context",
    "too many tokens",
    "context window",
    "prompt is too long",
    "longer than the model",
)


class HttpSession:
    """An aiohttp session, the headers of its requests and the proxy settings they follow, made once per run.

    The headers go with each request, never as the session's defaults: aiohttp merges a session's default
    headers into a CONNECT and sends a default `Authorization` to the proxy as `Proxy-Authorization` (3.14),
    which would hand the API key to every proxy on the way."""

    def __init__(
        self, client: aiohttp.ClientSession, proxies: Proxies, headers: Mapping[str, str] | None = None
    ):
        self.client = client
        self.proxies = proxies
        self.headers = dict(headers or {})

    def route(self, url: str) -> tuple[Proxy | None, dict[str, Any]]:
        """The proxy for `url` and the request arguments that send it there: a CONNECT tunnel for https
        (credentials on the CONNECT), absolute-form for http (credentials on the request, which the proxy
        takes)."""
        proxy = self.proxies.for_url(url)
        if proxy is None:
            return None, {"headers": self.headers}
        kwargs: dict[str, Any] = {"proxy": proxy.url, "headers": self.headers}
        auth = proxy.authorization()
        if auth is not None:
            if url.lower().startswith("https:"):
                kwargs["proxy_headers"] = {"Proxy-Authorization": auth}
            else:
                kwargs["headers"] = {**self.headers, "Proxy-Authorization": auth}
        return proxy, kwargs

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> HttpSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def make_session(timeout_s: float, headers: dict[str, str] | None = None) -> HttpSession:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30)
    client = aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        json_serialize=lambda o: dumps(o).decode(),
        trust_env=False,
    )
    # Bodies go out as pre-encoded bytes, which get no content type of their own; strict servers
    # (FastAPI's, behind `transformers serve` and vLLM) refuse a body without one.
    return HttpSession(client, Proxies(), {"Content-Type": "application/json", **(headers or {})})


def proxy_refused(proxy: Proxy, target: str, status: int, reason: str) -> InferenceError:
    """A proxy's refusal to reach `target` (host:port): its 5xx (it could not reach the target) is a
    connection fault, retried; anything else (407 credentials, 403 policy) stops the run, since every request
    would meet it."""
    kind = ErrorKind.CONNECTION if status >= 500 else ErrorKind.PROXY
    return InferenceError(kind, refusal(proxy, target, status, reason), status=status)


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds (delta or HTTP date), None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def key_window_pause(headers: Mapping[str, str]) -> float | None:
    """Seconds until a key-wide rate window reopens, when the provider says it is closed for everyone
    (`X-RateLimit-Remaining: 0` with `X-RateLimit-Reset` as epoch ms, epoch s or a delta in seconds)."""
    remaining, reset = headers.get("X-RateLimit-Remaining"), headers.get("X-RateLimit-Reset")
    if remaining is None or reset is None:
        return None
    try:
        if float(remaining) > 0:
            return None
        value = float(reset)
    except ValueError:
        return None
    now = time.time()
    seconds = value / 1000 - now if value > 1e12 else value - now if value > 1e9 else value
    return min(max(seconds, 0.0), 3600.0)


def _error_fields(body: Any) -> tuple[int | None, str, dict]:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        try:
            code = int(code) if code is not None else None
        except (TypeError, ValueError):
            code = None
        meta: dict[str, Any] = err["metadata"] if isinstance(err.get("metadata"), dict) else {}
        return (
            code,
            str(err.get("message") or describe(err)),
            {**meta, "availability": err.get("availability")},
        )
    if isinstance(err, str):
        return None, err, {}
    return None, describe(body), {}


def classify(status: int, body: Any, headers: Mapping[str, str] | None = None) -> InferenceError:
    """Map an HTTP status (or the code of an error object inside a 200 body or a stream) to what the engine
    does."""
    headers = headers or {}
    code, message, meta = _error_fields(body)
    status = code or status
    retry_after = parse_retry_after(headers.get("Retry-After"))
    avail: dict[str, Any] = meta["availability"] if isinstance(meta.get("availability"), dict) else {}
    if retry_after is None and isinstance(avail.get("retry_after"), int | float):
        retry_after = float(avail["retry_after"])
    error_type = str(meta.get("error_type") or "")
    lowered = message.lower()
    if status == 401:
        return InferenceError(ErrorKind.AUTH, message, status=401)
    if status == 402:
        if retry_after is not None:  # OpenRouter's in-flight spend cap: backpressure, not an empty account
            return InferenceError(ErrorKind.RATE_LIMITED, message, retry_after, 402)
        return InferenceError(ErrorKind.OUT_OF_CREDITS, message, status=402)
    if status == 429 or error_type == "rate_limit_exceeded":
        return InferenceError(ErrorKind.RATE_LIMITED, message, retry_after, status, key_window_pause(headers))
    if status == 503 or error_type in ("provider_overloaded", "provider_unavailable"):
        return InferenceError(ErrorKind.OVERLOADED, message, retry_after, status)
    if error_type == "context_length_exceeded" or any(m in lowered for m in CONTEXT_MARKERS):
        return InferenceError(ErrorKind.CONTEXT_LENGTH, message, status=status)
    if status in (408, 504) or error_type == "timeout":
        return InferenceError(ErrorKind.TIMEOUT, message, retry_after, status)
    if status in (400, 403, 404, 405, 413, 422):
        return InferenceError(ErrorKind.BAD_REQUEST, message, status=status)
    return InferenceError(ErrorKind.SERVER, message, retry_after, status)


def secret_forms(key: str | None) -> tuple[bytes, ...]:
    """The key as it may come back in a body: raw, URL-encoded, and JSON-escaped (`/` as `\\/`, unicode
    escapes)."""
    if not key:
        return ()
    forms = {key, quote(key, safe=""), quote_plus(key), key.replace("/", "\\/")}
    forms.add("".join(f"\\u{ord(ch):04x}" for ch in key))
    # Shorter strings are not secrets worth the damage: cutting them out would corrupt ordinary text.
    return tuple(sorted((f.encode() for f in forms if len(f) >= 8), key=len, reverse=True))


def redact(raw: bytes, secrets: tuple[bytes, ...]) -> bytes:
    for secret in secrets:
        if secret in raw:
            raw = raw.replace(secret, b"[redacted]")
    return raw


def _transport_error(e: BaseException, url: str, proxy: Proxy | None) -> InferenceError:
    if isinstance(e, TimeoutError):
        return InferenceError(ErrorKind.TIMEOUT, "no response within the request timeout")
    if isinstance(e, aiohttp.ClientPayloadError):
        return InferenceError(ErrorKind.CONNECTION, f"response cut off: {e}")
    if isinstance(e, aiohttp.ClientHttpProxyError) and proxy is not None:
        return proxy_refused(proxy, target_of(url), e.status, e.message)
    if isinstance(e, aiohttp.ClientProxyConnectionError) and proxy is not None:
        return InferenceError(
            ErrorKind.CONNECTION, f"cannot connect to the proxy {proxy} ({proxy.source}): {e}"
        )
    return InferenceError(ErrorKind.CONNECTION, f"{type(e).__name__}: {e}")


_TRANSPORT_ERRORS = (
    TimeoutError,
    aiohttp.ClientHttpProxyError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientConnectionError,
    ConnectionError,
    OSError,
)


def _error_response(status: int, raw: bytes, headers: Mapping[str, str]) -> InferenceError:
    body: Any = None
    if raw.strip():
        try:
            body = loads(raw)
        except ValueError:
            body = None
    if body is None:
        body = {"error": {"message": describe(raw.decode("utf-8", "replace"))}}
    return classify(status, body, headers)


async def post_json(
    session: HttpSession,
    url: str,
    payload: dict,
    secrets: tuple[bytes, ...] = (),
    max_bytes: int | None = None,
    billed_tokens: int | None = None,
) -> dict:
    """POST and return the decoded JSON body of a 200, or raise a classified InferenceError.

    `secrets` (the API key in the forms `secret_forms` lists) are cut out of the body before anything reads
    it: a server that echoes the request's headers into an error must not put the key into failures.parquet or
    the logs. A body longer than `max_bytes` is not read past that (memory stays bounded whatever a server
    sends): an `oversized` fault, charged `billed_tokens`.
    """
    proxy, via = session.route(url)
    try:
        async with session.client.post(url, data=dumps(payload), **via) as resp:
            raw = await _read_body(resp, max_bytes, billed_tokens)
            status, reason = resp.status, resp.reason or ""
            headers = resp.headers
    except _TRANSPORT_ERRORS as e:
        raise _transport_error(e, url, proxy) from None
    raw = redact(raw, secrets)
    if status == 407 and proxy is not None:  # only a proxy sends 407: an http request it would not forward
        raise proxy_refused(proxy, target_of(url), 407, reason)
    if status != 200:
        raise _error_response(status, raw, headers)
    if not raw.strip():
        raise InferenceError(ErrorKind.MALFORMED, "empty response body", status=200)
    try:
        body = loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise InferenceError(
            ErrorKind.MALFORMED, f"unparsable body: {describe(raw.decode('utf-8', 'replace'))}", status=200
        )
    if body.get("error"):
        raise classify(200, body, headers)
    return body


async def _read_body(resp: aiohttp.ClientResponse, max_bytes: int | None, billed_tokens: int | None) -> bytes:
    if max_bytes is None:
        return await resp.read()
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > max_bytes:
            resp.close()
            raise InferenceError(
                ErrorKind.OVERSIZED,
                f"the answer's body passed {max_bytes:,} bytes, more than max_tokens allows; not read on",
                status=resp.status,
                billed_tokens=billed_tokens,
            )
    return bytes(body)


async def get_json(session: HttpSession, url: str, timeout_s: float = 15.0) -> tuple[int, Any]:
    """GET; the status and the decoded body. A proxy's refusal raises its classified InferenceError (a status
    the caller would otherwise blame on the server)."""
    proxy, via = session.route(url)
    try:
        async with session.client.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s), **via) as resp:
            raw = await resp.read()
            status, reason = resp.status, resp.reason or ""
    except aiohttp.ClientHttpProxyError as e:
        if proxy is None:
            raise
        raise _transport_error(e, url, proxy) from None
    if status == 407 and proxy is not None:
        raise proxy_refused(proxy, target_of(url), 407, reason)
    try:
        return status, loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode("utf-8", "replace")
