"""The generation engine: one event loop driving any backend at high concurrency, exactly once, within budget.

Written once for every backend. `max_concurrency` worker coroutines pull requests from one iterator; each holds at
most one request in flight. Per error kind: retry with backoff (shared cool-down for rate limits), record a
permanent failure, or stop the run. Results go to the journal as they arrive and are flushed every few seconds.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from .budget import Budget
from .journal import JournalWriter
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
    max_concurrency: int
    max_retries: int = 8
    flush_interval_s: float = 2.0
    progress_interval_s: float = 10.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    # After a fatal error, requests already in flight get this long to land (they may be paid for).
    fatal_grace_s: float = 5.0
    # This many permanent errors before any success stop the run as a configuration problem.
    systematic_error_after: int = 25


@dataclass
class EngineReport:
    total: int
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    permanent_failures: int = 0
    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    errors: Counter = field(default_factory=Counter)
    failure_kinds: Counter = field(default_factory=Counter)
    providers: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    stop_reason: str = "done"  # done | budget | fatal
    fatal_message: str | None = None

    def latency_percentiles(self) -> dict[str, float]:
        if not self.latencies:
            return {}
        xs = sorted(self.latencies)
        pick = lambda q: xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": xs[-1]}


class _CoolDown:
    """A shared pause: when the provider says slow down, every worker waits, not just the one that was told."""

    def __init__(self) -> None:
        self.resume_at = 0.0
        self.triggered = 0

    def extend(self, delay: float) -> None:
        self.triggered += 1
        self.resume_at = max(self.resume_at, time.monotonic() + delay)

    async def wait(self) -> None:
        while (left := self.resume_at - time.monotonic()) > 0:
            await asyncio.sleep(left + random.uniform(0, min(0.25, left)))  # spread the restart


class GenerationEngine:
    def __init__(
        self,
        backend: InferenceBackend,
        writer: JournalWriter,
        budget: Budget,
        settings: EngineSettings,
        log: Callable[[str], None] = print,
    ):
        self.backend = backend
        self.writer = writer
        self.budget = budget
        self.settings = settings
        self.log = log
        self._stop = asyncio.Event()
        self._budget_changed = asyncio.Condition()
        self._cooldown = _CoolDown()
        self._fatal: InferenceError | None = None
        self._budget_stop = False
        self._budget_waiters = 0
        self._journal_error: BaseException | None = None
        self._unconfirmed: list[str] = []  # permanent failures seen before the first success
        self._configuration_stop = False
        self.report = EngineReport(total=0)

    # -- public ---------------------------------------------------------------------------------------------
    async def run(self, requests: Iterable[CompletionRequest], total: int) -> EngineReport:
        report = self.report
        report.total = total
        it = iter(requests)
        start = time.monotonic()
        workers = [
            asyncio.create_task(self._worker(it))
            for _ in range(max(1, min(self.settings.max_concurrency, total)))
        ]
        flusher = asyncio.create_task(self._flush_loop())
        progress = asyncio.create_task(self._progress_loop(start))
        stop_wait = asyncio.create_task(self._stop.wait())
        try:
            pending = set(workers)
            while pending:
                _, pending = await asyncio.wait(
                    pending | {stop_wait, flusher}, return_when=asyncio.FIRST_COMPLETED
                )
                pending -= {stop_wait, flusher}
                if flusher.done() and self._journal_error is None:
                    # Answers that cannot be stored must not be bought: stop sending.
                    self._journal_error = flusher.exception() or RuntimeError("the journal writer stopped")
                    self._stop.set()
                if self._stop.is_set():
                    # Nothing new is sent; requests in flight get a short grace to land, then are cancelled.
                    if pending:
                        _, pending = await asyncio.wait(pending, timeout=self.settings.fatal_grace_s)
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    pending = set()
            for t in workers:
                if t.done() and not t.cancelled() and t.exception():
                    raise t.exception()
        finally:
            for t in (flusher, progress, stop_wait, *workers):
                t.cancel()
            await asyncio.gather(flusher, progress, stop_wait, *workers, return_exceptions=True)
            await self.writer.flush()  # raises if the journal cannot be written: the run fails loudly
            report.elapsed_s = time.monotonic() - start
        if self._journal_error is not None:
            raise RuntimeError(f"the response journal could not be written: {self._journal_error}") from (
                self._journal_error
            )
        if self._fatal is not None:
            report.stop_reason = "fatal"
            advice = FATAL_ADVICE.get(self._fatal.kind, "")
            report.fatal_message = f"{self._fatal}; {advice}".strip("; ")
        elif self._budget_stop:
            report.stop_reason = "budget"
        self._log_progress(start, final=True)
        if self._fatal is not None:
            raise FatalRunError(f"stopped: {report.fatal_message}")
        return report

    def record_skipped(self, request_id: str, kind: str, message: str) -> None:
        """A prompt that could not even be turned into a request (e.g. its template fails): a permanent failure."""
        self.writer.add_failure(request_id, kind, message, 0, True, None)
        self.report.failed += 1
        self.report.permanent_failures += 1
        self.report.failure_kinds[kind] += 1

    # -- workers --------------------------------------------------------------------------------------------
    async def _worker(self, it: Iterator[CompletionRequest]) -> None:
        while not self._stop.is_set():
            # Fast paths first: at 2000 requests in flight, every await per request shows in the CPU profile.
            if self._cooldown.resume_at > time.monotonic():
                await self._cooldown.wait()
            if not self.budget.can_dispatch() and not await self._wait_for_budget():
                return
            if self._stop.is_set():
                return
            request = next(it, None)
            if request is None:
                return
            self.budget.dispatch()
            self.report.sent += 1
            tokens: int | None = None
            cost: float | None = None
            try:
                completion = await self._complete_with_retries(request)
                if completion is not None:
                    tokens, cost = completion.completion_tokens, completion.cost_usd
            finally:
                self.budget.settle(tokens, cost)
                if self._budget_waiters:
                    async with self._budget_changed:
                        self._budget_changed.notify_all()
            if self.writer.pending >= 50_000:
                await self.writer.flush()

    async def _wait_for_budget(self) -> bool:
        """Wait until the budget allows one more request; False when it never will."""
        async with self._budget_changed:
            while not self.budget.can_dispatch():
                if self.budget.in_flight == 0 or self._stop.is_set():
                    if not self._stop.is_set():
                        self._budget_stop = True
                    return False
                self._budget_waiters += 1
                try:
                    await self._budget_changed.wait()
                finally:
                    self._budget_waiters -= 1
        return True

    async def _complete_with_retries(self, request: CompletionRequest) -> Completion | None:
        attempts = 0
        r = self.report
        while True:
            attempts += 1
            r.attempts += 1
            t0 = time.monotonic()
            try:
                c = await self.backend.complete(request)
            except InferenceError as e:
                r.errors[e.kind.value] += 1
                if e.kind.fatal:
                    if self._fatal is None:
                        self._fatal = e
                        self.log(f"fatal error, stopping the run: {e}")
                    self._stop.set()
                    self._fail(request, e, attempts, permanent=False)
                    return None
                if not e.kind.retryable or attempts > self.settings.max_retries:
                    self._fail(request, e, attempts, permanent=not e.kind.retryable)
                    return None
                delay = e.retry_after if e.retry_after is not None else self._backoff(attempts)
                if e.kind.slows_everyone:
                    self._cooldown.extend(delay)
                    await self._cooldown.wait()
                else:
                    await asyncio.sleep(delay)
                if self._stop.is_set():
                    self._fail(request, e, attempts, permanent=False)
                    return None
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug while handling a response must not kill 2000 siblings
                err = InferenceError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")
                r.errors[err.kind.value] += 1
                self._fail(request, err, attempts, permanent=True)
                return None
            c.latency_s = c.latency_s or (time.monotonic() - t0)
            self.writer.add_completion(request.id, c)
            r.succeeded += 1
            self._unconfirmed.clear()
            r.prompt_tokens += c.prompt_tokens
            r.completion_tokens += c.completion_tokens
            r.cost_usd += c.cost_usd or 0.0
            r.providers[c.provider or self.backend.name] += 1
            r.finish_reasons[c.finish_reason] += 1
            r.latencies.append(c.latency_s)
            return c

    def _fail(self, request: CompletionRequest, e: InferenceError, attempts: int, permanent: bool) -> None:
        suspect = (
            permanent and e.kind in (ErrorKind.BAD_REQUEST, ErrorKind.INTERNAL) and self.report.succeeded == 0
        )
        if suspect and self._configuration_stop:
            permanent = (
                False  # landed after the stop for a configuration problem: retry it once that is fixed
            )
        self.writer.add_failure(request.id, e.kind.value, e.message, attempts, permanent, e.status)
        self.report.failed += 1
        self.report.failure_kinds[e.kind.value] += 1
        if permanent:
            self.report.permanent_failures += 1
            if suspect:
                self._suspect_configuration(request.id, e)

    def _suspect_configuration(self, request_id: str, e: InferenceError) -> None:
        """Many permanent errors before any success mean a bad configuration (model access, provider, extra_body),
        not bad prompts: stop, and leave those prompts retryable so a fixed configuration sends them again."""
        self._unconfirmed.append(request_id)
        if len(self._unconfirmed) < self.settings.systematic_error_after or self._fatal is not None:
            return
        n = len(self._unconfirmed)
        self._fatal = InferenceError(
            e.kind,
            f"the first {n} requests all failed permanently ({e.message}); this looks like a configuration "
            "problem (model access, provider routing, extra_body, key permissions), not bad prompts. Fix it and "
            "materialise again: these prompts are not marked permanent and will be sent again",
            status=e.status,
        )
        self.log(f"stopping the run: {self._fatal}")
        self._configuration_stop = True
        self._stop.set()
        for rid in self._unconfirmed:
            self.writer.add_failure(
                rid, e.kind.value, "not permanent: the whole run failed the same way", 0, False, e.status
            )

    def _backoff(self, attempt: int) -> float:
        """Jittered exponential backoff in [cap/4, cap], cap = min(max, base·2^(attempt-1)): no retry waves."""
        cap = min(self.settings.backoff_max_s, self.settings.backoff_base_s * 2 ** (attempt - 1))
        return random.uniform(cap / 4, cap)

    # -- background tasks -----------------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.flush_interval_s)
            await self.writer.flush()

    async def _progress_loop(self, start: float) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            self._log_progress(start)

    def _log_progress(self, start: float, final: bool = False) -> None:
        r = self.report
        elapsed = max(time.monotonic() - start, 1e-9)
        done = r.succeeded + r.failed
        rate = done / elapsed
        eta = "-"
        if rate > 0 and not final:
            left = r.total - done
            eta_s = left / rate
            eta = f"{eta_s / 60:.1f} min" if eta_s < 7200 else f"{eta_s / 3600:.1f} h"
        errors = ", ".join(f"{k} {v}" for k, v in r.errors.most_common()) or "none"
        head = "finished" if final else "progress"
        self.log(
            f"{head}: {done:,}/{r.total:,} done ({r.succeeded:,} ok, {r.failed:,} failed), "
            f"{rate:.1f} req/s, {r.completion_tokens / elapsed:,.0f} tok/s, ${r.cost_usd:,.4f}, "
            f"in flight {self.budget.in_flight}, budget {self.budget.describe()}, errors: {errors}"
            + ("" if final else f", ETA {eta}")
            + (f", cool-downs {self._cooldown.triggered}" if self._cooldown.triggered else "")
        )
