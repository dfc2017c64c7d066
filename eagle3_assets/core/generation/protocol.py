"""The one small protocol every inference backend implements, and the error classes the engine acts on.

A backend turns a `CompletionRequest` into a `Completion` or raises an `InferenceError` whose `kind` tells the
engine what to do: slow down and send again (backpressure: it costs the prompt nothing), retry a fault within
the prompt's retry allowance, record a permanent failure for that prompt, or stop the whole run (bad key, no
credits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from ...config import SamplingConfig as Sampling  # one sampling model: eagle3.yaml's


@dataclass(slots=True)
class CompletionRequest:
    id: str
    messages: list[dict[str, str]]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    # The prompt rendered by the target's chat template, for backends that take token ids (SGLang, embedded).
    prompt_ids: list[int] | None = None
    # Tokens received so far by a streaming backend (a lower bound on the answer's length; the budget reads
    # it).
    streamed_tokens: int = 0


@dataclass(slots=True)
class Completion:
    content: str
    finish_reason: str  # stop | length | content_filter | error | ...
    prompt_tokens: int
    completion_tokens: int
    model: str
    reasoning: str | None = None
    provider: str | None = None
    cost_usd: float | None = None
    output_ids: list[int] | None = None
    native_finish_reason: str | None = None
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None
    request_id: str | None = None
    latency_s: float = 0.0
    usage_estimated: bool = (
        False  # the server sent no usage: completion_tokens counted with the target tokenizer
    )
    # What a serving engine computed beside the text (the hidden states of an extraction request); never
    # journalled.
    payload: Any = None


class ErrorKind(StrEnum):
    RATE_LIMITED = "rate_limited"  # 429, or 402 with Retry-After (in-flight spend cap): backpressure
    OVERLOADED = "overloaded"  # 503 / no provider: backpressure with Retry-After, otherwise a fault
    SERVER = "server"  # other 5xx, error object in a 200 body, finish_reason "error": a fault, retried
    TIMEOUT = "timeout"  # 408, client timeout: a fault, retried
    CONNECTION = "connection"  # reset, refused, stream cut: a fault, retried
    MALFORMED = "malformed"  # unparsable or empty body: a fault, retried
    BAD_REQUEST = "bad_request"  # 400, 403 moderation, 404 model: permanent for this prompt
    CONTEXT_LENGTH = "context_length"  # prompt + max_tokens too long: permanent for this prompt
    AUTH = "auth"  # 401: stop the run
    OUT_OF_CREDITS = "out_of_credits"  # 402 without Retry-After: stop the run
    PROXY = "proxy"  # the HTTP proxy refused the connection (407, 403): stop the run
    INTERNAL = "internal"  # our bug while handling a response: not retried in this run, never permanent

    @property
    def retryable(self) -> bool:
        return self in _RETRYABLE

    @property
    def permanent(self) -> bool:
        """The prompt itself is the problem: sending it again would fail the same way."""
        return self in (ErrorKind.BAD_REQUEST, ErrorKind.CONTEXT_LENGTH)

    @property
    def fatal(self) -> bool:
        return self in (ErrorKind.AUTH, ErrorKind.OUT_OF_CREDITS, ErrorKind.PROXY)


_RETRYABLE = {
    ErrorKind.RATE_LIMITED,
    ErrorKind.OVERLOADED,
    ErrorKind.SERVER,
    ErrorKind.TIMEOUT,
    ErrorKind.CONNECTION,
    ErrorKind.MALFORMED,
}


class InferenceError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        retry_after: float | None = None,
        status: int | None = None,
        pause_all_s: float | None = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after
        self.status = status
        # The provider closed a window for the whole key (X-RateLimit-Remaining: 0 + Reset): seconds until it
        # opens.
        self.pause_all_s = pause_all_s

    @property
    def backpressure(self) -> bool:
        """The provider wants less traffic, not this request changed: slow down, and it costs the prompt
        nothing."""
        return self.kind is ErrorKind.RATE_LIMITED or (
            self.kind is ErrorKind.OVERLOADED and self.retry_after is not None
        )

    def __str__(self) -> str:
        prefix = f"HTTP {self.status} " if self.status else ""
        return f"{prefix}{self.kind.value}: {self.message}"


class FatalRunError(RuntimeError):
    """The run cannot go on (bad key, out of credits, a proxy that refuses); the message says what to do."""


@runtime_checkable
class InferenceBackend(Protocol):
    """What the generation engine needs from a backend."""

    name: str  # "local" | "openrouter" | "sglang"
    model: str  # the model name stored with each response
    wants_prompt_ids: bool  # requests must carry prompt_ids rendered by the target tokenizer

    async def start(self) -> None:
        """Open sessions, load weights; called once inside the engine's event loop."""

    async def preflight(self) -> list[str]:
        """Cheap checks before any paid request; returns problems (each a one-line fix), empty when ready."""

    async def complete(self, request: CompletionRequest) -> Completion: ...

    async def close(self) -> None: ...


def describe(obj: Any, limit: int = 300) -> str:
    """A short printable excerpt of a body or object for error messages."""
    text = obj if isinstance(obj, str) else repr(obj)
    return text if len(text) <= limit else text[:limit] + "…"
