"""The two ways a run stops itself because the provider or the configuration, not a prompt, is the problem.

- A streak: the same error that is not retried (400, 403, 404, a bug of ours) `streak_limit` times in a row,
  with no answer in between from a request sent after the streak began. Bad prompts fail each their own way; a
  whole run failing the same way is a configuration problem (provider routing, model access, extra_body, key
  permissions). Counted across lanes: they share the backend and its configuration. A context-length error is
  a property of its prompt and never counts.
- A stall: the provider refused every request for `stall_timeout_s` and answered none.

Either way the run stops and no prompt is marked permanent: once the configuration is fixed or the provider
has room again, the next run sends them again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .protocol import ErrorKind, InferenceError

if TYPE_CHECKING:
    from .lanes import PendingPrompt

_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True, slots=True)
class ErrorSignature:
    """What makes two errors the same: their kind, status and message (numbers masked: ids, counts, times)."""

    kind: ErrorKind
    status: int | None
    message: str

    @classmethod
    def of(cls, e: InferenceError) -> ErrorSignature:
        return cls(e.kind, e.status, _DIGITS.sub("#", e.message)[:200])


class ConfigurationStreak:
    """Identical permanent errors with no answer in between, and the prompts that got them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.tripped = False  # the run is stopping as a configuration problem
        self.members: list[PendingPrompt] = []
        self._signature: ErrorSignature | None = None
        self._since = 0.0  # when the first request of the streak was sent

    def on_answer(self, dispatched_at: float) -> None:
        """An answer to a request sent after the streak began ends it."""
        if self._signature is not None and dispatched_at >= self._since:
            self._signature, self.members = None, []

    def count(self, p: PendingPrompt, e: InferenceError, dispatched_at: float) -> bool:
        """Count one error that is not retried; True exactly when it makes the streak long enough to stop the
        run."""
        if e.kind is ErrorKind.CONTEXT_LENGTH:
            return False
        signature = ErrorSignature.of(e)
        if signature != self._signature:
            self._signature, self.members, self._since = signature, [], dispatched_at
        self.members.append(p)
        if len(self.members) < self.limit or self.tripped:
            return False
        self.tripped = True
        return True

    def error(self, e: InferenceError) -> InferenceError:
        """Why the run stops, and what to do."""
        if e.kind is ErrorKind.FOREIGN_MODEL:
            return InferenceError(
                e.kind,
                f"{len(self.members)} answers in a row were {e.message}: the endpoint does not serve the "
                "target under this name. Pin a provider that serves it (backends.openrouter.provider), fix "
                "backends.openrouter.model, or, if that name is the very same weights, list it in "
                "accepted_models; the prompts are not marked permanent and will be sent again",
                status=e.status,
            )
        return InferenceError(
            e.kind,
            f"{len(self.members)} requests in a row failed the same way ({e.message}); this looks like a "
            "configuration problem (model access, provider routing, extra_body, key permissions), not bad "
            "prompts. Fix it and materialise again: these prompts are not marked permanent and will be sent "
            "again",
            status=e.status,
        )


class StallWatch:
    """How long the provider has gone without answering while it kept refusing."""

    def __init__(self, timeout_s: float, now: float):
        self.timeout_s = timeout_s
        self.restart(now)

    def restart(self, now: float) -> None:
        self._last_answer_at = now
        self._refused_at_last_answer = 0

    def on_answer(self, now: float, refused: int) -> None:
        """An answer, with the key's refusals so far."""
        self._last_answer_at, self._refused_at_last_answer = now, refused

    def stalled(self, now: float, refused: int) -> InferenceError | None:
        """Why the run stops, once the provider has refused (and answered nothing) for the whole timeout."""
        idle = now - self._last_answer_at
        if idle < self.timeout_s or refused == self._refused_at_last_answer:
            return None
        return InferenceError(
            ErrorKind.RATE_LIMITED,
            f"the provider refused every request for {idle:.0f} s (rate limit or capacity) and answered "
            "none; no prompt is marked failed: materialise again later, or lower max_concurrency",
        )
