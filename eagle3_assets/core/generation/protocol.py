"""The one small protocol every inference backend implements, and the error classes the engine acts on.

A backend turns a `CompletionRequest` into a `Completion` or raises an `InferenceError` whose `kind` tells the
engine what to do: slow down and send again (backpressure: it costs the prompt nothing), retry a fault within
the prompt's retry allowance, record a permanent failure for that prompt, or stop the whole run (bad key, no
credits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...config import SamplingConfig as Sampling  # one sampling model: eagle3.yaml's
from ..target_model.tool_calls import ToolCall, unparsed_call

if TYPE_CHECKING:
    from .served_models import ServedModels


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
    # The messages as sent, hashed (`binding.prompt_fingerprint`): stored with the answer, so that a prompt
    # edited later is asked again rather than trained on an answer to another question.
    fingerprint: str | None = None
    # The tool definitions the row offers (OpenAI's function form) and its `tool_choice` as the source has it:
    # sent by every backend that takes them, rendered into `prompt_ids` for those that take ids.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


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
    # This platform's own count of the answer's tokens (reasoning included), whatever the provider's usage
    # says: the budget charges the larger of the two.
    counted_tokens: int | None = None
    quantization: str | None = None  # where the provider says which quantization served the answer
    cut_at_max_tokens: bool = False  # the provider sent more than max_tokens: kept up to the limit
    # The fingerprint of the request this answers, set by the engine when the answer lands.
    prompt_fingerprint: str | None = None
    # What a serving engine computed beside the text (the hidden states of an extraction request); never
    # journalled.
    payload: Any = None
    # The calls the answer makes (OpenAI's `tool_calls`, streamed deltas assembled), each with its arguments
    # as the JSON text the target wrote: a call is an answer, as text is.
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Neither text nor calls: nothing to train, never stored as an answer (a retryable failure)."""
        return not (self.content or self.reasoning or self.tool_calls)

    def defect(self, request: CompletionRequest) -> str | None:
        """Why this answer cannot be stored as the target's answer, or None: neither text nor calls, or (with
        tools offered) a call left as raw text. Either would close the prompt with nothing, or with text the
        template cannot render as what the model wrote; both are asked again."""
        if self.payload is not None:
            return None
        if self.empty:
            return f"an answer with neither text nor tool calls (finish_reason={self.finish_reason!r})"
        if request.tools and not self.tool_calls:
            where = unparsed_call(self.reasoning, self.content)
            if where:
                return (
                    f"{where}: the reasoning ran into the call without its end-of-thinking mark, or the "
                    "server parses no tool calls (vLLM: --enable-auto-tool-choice --tool-call-parser)"
                )
        return None

    @property
    def charged_tokens(self) -> int:
        """What the budget charges: never less than what arrived, whatever the provider reports."""
        return max(int(self.completion_tokens or 0), int(self.counted_tokens or 0))


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
    # Served by a model the config does not accept as the target: paid for, set aside; asked again by the next
    # run, not this one (each try is paid for).
    FOREIGN_MODEL = "foreign_model"
    # The answer's body is larger than `max_tokens` could make it: not read, charged; asked again by the next
    # run, not this one.
    OVERSIZED = "oversized"
    STORAGE = "storage"  # the storage root cannot take the answers: stop the run before buying more

    @property
    def retryable(self) -> bool:
        return self in _RETRYABLE

    @property
    def permanent(self) -> bool:
        """The prompt itself is the problem: sending it again would fail the same way."""
        return self in (ErrorKind.BAD_REQUEST, ErrorKind.CONTEXT_LENGTH)

    @property
    def fatal(self) -> bool:
        return self in (ErrorKind.AUTH, ErrorKind.OUT_OF_CREDITS, ErrorKind.PROXY, ErrorKind.STORAGE)


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
        billed_tokens: int | None = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after
        self.status = status
        # The provider closed a window for the whole key (X-RateLimit-Remaining: 0 + Reset): seconds until it
        # opens.
        self.pause_all_s = pause_all_s
        # Tokens this failed attempt was probably billed for (an answer read but not stored): charged to the
        # budget, and the dispatch ledger does not call the attempt unbilled.
        self.billed_tokens = billed_tokens

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

    @property
    def served(self) -> ServedModels | None:
        """The names this backend may serve the target as; an answer served as anything else is not stored as
        an answer (None: every answer is kept, as a serving engine's extraction answers are)."""

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
