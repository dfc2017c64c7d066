"""HTTP plumbing shared by the server backends: one aiohttp session, error classification, Retry-After.

One `ClientSession` per run with an unlimited connector: the engine's worker count is the concurrency limit, and
aiohttp's own pool limit (100 by default) would silently cap 2000 workers at 100 requests in flight.
"""

from __future__ import annotations

import email.utils
import time
from typing import Any

import aiohttp

from eagle3_assets.core.protocol import ErrorKind, InferenceError, describe

try:  # orjson parses responses 2-4x faster; plain json works too
    import orjson

    def loads(data: bytes) -> Any:
        return orjson.loads(data)

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover
    import json

    def loads(data: bytes) -> Any:
        return json.loads(data)

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()


CONTEXT_MARKERS = (
    "context length",
    "context_length",
    "maximum context",
    "too many tokens",
    "context window",
    "prompt is too long",
    "longer than the model",
)


def make_session(timeout_s: float, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        headers=headers or {},
        json_serialize=lambda o: dumps(o).decode(),
    )


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


def _error_fields(body: Any) -> tuple[int | None, str, dict]:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        try:
            code = int(code) if code is not None else None
        except (TypeError, ValueError):
            code = None
        meta = err.get("metadata") if isinstance(err.get("metadata"), dict) else {}
        return (
            code,
            str(err.get("message") or describe(err)),
            {**meta, "availability": err.get("availability")},
        )
    if isinstance(err, str):
        return None, err, {}
    return None, describe(body), {}


def classify(status: int, body: Any, retry_after_header: str | None) -> InferenceError:
    """Map an HTTP status (or the code of an error object inside a 200 body) to what the engine should do."""
    code, message, meta = _error_fields(body)
    status = code or status
    retry_after = parse_retry_after(retry_after_header)
    avail = meta.get("availability") if isinstance(meta.get("availability"), dict) else {}
    if retry_after is None and isinstance(avail.get("retry_after"), int | float):
        retry_after = float(avail["retry_after"])
    error_type = str(meta.get("error_type") or "")
    lowered = message.lower()
    if status == 401:
        return InferenceError(ErrorKind.AUTH, message, status=401)
    if status == 402:
        if retry_after is not None:  # OpenRouter's in-flight spend cap: wait, then go on
            return InferenceError(ErrorKind.RATE_LIMITED, message, retry_after, 402)
        return InferenceError(ErrorKind.OUT_OF_CREDITS, message, status=402)
    if status == 429 or error_type == "rate_limit_exceeded":
        return InferenceError(ErrorKind.RATE_LIMITED, message, retry_after, status)
    if status == 503 or error_type in ("provider_overloaded", "provider_unavailable"):
        return InferenceError(ErrorKind.OVERLOADED, message, retry_after, status)
    if error_type == "context_length_exceeded" or any(m in lowered for m in CONTEXT_MARKERS):
        return InferenceError(ErrorKind.CONTEXT_LENGTH, message, status=status)
    if status in (408, 504) or error_type == "timeout":
        return InferenceError(ErrorKind.TIMEOUT, message, retry_after, status)
    if status in (400, 403, 404, 405, 413, 422):
        return InferenceError(ErrorKind.BAD_REQUEST, message, status=status)
    return InferenceError(ErrorKind.SERVER, message, retry_after, status)


async def post_json(
    session: aiohttp.ClientSession, url: str, payload: dict, secrets: tuple[bytes, ...] = ()
) -> dict:
    """POST and return the decoded JSON body of a 200, or raise a classified InferenceError.

    `secrets` (the API key) are cut out of the body before anything reads it: a server that echoes the request's
    headers into an error must not put the key into failures.parquet or the logs, not even half of it.
    """
    try:
        async with session.post(url, data=dumps(payload)) as resp:
            raw = await resp.read()
            status = resp.status
            retry_after = resp.headers.get("Retry-After")
    except TimeoutError:
        raise InferenceError(ErrorKind.TIMEOUT, "no response within the request timeout") from None
    except aiohttp.ClientPayloadError as e:
        raise InferenceError(ErrorKind.CONNECTION, f"response cut off: {e}") from None
    except (aiohttp.ClientConnectionError, ConnectionError, OSError) as e:
        raise InferenceError(ErrorKind.CONNECTION, f"{type(e).__name__}: {e}") from None
    for secret in secrets:
        if secret and secret in raw:
            raw = raw.replace(secret, b"[redacted]")
    body: Any = None
    if raw.strip():
        try:
            body = loads(raw)
        except ValueError:
            body = None
    if status != 200:
        return_body = (
            body if body is not None else {"error": {"message": describe(raw.decode("utf-8", "replace"))}}
        )
        raise classify(status, return_body, retry_after)
    if not raw.strip():
        raise InferenceError(ErrorKind.MALFORMED, "empty response body", status=200)
    if not isinstance(body, dict):
        raise InferenceError(
            ErrorKind.MALFORMED, f"unparsable body: {describe(raw.decode('utf-8', 'replace'))}", status=200
        )
    if body.get("error"):
        raise classify(200, body, retry_after)
    return body


async def get_json(session: aiohttp.ClientSession, url: str, timeout_s: float = 15.0) -> tuple[int, Any]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        raw = await resp.read()
        try:
            return resp.status, loads(raw) if raw.strip() else None
        except ValueError:
            return resp.status, raw.decode("utf-8", "replace")
