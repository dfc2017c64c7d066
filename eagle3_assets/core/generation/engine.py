"""The generation engine: one event loop driving any backend at the concurrency the provider sustains, exactly once,
within budget.

Written once for every backend. One dispatcher sends an attempt whenever three gates are open: the adaptive window
(`limiter.AdaptiveLimit`: how many requests the provider accepts in flight), the budget (`budget.Budget`: room for
what is in flight plus one more) and a prompt to send (retries first, then new prompts in order). Each attempt is
a task; its outcome reopens the gates. Outcomes by kind:

- answer: stored in the journal (flushed every few seconds), fed to the budget's length model and the limiter;
- backpressure (429, 503 + Retry-After, in-flight 402): the limiter narrows, the prompt is sent again after its
  own Retry-After (or a short growing delay), and it costs the prompt nothing: a provider's limit never turns a
  prompt into a failure. Only a provider that says its window is closed for the whole key pauses everyone;
- fault (5xx, reset, timeout, malformed body, an error mid-stream): retried with jittered backoff within the
  prompt's `max_retries`;
- permanent (400, 403, 404, context length): a failure row for that prompt — unless the same error repeats
  `streak_limit` times with no answer in between from a request sent after it began: that is a configuration
  problem (routing, model access, extra_body), so the run stops and those prompts stay retryable;
- our own bug (INTERNAL): recorded, not retried in this run, never permanent;
- bad key, no credits: the run stops at once.

Every attempt is written to the dispatch ledger before it is sent (`ledger.DispatchLedger`), so what a crash
leaves in flight is charged on resume.

One engine serves several datasets at once (`Lane`: a dataset's prompts, budget, journal writer and ledger) inside
one adaptive window: that is how a backfill of B1..B8 rides one key. Why one engine in one process rather than one
run per dataset sharing a limiter across processes: the window is a control loop fed by every refusal and every
answer of the key, and it is exact only where it sees all of them at once; a cross-process limiter would coordinate
through a file or a database on every dispatch and still lag, and eight run processes cost eight interpreter,
Dagster and tokenizer starts on the machine that also drives the requests. In one loop, while one dataset's last long
answers are in flight (or its budget is closing in), the other datasets' prompts take the free slots. Lanes are
served round robin, each within its own budget; a lane whose budget is reached stops alone. A lane may be a set of
chains (`turns: all`): each answer can release the next request of its chain, which goes ahead of new prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .budget import Budget, Ticket
from .journal import JournalWriter
from .ledger import DispatchLedger
from .limiter import AdaptiveLimit
from .protocol import (
    Completion,
    CompletionRequest,
    ErrorKind,
    FatalRunError,
    InferenceBackend,
    InferenceError,
)

FATAL_ADVICE = {
    ErrorKind.AUTH: "the API key was rejected: check the key in the environment variable the config names "
    "(backends.<name>.api_key_env) and that it is active",
    ErrorKind.OUT_OF_CREDITS: "the account is out of credits: add credits (or raise the key's limit), then "
    "materialise again; every response already received is stored and will not be requested again",
}


@dataclass
class EngineSettings:
    max_concurrency: int  # the ceiling; the adaptive window finds what the provider sustains below it
    max_retries: int = 8  # faults per prompt; backpressure does not count
    adaptive: bool = True
    initial_concurrency: int = 64
    flush_interval_s: float = 2.0
    progress_interval_s: float = 10.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    # Re-send delay after a refusal that named no Retry-After: grows per refusal of the same prompt, jittered.
    refused_delay_s: float = 0.5
    refused_delay_max_s: float = 30.0
    # After a stop, requests already in flight get this long to land (they may be paid for).
    fatal_grace_s: float = 5.0
    # After the operator's stop (Terminate), a shorter grace: the operator wants the spending to end now; what is
    # cancelled is charged by the ledger and asked again by the next run.
    terminate_grace_s: float = 2.0
    # This many identical permanent errors with no answer in between stop the run as a configuration problem.
    streak_limit: int = 25
    # A provider that refuses every request this long, with no answer at all, stops the run (prompts retryable).
    stall_timeout_s: float = 900.0


@dataclass
class EngineReport:
    total: int
    sent: int = 0  # prompts sent at least once
    succeeded: int = 0
    failed: int = 0
    permanent_failures: int = 0
    attempts: int = 0
    refused: int = 0  # attempts the provider refused for capacity
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    usage_estimated: int = 0
    errors: Counter = field(default_factory=Counter)
    failure_kinds: Counter = field(default_factory=Counter)
    providers: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    stop_reason: str = "done"  # done | budget | fatal | terminated
    fatal_message: str | None = None
    unanswered: int = 0  # prompts taken from the queue that ended the run with no answer and no failure row
    limit_final: int = 0
    limit_min: int = 0
    limit_max: int = 0
    limit_decreases: int = 0
    global_pauses: int = 0
    max_in_flight: int = 0
    mean_in_flight: float = 0.0  # time-weighted over the run, all lanes together (the key's)
    first_dispatch_s: float | None = None  # seconds from the engine's start to its first request
    first_dispatch_wall: float | None = None  # when it was sent (seconds since the epoch)
    limit_trace: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, window)

    def latency_percentiles(self) -> dict[str, float]:
        if not self.latencies:
            return {}
        xs = sorted(self.latencies)
        pick = lambda q: xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": xs[-1]}

    @property
    def refused_share(self) -> float:
        return self.refused / self.attempts if self.attempts else 0.0

    @property
    def goodput_rps(self) -> float:
        return self.succeeded / self.elapsed_s if self.elapsed_s else 0.0


class _Pending:
    """A prompt being worked on: its request, its lane and what happened to it so far."""

    __slots__ = ("accepted", "attempts", "faults", "lane", "last_error", "refusals", "request")

    def __init__(self, request: CompletionRequest, lane: Lane):
        self.request = request
        self.lane = lane
        self.attempts = 0
        self.faults = 0
        self.refusals = 0
        self.last_error: InferenceError | None = None
        self.accepted = False  # this attempt's first token counted for the window (AdaptiveLimit.on_accepted)


class Lane:
    """One dataset's share of a run: its prompts (in order), its budget, its journal writer and dispatch ledger,
    and its own report. Prompts are pulled lazily; retries wait in the lane's own heap by ready time."""

    def __init__(
        self,
        key: str,
        requests: Iterable[CompletionRequest],
        total: int,
        budget: Budget,
        writer: JournalWriter,
        ledger: DispatchLedger | None = None,
        follow: Callable[[CompletionRequest, Completion], CompletionRequest | None] | None = None,
    ):
        self.key = key
        self.it: Iterator[CompletionRequest] = iter(requests)
        # A chain's next request once an answer lands (the next turn of a conversation, `conversations.Chains`).
        self.follow = follow
        self.followups: deque[_Pending] = deque()
        self.budget = budget
        self.writer = writer
        self.ledger = ledger
        self.report = EngineReport(total=total)
        self.retries: list[tuple[float, int, _Pending]] = []  # heap by ready time
        self.held: _Pending | None = None  # taken from the queue, waiting for the budget
        self.exhausted = False
        self.in_flight = 0
        self.budget_blocked = False  # no room in the budget at the last look
        self.budget_stop = False

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


_DIGITS = re.compile(r"\d+")
# A lane whose budget blocks dispatch once this share of it is committed (spent, or expected from what is in flight)
# and at least CLOSE_OUT_SPENT of it spent sends nothing more (see _dispatch). The spent floor keeps a reservation
# that is still pessimistic (few answers known, a small budget under a wide window) from closing a lane early.
CLOSE_OUT_SHARE = 0.97
CLOSE_OUT_SPENT = 0.9
# Dispatches per pass of the dispatcher (or a sixteenth of the window): answers noticed together (a stream client
# reads in ticks) would otherwise release one large burst, all of it past a provider's cap before its first refusal
# could come back.
BURST = 16
# How often the loop notes that it is free (`_heartbeat`). An answer read long after the last note may have landed
# at any time since: the budget learns its latency as the earliest it could be (see `_attempt`).
TICK_S = 0.01


def _closing_out(budget: Budget) -> bool:
    """Whether a lane whose budget just refused a dispatch, with answers still in flight, sends nothing more."""
    return budget.spent_share() >= CLOSE_OUT_SPENT and budget.committed_share() >= CLOSE_OUT_SHARE


class GenerationEngine:
    """Drives one backend for one or more lanes (datasets) inside one adaptive window."""

    def __init__(
        self,
        backend: InferenceBackend,
        settings: EngineSettings,
        log: Callable[[str], None] = print,
        limiter: AdaptiveLimit | None = None,
    ):
        self.backend = backend
        self.settings = settings
        self.log = log
        self.limiter = limiter or AdaptiveLimit(
            settings.max_concurrency, settings.initial_concurrency, adaptive=settings.adaptive
        )
        self.lanes: list[Lane] = []
        self._stop = asyncio.Event()
        self._closing = asyncio.Event()  # the flush loop ends after the flush it is in, never inside one
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._seq = itertools.count()
        self._turn = 0  # the lane whose turn it is to dispatch next (round robin)
        self._fatal: InferenceError | None = None
        self.terminated = False  # the operator stopped the run (`terminate`)
        self._journal_error: BaseException | None = None
        self._configuration_stop = False
        self._streak_sig: tuple | None = None
        self._streak_ids: list[tuple[Lane, str]] = []
        self._streak_since = 0.0
        self._last_success_at = time.monotonic()
        self._refused_at_last_success = 0
        self._succeeded = self._attempts = self._refused = 0  # all lanes together
        self._recent: deque = deque(maxlen=64)  # (t, succeeded, attempts, refused) for interval rates
        self._first_dispatch_at: float | None = None
        self._first_dispatch_wall: float | None = None
        self._tick = time.monotonic()  # the last time the loop was free (`_heartbeat`)
        # Attempts in flight during the window's first slow start, by dispatch number: each counts for the window
        # at its first streamed token (`_credit_accepted`). None once the ramp is over, or when the backend does
        # not stream (an answer came with no token streamed before it).
        self._ramp: dict[int, tuple[_Pending, tuple[float, int, int]]] | None = (
            {} if self.limiter.adaptive else None
        )

    # -- public ---------------------------------------------------------------------------------------------
    async def run(self, lanes: Sequence[Lane]) -> list[EngineReport]:
        """Answer every lane's prompts; returns the lanes' reports in their order."""
        self.lanes = list(lanes)
        start = time.monotonic()
        self._last_success_at = start
        self.limiter.start_accounting(start)
        flusher = asyncio.create_task(self._flush_loop())
        progress = asyncio.create_task(self._progress_loop(start))
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            await self._dispatch()
            await self._drain()
            if flusher.done() and self._journal_error is None:
                self._journal_error = flusher.exception() or RuntimeError("the journal writer stopped")
        finally:
            # The flush loop is told to stop, not cancelled: a cancel inside a write would put rows that its
            # thread still writes back in the buffer (written twice), or read as a journal failure.
            self._closing.set()
            for t in (progress, heartbeat, *self._tasks):
                t.cancel()
            await asyncio.gather(flusher, progress, heartbeat, *self._tasks, return_exceptions=True)
            self._release_unsent()
            for lane in self.lanes:
                await lane.writer.flush()  # raises if the journal cannot be written: the run fails loudly
            elapsed = time.monotonic() - start
            self._fill_stats(start, elapsed)
        if self._journal_error is not None:
            raise RuntimeError(f"the response journal could not be written: {self._journal_error}") from (
                self._journal_error
            )
        if self._fatal is not None:
            advice = FATAL_ADVICE.get(self._fatal.kind, "")
            message = f"{self._fatal}; {advice}".strip("; ")
            for lane in self.lanes:
                lane.report.stop_reason, lane.report.fatal_message = "fatal", message
        for lane in self.lanes:
            if self._fatal is None and lane.budget_stop:
                lane.report.stop_reason = "budget"
            if self.terminated:
                lane.report.stop_reason = "terminated"
        self._log_progress(start, final=True)
        if self._fatal is not None:
            raise FatalRunError(f"stopped: {self.lanes[0].report.fatal_message}")
        return [lane.report for lane in self.lanes]

    def terminate(self) -> None:
        """The operator's stop: nothing more is sent; what is in flight gets `terminate_grace_s` to land, then is
        cancelled; the journal is flushed as after any stop. Safe to call before `run` (nothing is sent then)."""
        if self.terminated:
            return
        self.terminated = True
        in_flight = sum(lane.in_flight for lane in self.lanes)
        self.log(
            f"terminated by the operator: sending nothing more; {in_flight:,} requests in flight get "
            f"{self.settings.terminate_grace_s:g} s to land, then are cancelled (charged, asked again next run)"
        )
        self._stop.set()
        self._wake.set()

    def record_skipped(self, lane: Lane, request_id: str, kind: str, message: str) -> None:
        """A prompt that could not even be turned into a request (e.g. its template fails): a permanent failure."""
        lane.writer.add_failure(request_id, kind, message, 0, True, None)
        lane.report.failed += 1
        lane.report.permanent_failures += 1
        lane.report.failure_kinds[kind] += 1

    # -- the dispatcher -------------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        limiter = self.limiter
        while not self._stop.is_set():
            now = time.monotonic()
            for lane in self.lanes:
                lane.budget_blocked = False
            burst = max(BURST, limiter.window // 16)
            sent = 0
            while sent < burst and limiter.has_room(now):
                p = self._next(now)
                if p is None:
                    break
                self._launch(p)
                sent += 1
            for lane in self.lanes:
                if (
                    lane.budget_blocked
                    and not lane.budget_stop
                    and (not lane.in_flight or _closing_out(lane.budget))
                ):
                    # Nothing in flight and still no room, or the budget committed to what is in flight: no
                    # trickle of single requests as the last long answers land (they would stretch the run's end
                    # for a fraction of a percent of its budget).
                    lane.budget_stop = True
            if all(lane.finished for lane in self.lanes):
                return  # everything answered, failed or out of budget
            if self._stalled(now):
                return
            if sum(lane.writer.pending for lane in self.lanes) >= 50_000:
                for lane in self.lanes:
                    await lane.writer.flush()
            if sent == burst:
                await asyncio.sleep(0)  # a burst's refusals, if any, get in before the next burst goes out
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._next_timer(now))

    def _next(self, now: float) -> _Pending | None:
        """The next attempt, lanes in turn: a lane's due retries first (they were sent before), then its next new
        prompt; a lane whose budget has no room for one more request is passed over."""
        n = len(self.lanes)
        for i in range(n):
            lane = self.lanes[(self._turn + i) % n]
            if lane.budget_stop or lane.budget_blocked:
                continue
            p = self._candidate(lane, now)
            if p is None:
                continue
            if not lane.budget.can_dispatch():
                self._put_back(p, now)
                lane.budget_blocked = True
                continue
            self._turn = (self._turn + i + 1) % n
            return p
        return None

    def _candidate(self, lane: Lane, now: float) -> _Pending | None:
        if lane.retries and lane.retries[0][0] <= now:
            return heapq.heappop(lane.retries)[2]
        if lane.held is not None:  # first in line already (it waited for the budget): never displaced
            p, lane.held = lane.held, None
            return p
        if lane.followups:  # a conversation's next turn before a new conversation: chains finish, none starve
            lane.report.sent += 1
            return lane.followups.popleft()
        if lane.exhausted:
            return None
        request = next(lane.it, None)
        if request is None:
            lane.exhausted = True
            return None
        lane.report.sent += 1
        return _Pending(request, lane)

    def _put_back(self, p: _Pending, now: float) -> None:
        if p.attempts:
            heapq.heappush(p.lane.retries, (now, next(self._seq), p))
        else:
            assert p.lane.held is None, "a held request is always taken first (_candidate)"
            p.lane.held = p

    def _next_timer(self, now: float) -> float:
        """How long the dispatcher may sleep when nothing wakes it: the next due retry or the end of a pause."""
        timers = [1.0]
        for lane in self.lanes:
            if lane.retries and not lane.budget_blocked:
                timers.append(lane.retries[0][0] - now)
        if self.limiter.paused_until > now:
            timers.append(self.limiter.paused_until - now)
        return max(0.001, min(timers))

    async def _heartbeat(self) -> None:
        while True:
            self._tick = time.monotonic()
            if self._ramp:
                self._credit_accepted()
            await asyncio.sleep(TICK_S)

    def _credit_accepted(self) -> None:
        """While the window ramps from cold: requests whose first token arrived grow it now, not at their answer.
        One pass over the ramp's requests per tick, only until the first limit or the ceiling."""
        limiter = self.limiter
        if not limiter.ramping:
            self._ramp = None
            return
        ramp = self._ramp
        accepted = [seq for seq, (p, _) in ramp.items() if p.request.streamed_tokens]
        for seq in accepted:
            p, token = ramp.pop(seq)
            p.accepted = True
            limiter.on_accepted(token)
        if accepted:
            self._wake.set()

    def _earliest_latency(self, now: float, dispatched_at: float) -> float:
        """The latency the budget learns for an answer read now: as read, unless the loop was held up (its client
        starved of CPU, a long pass over many answers), when the answer may have landed as early as the loop's
        last free moment. The budget conditions on latency (long answers land last), so a short answer read late
        and counted at the time it was read poses as a long one and lowers what the answers still in flight are
        expected to need: at 2000 in flight on a busy machine the budget overshot by 2-3%. The earliest time errs
        the other way, on the budget's safe side."""
        earliest = self._tick + TICK_S
        return now - dispatched_at if now <= earliest else max(earliest - dispatched_at, 0.001)

    def _launch(self, p: _Pending) -> None:
        lane = p.lane
        p.attempts += 1
        p.request.streamed_tokens = 0
        lane.report.attempts += 1
        self._attempts += 1
        ticket = lane.budget.open(p.request)
        token = self.limiter.on_dispatch()
        lane.in_flight += 1
        p.accepted = False
        if self._ramp is not None:
            self._ramp[token[1]] = (p, token)
        if self._first_dispatch_at is None:
            self._first_dispatch_at, self._first_dispatch_wall = token[0], time.time()
        if lane.ledger is not None:
            lane.ledger.sent(p.request.id)
        task = asyncio.create_task(self._attempt(p, ticket, token))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one attempt ----------------------------------------------------------------------------------------
    async def _attempt(self, p: _Pending, ticket: Ticket, token: tuple[float, int, int]) -> None:
        lane = p.lane
        dispatched_at = token[0]
        try:
            c = await self.backend.complete(p.request)
        except asyncio.CancelledError:
            # Stopped while in flight: it may be billed, so no `unbilled` line; the ledger charges it.
            lane.budget.settle(ticket, None, None)
            self.limiter.on_done()
            raise
        except InferenceError as e:
            lane.budget.settle(ticket, None, None)
            if lane.ledger is not None:
                lane.ledger.unbilled(p.request.id)
            self._on_error(p, e, token)
        except Exception as e:  # a bug while handling an answer must not kill its siblings; it was paid for
            lane.budget.settle(ticket, None, None)
            self.limiter.on_done()
            err = InferenceError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")
            lane.report.errors[err.kind.value] += 1
            self._fail(p, err)
            self._count_streak(p, err, dispatched_at)
        else:
            learned = c.latency_s  # where the backend timed the answer itself
            if not learned:
                now = time.monotonic()
                c.latency_s, learned = now - dispatched_at, self._earliest_latency(now, dispatched_at)
            lane.budget.settle(ticket, c.completion_tokens, c.cost_usd, learned)
            self.limiter.on_success(token, grow=not p.accepted)
            if self._ramp is not None and not p.request.streamed_tokens:
                self._ramp = None  # answers come whole: acceptance cannot be seen, the ramp rides on answers
            self._succeed(p, c, dispatched_at)
        finally:
            lane.in_flight -= 1
            if self._ramp is not None:
                self._ramp.pop(token[1], None)
            self._wake.set()

    def _succeed(self, p: _Pending, c: Completion, dispatched_at: float) -> None:
        r = p.lane.report
        p.lane.writer.add_completion(p.request.id, c)
        if p.lane.follow is not None:
            nxt = p.lane.follow(p.request, c)
            if nxt is not None:
                p.lane.followups.append(_Pending(nxt, p.lane))
                r.total += 1
        r.succeeded += 1
        r.prompt_tokens += c.prompt_tokens
        r.completion_tokens += c.completion_tokens
        r.cost_usd += c.cost_usd or 0.0
        r.usage_estimated += c.usage_estimated
        r.providers[c.provider or self.backend.name] += 1
        r.finish_reasons[c.finish_reason] += 1
        r.latencies.append(c.latency_s)
        self._succeeded += 1
        self._last_success_at = time.monotonic()
        self._refused_at_last_success = self._refused
        if self._streak_sig is not None and dispatched_at >= self._streak_since:
            self._streak_sig, self._streak_ids = None, []

    def _on_error(self, p: _Pending, e: InferenceError, token: tuple[float, int, int]) -> None:
        r = p.lane.report
        r.errors[e.kind.value] += 1
        p.last_error = e
        now = time.monotonic()
        if e.kind.fatal:
            self.limiter.on_done()
            if self._fatal is None:
                self._fatal = e
                self.log(f"fatal error, stopping the run: {e}")
            self._stop.set()
            self._fail(p, e, permanent=False)
            return
        if e.backpressure:
            self.limiter.on_refused(token)
            r.refused += 1
            self._refused += 1
            if e.pause_all_s:
                self.limiter.pause_all(now + e.pause_all_s)
            p.refusals += 1
            delay = e.retry_after if e.retry_after is not None else self._refused_delay(p.refusals)
            heapq.heappush(p.lane.retries, (now + delay, next(self._seq), p))
            return
        if e.kind is ErrorKind.OVERLOADED:
            self.limiter.on_refused(token)  # overloaded without a Retry-After: narrow, and count a fault
        else:
            self.limiter.on_done()
        if e.kind.retryable:
            p.faults += 1
            if p.faults > self.settings.max_retries:
                self._fail(p, e, permanent=False)
                return
            delay = e.retry_after if e.retry_after is not None else self._backoff(p.faults)
            heapq.heappush(p.lane.retries, (now + delay, next(self._seq), p))
            return
        self._fail(p, e, permanent=e.kind.permanent)
        self._count_streak(p, e, token[0])

    def _fail(self, p: _Pending, e: InferenceError, permanent: bool = False) -> None:
        permanent = permanent and not self._configuration_stop
        r = p.lane.report
        p.lane.writer.add_failure(p.request.id, e.kind.value, e.message, p.attempts, permanent, e.status)
        r.failed += 1
        r.failure_kinds[e.kind.value] += 1
        if permanent:
            r.permanent_failures += 1

    def _count_streak(self, p: _Pending, e: InferenceError, dispatched_at: float) -> None:
        """Identical permanent errors with no answer in between (from a request sent after they began) are a
        configuration problem, not bad prompts: stop, and leave those prompts retryable. Counted across lanes:
        they share the backend and its configuration."""
        if e.kind is ErrorKind.CONTEXT_LENGTH:
            return  # a property of each prompt
        sig = (e.kind, e.status, _DIGITS.sub("#", e.message)[:200])
        if sig != self._streak_sig:
            self._streak_sig, self._streak_ids, self._streak_since = sig, [], dispatched_at
        self._streak_ids.append((p.lane, p.request.id))
        if len(self._streak_ids) < self.settings.streak_limit or self._configuration_stop:
            return
        n = len(self._streak_ids)
        self._configuration_stop = True
        if self._fatal is None:
            self._fatal = InferenceError(
                e.kind,
                f"{n} requests in a row failed the same way ({e.message}); this looks like a configuration "
                "problem (model access, provider routing, extra_body, key permissions), not bad prompts. Fix it "
                "and materialise again: these prompts are not marked permanent and will be sent again",
                status=e.status,
            )
            self.log(f"stopping the run: {self._fatal}")
        self._stop.set()
        for lane, rid in self._streak_ids:
            lane.writer.add_failure(
                rid, e.kind.value, "not permanent: the whole run failed the same way", 0, False, e.status
            )
            if e.kind.permanent:
                lane.report.permanent_failures -= 1

    def _stalled(self, now: float) -> bool:
        idle = now - self._last_success_at
        if idle < self.settings.stall_timeout_s or self._refused == self._refused_at_last_success:
            return False
        self._fatal = InferenceError(
            ErrorKind.RATE_LIMITED,
            f"the provider refused every request for {idle:.0f} s (rate limit or capacity) and answered none; "
            "no prompt is marked failed: materialise again later, or lower max_concurrency",
        )
        self._stop.set()
        return True

    async def _drain(self) -> None:
        """After a stop, requests in flight get a short grace to land, then are cancelled."""
        if not self._tasks:
            return
        if self._stop.is_set():
            grace = self.settings.terminate_grace_s if self.terminated else self.settings.fatal_grace_s
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        else:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _release_unsent(self) -> None:
        """Prompts waiting for a retry when the run stops keep their last error, as a retryable failure."""
        for lane in self.lanes:
            for _, _, p in lane.retries:
                e = p.last_error or InferenceError(ErrorKind.SERVER, "stopped before a retry")
                if e.backpressure:
                    lane.report.unanswered += 1  # refused for capacity only: nothing is wrong with the prompt
                    continue
                self._fail(p, e, permanent=False)
            lane.retries = []

    def _refused_delay(self, refusals: int) -> float:
        cap = min(self.settings.refused_delay_max_s, self.settings.refused_delay_s * 1.5 ** (refusals - 1))
        return random.uniform(cap / 2, cap * 1.5)

    def _backoff(self, attempt: int) -> float:
        """Jittered exponential backoff in [cap/4, cap], cap = min(max, base·2^(attempt-1)): no retry waves."""
        cap = min(self.settings.backoff_max_s, self.settings.backoff_base_s * 2 ** (attempt - 1))
        return random.uniform(cap / 4, cap)

    # -- background tasks -----------------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while not self._closing.is_set():
            try:
                await asyncio.wait_for(self._closing.wait(), self.settings.flush_interval_s)
                return  # closing: the run's final flush follows
            except TimeoutError:
                pass
            try:
                for lane in self.lanes:
                    await lane.writer.flush()
            except BaseException as e:
                # Answers that cannot be stored must not be bought: stop sending.
                self._journal_error = e
                self._stop.set()
                self._wake.set()
                raise

    async def _progress_loop(self, start: float) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            self._log_progress(start)

    def _fill_stats(self, start: float, elapsed: float) -> None:
        """The key's window and in-flight figures, the same in every lane's report (the lanes share them)."""
        lim = self.limiter
        trace = [int(w) for _, w in lim.stats.limit_trace] or [lim.window]
        mean_in_flight = lim.mean_in_flight(time.monotonic())
        first = None if self._first_dispatch_at is None else self._first_dispatch_at - start
        for lane in self.lanes:
            r = lane.report
            r.elapsed_s = elapsed
            r.limit_final, r.limit_min, r.limit_max = lim.window, min(trace), max(trace)
            r.limit_decreases, r.global_pauses = lim.stats.decreases, lim.stats.global_pauses
            r.max_in_flight = lim.stats.max_in_flight
            r.mean_in_flight = mean_in_flight
            r.first_dispatch_s = first
            r.first_dispatch_wall = self._first_dispatch_wall
            r.limit_trace = [(t, int(w)) for t, w in lim.stats.limit_trace]

    def _log_progress(self, start: float, final: bool = False) -> None:
        lanes = self.lanes
        now = time.monotonic()
        elapsed = max(now - start, 1e-9)
        total = sum(lane.report.total for lane in lanes)
        ok = sum(lane.report.succeeded for lane in lanes)
        failed = sum(lane.report.failed for lane in lanes)
        tokens = sum(lane.report.completion_tokens for lane in lanes)
        cost = sum(lane.report.cost_usd for lane in lanes)
        errors: Counter = sum((lane.report.errors for lane in lanes), Counter())
        self._recent.append((now, self._succeeded, self._attempts, self._refused))
        t0, s0, a0, f0 = self._recent[0] if len(self._recent) > 1 else (start, 0, 0, 0)
        span = max(now - t0, 1e-9)
        goodput = (self._succeeded - s0) / span if not final else self._succeeded / elapsed
        refused = (
            (self._refused - f0) / max(self._attempts - a0, 1)
            if not final
            else self._refused / max(self._attempts, 1)
        )
        eta = "-"
        if goodput > 0 and not final:
            eta_s = (total - ok - failed) / goodput
            eta = f"{eta_s / 60:.1f} min" if eta_s < 7200 else f"{eta_s / 3600:.1f} h"
        head = "finished" if final else "progress"
        budgets = (
            lanes[0].budget.describe()
            if len(lanes) == 1
            else "; ".join(f"{lane.key} {lane.budget.describe()}" for lane in lanes)
        )
        self.log(
            f"{head}: {ok + failed:,}/{total:,} done ({ok:,} ok, {failed:,} failed), "
            f"goodput {goodput:.1f} answers/s, {tokens / elapsed:,.0f} tok/s, ${cost:,.4f}, "
            f"in flight {self.limiter.in_flight}, {self.limiter.describe()}, refused {refused:.1%}, "
            f"budget {budgets}, errors: {', '.join(f'{k} {v}' for k, v in errors.most_common()) or 'none'}"
            + ("" if final else f", ETA {eta}")
            + (
                f", key-wide pauses {self.limiter.stats.global_pauses}"
                if self.limiter.stats.global_pauses
                else ""
            )
        )
