"""A dataset's share of a run (`Lane`) and the prompts it has in hand (`PendingPrompt`).

A lane keeps its own order of what goes out next: a due retry first (it was sent before), then the prompt held
back for the budget (first in line already, so never displaced), then a conversation's next turn (chains
finish before new ones start, and none starve), then its next new prompt. New prompts are pulled lazily from
the lane's iterator: a dataset of 100k prompts costs nothing until they are sent.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .progress_report import EngineReport
from .protocol import ErrorKind, InferenceError

if TYPE_CHECKING:
    from .ledger import DispatchLedger
    from .limiter import DispatchToken
    from .protocol import Completion, CompletionRequest
    from .served_models import ServedModels


class LaneBudget(Protocol):
    """What the engine asks of a lane's budget (`budget.Budget`; extraction's is always open)."""

    def open(self, request: CompletionRequest) -> Any: ...

    def settle(
        self,
        ticket: Any,
        completion_tokens: int | None,
        cost_usd: float | None,
        latency_s: float | None = None,
    ) -> None: ...

    def can_dispatch(self) -> bool: ...

    def spent_share(self) -> float: ...

    def committed_share(self) -> float: ...

    def describe(self) -> str: ...


class LaneSink(Protocol):
    """Where a lane's answers and failures go (`journal.JournalWriter`; extraction's shard assembler)."""

    @property
    def pending(self) -> int: ...

    def add_completion(self, request_id: str, c: Completion) -> None: ...

    def add_failure(
        self, request_id: str, kind: str, message: str, attempts: int, permanent: bool, status: int | None
    ) -> None: ...

    async def flush(self) -> None: ...


class PendingPrompt:
    """A prompt being worked on: its request, its lane and what happened to it so far."""

    __slots__ = ("accepted", "attempts", "faults", "lane", "last_error", "refusals", "request", "token")

    def __init__(self, request: CompletionRequest, lane: Lane):
        self.request = request
        self.lane = lane
        self.attempts = 0
        self.faults = 0
        self.refusals = 0
        self.last_error: InferenceError | None = None
        self.token: DispatchToken | None = None  # the attempt in flight, as the limiter saw it go out
        self.accepted = False  # this attempt's first token counted for the window (AdaptiveLimit.on_accepted)


@dataclass(order=True, frozen=True, slots=True)
class DueRetry:
    """A prompt waiting to be sent again; ordered by when it is due, then by when it was queued."""

    due: float
    queued: int
    pending: PendingPrompt = field(compare=False)


class Lane:
    """One dataset's share of a run: its prompts (in order), its budget, its journal writer and dispatch
    ledger, and its own report."""

    def __init__(
        self,
        key: str,
        requests: Iterable[CompletionRequest],
        total: int,
        budget: LaneBudget,
        writer: LaneSink,
        ledger: DispatchLedger | None = None,
        follow: Callable[[CompletionRequest, Completion], CompletionRequest | None] | None = None,
    ):
        self.key = key
        self.it: Iterator[CompletionRequest] = iter(requests)
        # A chain's next request once an answer lands (a conversation's next turn, `conversations.Chains`).
        self.follow = follow
        self.followups: deque[PendingPrompt] = deque()
        self.budget = budget
        self.writer = writer
        self.ledger = ledger
        self.report = EngineReport(total=total)
        self.retries: list[DueRetry] = []  # a heap by due time
        self._queued = itertools.count()
        self.held: PendingPrompt | None = None  # taken from the queue, waiting for the budget
        self.exhausted = False
        self.in_flight = 0
        self.budget_blocked = False  # no room in the budget at the last look
        self.budget_stop = False
        # The names the target is served under (None: every answer is kept, as extraction's are), and where an
        # answer served by another model goes (the journal's set-aside table): kept, never trained.
        self.served: ServedModels | None = None
        self.on_refused: Callable[[CompletionRequest, Completion, str], None] | None = None
        # (now, answers at stake) -> why the storage has no room for them (`flushing.StorageRoom`), or None.
        self.room: Callable[[float, int], str | None] | None = None

    @property
    def finished(self) -> bool:
        """Nothing left to send or wait for, or stopped by its budget."""
        return self.budget_stop or (
            self.exhausted
            and self.held is None
            and not self.retries
            and not self.followups
            and not self.in_flight
        )

    @property
    def next_retry_at(self) -> float | None:
        return self.retries[0].due if self.retries else None

    def take(self, now: float) -> PendingPrompt | None:
        """The lane's next prompt to send, in the order the module docstring gives; None if none is ready."""
        if self.retries and self.retries[0].due <= now:
            return heapq.heappop(self.retries).pending
        if self.held is not None:
            p, self.held = self.held, None
            return p
        if self.followups:
            self.report.sent += 1
            return self.followups.popleft()
        if self.exhausted:
            return None
        request = next(self.it, None)
        if request is None:
            self.exhausted = True
            return None
        self.report.sent += 1
        return PendingPrompt(request, self)

    def put_back(self, p: PendingPrompt, now: float) -> None:
        """A prompt taken but refused by the budget keeps its place: first in line once the budget has
        room."""
        if p.attempts:
            self.retry_at(p, now)
        else:
            assert self.held is None, "a held request is always taken first (Lane.take)"
            self.held = p

    def retry_at(self, p: PendingPrompt, due: float) -> None:
        heapq.heappush(self.retries, DueRetry(due, next(self._queued), p))

    def release_next_turn(self, request: CompletionRequest, answer: Completion) -> None:
        """An answer in a chain may release the chain's next request, which goes ahead of new prompts."""
        if self.follow is None:
            return
        nxt = self.follow(request, answer)
        if nxt is not None:
            self.followups.append(PendingPrompt(nxt, self))
            self.report.total += 1

    def storage_problem(self, now: float, window: int) -> str | None:
        """Why the lane's answers could not all be stored: what may be in flight (the window) and what is not
        yet written, against the room left where they go."""
        if self.room is None:
            return None
        return self.room(now, max(self.in_flight, window) + self.writer.pending)

    def refuse(self, request: CompletionRequest, answer: Completion) -> InferenceError | None:
        """Why `answer` is not stored as an answer (the error to act on); None when it is the target's."""
        if self.served is None or self.served.accepts(answer.model):
            return None
        why = f"served as {answer.model!r}, not the target (accepted: {self.served.describe()})"
        if self.on_refused is not None:
            self.on_refused(request, answer, why)
        return InferenceError(ErrorKind.FOREIGN_MODEL, why, status=200)

    def record_skipped(self, request_id: str, kind: str, message: str) -> None:
        """A prompt that could not even be turned into a request (e.g. its template fails): a permanent
        failure."""
        self.writer.add_failure(request_id, kind, message, 0, True, None)
        self.report.record_failure(kind, permanent=True)

    def drop_retries(self) -> list[PendingPrompt]:
        """The prompts still waiting to be sent again, taken out of the lane (the run is ending)."""
        waiting = [r.pending for r in self.retries]
        self.retries = []
        return waiting
