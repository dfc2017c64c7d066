"""The generation engine: one event loop driving any backend at the concurrency the provider sustains, exactly
once, within budget.

Written once for every backend. One dispatcher sends an attempt whenever three gates are open: the adaptive
window (`limiter.AdaptiveLimit`: how many requests the provider accepts in flight), the budget
(`budget.Budget`: room for what is in flight plus one more) and a prompt to send (retries first, then new
prompts in order). Each attempt is a task; its outcome reopens the gates. Outcomes by kind:

- answer: stored in the journal (flushed every few seconds), fed to the budget's length model and the limiter;
- backpressure (429, 503 + Retry-After, in-flight 402): the limiter narrows, the prompt is sent again after
  its own Retry-After (or a short growing delay), and it costs the prompt nothing: a provider's limit never
  turns a prompt into a failure. Only a provider that says its window is closed for the whole key pauses
  everyone;
- fault (5xx, reset, timeout, malformed body, an error mid-stream): retried with jittered backoff within the
  prompt's `max_retries`;
- permanent (400, 403, 404, context length): a failure row for that prompt — unless the same error repeats
  `streak_limit` times with no answer in between from a request sent after it began: that is a configuration
  problem (routing, model access, extra_body), so the run stops and those prompts stay retryable (`guards`);
- our own bug (INTERNAL): recorded, not retried in this run, never permanent;
- an answer served by another model than the target: paid for, set aside (never stored as an answer), asked
  again within the fault allowance; a streak of them stops the run;
- bad key, no credits, no room left where answers are stored: the run stops at once.

Every attempt is written to the dispatch ledger before it is sent (`ledger.DispatchLedger`), so what a crash
leaves in flight is charged on resume.

The engine owns its parts, each with its own why: `scheduler.LaneScheduler` (which prompt next, retry timing,
when a lane closes out), `ramp.FirstTokenRamp` (the cold window grows on first tokens),
`heartbeat.LoopHeartbeat` (answers read late are timed early), `guards` (a streak of identical errors or a
stall stops the run) and `report.RunProgress` (the progress line and the key-wide figures of every report).

One engine serves several datasets at once (`lanes.Lane`: a dataset's prompts, budget, journal writer and
ledger) inside one adaptive window: that is how a backfill of B1..B8 rides one key. Why one engine in one
process rather than one run per dataset sharing a limiter across processes: the window is a control loop fed
by every refusal and every answer of the key, and it is exact only where it sees all of them at once; a
cross-process limiter would coordinate through a file or a database on every dispatch and still lag, and eight
run processes cost eight interpreter, Dagster and tokenizer starts on the machine that also drives the
requests. In one loop, while one dataset's last long answers are in flight (or its budget is closing in), the
other datasets' prompts take the free slots. Lanes are served round robin, each within its own budget; a lane
whose budget is reached stops alone. A lane may be a set of chains (`turns: all`): each answer can release the
next request of its chain, which goes ahead of new prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from .budget import Ticket
from .engine_settings import EngineSettings
from .flushing import JournalFlusher, flush_all
from .guards import ConfigurationStreak, StallWatch
from .heartbeat import TICK_S, LoopHeartbeat
from .lanes import Lane, PendingPrompt
from .limiter import AdaptiveLimit, DispatchToken
from .progress_report import EngineReport, RunProgress
from .protocol import (
    Completion,
    ErrorKind,
    FatalRunError,
    InferenceBackend,
    InferenceError,
)
from .ramp import FirstTokenRamp
from .scheduler import LaneScheduler

FATAL_ADVICE = {
    ErrorKind.AUTH: "the API key was rejected: check the key in the environment variable the config names "
    "(backends.<name>.api_key_env) and that it is active",
    ErrorKind.OUT_OF_CREDITS: "the account is out of credits: add credits (or raise the key's limit), then "
    "materialise again; every response already received is stored and will not be requested again",
    ErrorKind.PROXY: "the HTTP proxy refused the connection: fix HTTPS_PROXY / HTTP_PROXY (address, user, "
    "password) or list the host in NO_PROXY, then materialise again",
}


class GenerationEngine:
    """Drives one backend for one or more lanes (datasets) inside one adaptive window. `clock` is the
    monotonic clock the window, the guards and the latencies read (the event loop's own clock, in tests on
    virtual time)."""

    def __init__(
        self,
        backend: InferenceBackend,
        settings: EngineSettings,
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.backend = backend
        self.settings = settings
        self.log = log
        self.clock = clock
        self.limiter = AdaptiveLimit(settings.max_concurrency, settings.initial_concurrency, clock=clock)
        self.lanes: list[Lane] = []
        self.scheduler = LaneScheduler(self.lanes, settings)
        self.ramp = FirstTokenRamp(self.limiter)
        self.heartbeat = LoopHeartbeat(clock)
        self.streak = ConfigurationStreak(settings.streak_limit)
        self.stall = StallWatch(settings.stall_timeout_s, clock())
        self.progress = RunProgress()
        self.flusher = JournalFlusher(settings.flush_interval_s, on_failure=self._halt)
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._fatal: InferenceError | None = None
        self.terminated = False  # the operator stopped the run (`terminate`)

    # -- public ---------------------------------------------------------------------------------------------
    async def run(self, lanes: Sequence[Lane]) -> list[EngineReport]:
        """Answer every lane's prompts; returns the lanes' reports in their order."""
        self.lanes = list(lanes)
        self.scheduler = LaneScheduler(self.lanes, self.settings)
        start = self.clock()
        self.stall.restart(start)
        self.limiter.start_accounting(start)
        flushing = asyncio.create_task(self.flusher.loop(self.lanes))
        helpers = [asyncio.create_task(self._progress_loop(start)), asyncio.create_task(self._heartbeat())]
        try:
            await self._dispatch()
            await self._drain()
            self.flusher.check(flushing)
        finally:
            await self._wind_down(flushing, helpers, start)
        if (error := self.flusher.error) is not None:
            raise RuntimeError(f"the response journal could not be written: {error}") from error
        self._set_stop_reasons()
        self.log(self.progress.line(self.lanes, self.limiter, start, self.clock(), final=True))
        if self._fatal is not None:
            raise FatalRunError(f"stopped: {self.lanes[0].report.fatal_message}")
        return [lane.report for lane in self.lanes]

    def terminate(self) -> None:
        """The operator's stop: nothing more is sent; what is in flight gets `terminate_grace_s` to land, then
        is cancelled; the journal is flushed as after any stop. Safe to call before `run` (nothing is sent
        then)."""
        if self.terminated:
            return
        self.terminated = True
        in_flight = sum(lane.in_flight for lane in self.lanes)
        self.log(
            f"terminated by the operator: sending nothing more; {in_flight:,} requests in flight get "
            f"{self.settings.terminate_grace_s:g} s to land, then are cancelled (charged, asked again next "
            "run)"
        )
        self._halt()

    def _halt(self) -> None:
        """Send nothing more (the dispatcher wakes to see it)."""
        self._stop.set()
        self._wake.set()

    # -- the run's end --------------------------------------------------------------------------------------
    async def _wind_down(self, flushing: asyncio.Task, helpers: list[asyncio.Task], start: float) -> None:
        self.flusher.close()  # told to stop, never cancelled (`flushing`)
        for t in (*helpers, *self._tasks):
            t.cancel()
        await asyncio.gather(flushing, *helpers, *self._tasks, return_exceptions=True)
        self._release_unsent()
        await flush_all(self.lanes)  # raises if the journal cannot be written: the run fails loudly
        now = self.clock()
        self.progress.fill_reports(self.lanes, self.limiter, start, now, now - start)

    def _set_stop_reasons(self) -> None:
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

    async def _drain(self) -> None:
        """After a stop, requests in flight get a short grace to land, then are cancelled."""
        if not self._tasks:
            return
        if self._stop.is_set():
            grace = self.settings.terminate_grace_s if self.terminated else self.settings.fatal_grace_s
            if self.flusher.error is not None:
                grace = 0.0  # nothing can be stored: every answer still streaming in is cut off now
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        else:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _release_unsent(self) -> None:
        """Prompts waiting for a retry when the run stops keep their last error, as a retryable failure."""
        for lane in self.lanes:
            for p in lane.drop_retries():
                e = p.last_error or InferenceError(ErrorKind.SERVER, "stopped before a retry")
                if e.backpressure:
                    lane.report.unanswered += 1  # refused for capacity only: nothing is wrong with the prompt
                    continue
                self._fail(p, e, permanent=False)

    # -- the dispatcher -------------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        limiter, scheduler = self.limiter, self.scheduler
        while not self._stop.is_set():
            now = self.clock()
            if self._no_room(now):
                return
            scheduler.start_pass()
            burst = scheduler.burst(limiter.window)
            sent = 0
            while sent < burst and limiter.has_room(now):
                p = scheduler.next(now)
                if p is None:
                    break
                self._launch(p)
                sent += 1
            scheduler.stop_blocked_lanes()
            if scheduler.finished or self._stalled(now):
                return
            await self.flusher.flush_backlog(self.lanes)
            if sent == burst:
                await asyncio.sleep(0)  # a burst's refusals, if any, get in before the next burst goes out
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), scheduler.next_timer(now, limiter.paused_until))

    def _no_room(self, now: float) -> bool:
        """The storage cannot take what is at stake: stop buying before a write fails."""
        for lane in self.lanes:
            problem = lane.storage_problem(now, self.limiter.window)
            if problem is not None:
                self._stop_run(
                    InferenceError(ErrorKind.STORAGE, f"{lane.key}: {problem}"), "stopping the run"
                )
                return True
        return False

    def _stalled(self, now: float) -> bool:
        error = self.stall.stalled(now, self.progress.refused)
        if error is None:
            return False
        self._fatal = error
        self._stop.set()
        return True

    def _launch(self, p: PendingPrompt) -> None:
        lane = p.lane
        p.attempts += 1
        p.request.streamed_tokens = 0
        lane.report.attempts += 1
        ticket = lane.budget.open(p.request)
        p.token = self.limiter.on_dispatch()
        p.accepted = False
        self.progress.on_dispatch(p.token.sent_at)
        lane.in_flight += 1
        self.ramp.track(p)
        if lane.ledger is not None:
            lane.ledger.sent(p.request.id)
        task = asyncio.create_task(self._attempt(p, ticket, p.token))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one attempt ----------------------------------------------------------------------------------------
    async def _attempt(self, p: PendingPrompt, ticket: Ticket, token: DispatchToken) -> None:
        lane = p.lane
        try:
            c = await self.backend.complete(p.request)
        except asyncio.CancelledError:
            # Stopped while in flight: it may be billed, so no `unbilled` line; the ledger charges it.
            lane.budget.settle(ticket, None, None)
            self.limiter.on_done()
            raise
        except InferenceError as e:
            lane.budget.settle(ticket, e.billed_tokens, None)
            if lane.ledger is not None and e.billed_tokens is None:
                lane.ledger.unbilled(p.request.id)
            self._on_error(p, e, token)
        except Exception as e:  # a bug while handling an answer must not kill its siblings; it was paid for
            lane.budget.settle(ticket, None, None)
            self.limiter.on_done()
            err = InferenceError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")
            lane.report.errors[err.kind.value] += 1
            self._fail(p, err)
            self._count_streak(p, err, token.sent_at)
        else:
            defect = c.defect(p.request)
            if defect is not None:
                # Nothing the draft could learn from, or a call the template cannot render as written: storing
                # it would close the prompt for good. Charged, and asked again like any fault.
                lane.budget.settle(ticket, c.charged_tokens, c.cost_usd)
                fault = InferenceError(ErrorKind.MALFORMED, defect, billed_tokens=c.charged_tokens)
                self._on_error(p, fault, token)
                return
            learned = c.latency_s  # where the backend timed the answer itself
            if not learned:
                now = self.clock()
                c.latency_s, learned = (
                    now - token.sent_at,
                    self.heartbeat.latency_to_learn(now, token.sent_at),
                )
            lane.budget.settle(ticket, c.charged_tokens, c.cost_usd, learned)
            self.limiter.on_success(token, grow=not p.accepted)
            self.ramp.on_answer(p)
            c.prompt_fingerprint = p.request.fingerprint
            refused = lane.refuse(p.request, c)
            if refused is None:
                self._succeed(p, c, token.sent_at)
            else:
                self._on_refused_answer(p, refused, token.sent_at)
        finally:
            lane.in_flight -= 1
            self.ramp.on_end(token)
            self._wake.set()

    def _succeed(self, p: PendingPrompt, c: Completion, dispatched_at: float) -> None:
        lane = p.lane
        lane.writer.add_completion(p.request.id, c)
        lane.release_next_turn(p.request, c)
        lane.report.record_answer(c, self.backend.name)
        self.progress.succeeded += 1
        self.stall.on_answer(self.clock(), self.progress.refused)
        self.streak.on_answer(dispatched_at)

    def _on_refused_answer(self, p: PendingPrompt, e: InferenceError, dispatched_at: float) -> None:
        """An answer that is not the target's (the lane set it aside): paid for, never stored as an answer.
        Not asked again in this run (each try would be paid for; the next run asks again, by when routing or
        the config may be fixed): a retryable failure row. A streak of them stops the run as a configuration
        problem."""
        r = p.lane.report
        r.errors[e.kind.value] += 1
        r.refused_answers += 1
        p.last_error = e
        self._fail(p, e, permanent=False)
        self._count_streak(p, e, dispatched_at)

    def _on_error(self, p: PendingPrompt, e: InferenceError, token: DispatchToken) -> None:
        r = p.lane.report
        r.errors[e.kind.value] += 1
        p.last_error = e
        now = self.clock()
        if e.kind.fatal:
            self.limiter.on_done()
            self._stop_run(e, "fatal error, stopping the run")
            self._fail(p, e, permanent=False)
            return
        if e.backpressure:
            self.limiter.on_refused(token)
            r.refused += 1
            self.progress.refused += 1
            if e.pause_all_s:
                self.limiter.pause_all(now + e.pause_all_s)
            p.refusals += 1
            self.scheduler.retry_refused(p, e.retry_after, now)
            return
        if e.kind is ErrorKind.OVERLOADED:
            self.limiter.on_refused(token)  # overloaded without a Retry-After: narrow, and count a fault
        else:
            self.limiter.on_done()
        if e.kind.retryable:
            p.faults += 1
            if p.faults > self.settings.max_retries:
                self._fail(p, e, permanent=False)
            else:
                self.scheduler.retry_faulted(p, e.retry_after, now)
            return
        self._fail(p, e, permanent=e.kind.permanent)
        self._count_streak(p, e, token.sent_at)

    def _stop_run(self, e: InferenceError, announce: str) -> None:
        """Stop sending; the first reason given is the one reported."""
        if self._fatal is None:
            self._fatal = e
            self.log(f"{announce}: {e}")
        self._stop.set()

    def _fail(self, p: PendingPrompt, e: InferenceError, permanent: bool = False) -> None:
        permanent = permanent and not self.streak.tripped
        p.lane.writer.add_failure(p.request.id, e.kind.value, e.message, p.attempts, permanent, e.status)
        p.lane.report.record_failure(e.kind.value, permanent)

    def _count_streak(self, p: PendingPrompt, e: InferenceError, dispatched_at: float) -> None:
        """A streak long enough stops the run, and its prompts stay retryable (`guards`)."""
        if not self.streak.count(p, e, dispatched_at):
            return
        self._stop_run(self.streak.error(e), "stopping the run")
        if e.kind is ErrorKind.FOREIGN_MODEL:
            return  # each has its failure row already, retryable
        for q in self.streak.members:
            q.lane.writer.add_failure(
                q.request.id,
                e.kind.value,
                "not permanent: the whole run failed the same way",
                0,
                False,
                e.status,
            )
            if e.kind.permanent:
                q.lane.report.permanent_failures -= 1

    # -- background tasks -----------------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        while True:
            self.heartbeat.beat()
            if self.ramp.credit():
                self._wake.set()
            await asyncio.sleep(TICK_S)

    async def _progress_loop(self, start: float) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            self.log(self.progress.line(self.lanes, self.limiter, start, self.clock(), final=False))
