"""The policies the adaptive engine is compared with, over the same HTTP client and error classification.

- `fixed`: a fixed pool without adaptive concurrency: `concurrency` workers, each with one request in
  flight; a 429/503 sets a cool-down shared by every worker (its Retry-After, else jittered backoff) and
  counts against the prompt's retries like any fault; a prompt out of retries is left unanswered.
- `pause10`: the common client (curator and others): any 429 pauses every worker for a fixed 10 s; up to 10
  retries.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable

from eagle3_assets.core.generation.protocol import (
    CompletionRequest,
    ErrorKind,
    InferenceBackend,
    InferenceError,
)


class BaselineReport:
    def __init__(self) -> None:
        self.succeeded = 0
        self.attempts = 0
        self.refused = 0
        self.unanswered = 0


async def run_fixed(
    backend: InferenceBackend,
    requests: Iterable[CompletionRequest],
    concurrency: int,
    max_retries: int = 8,
    pause_on_429_s: float | None = None,
    deadline_s: float = 120.0,
) -> BaselineReport:
    """`pause_on_429_s` None: today's policy (shared cool-down from Retry-After or backoff); a number:
    pause10."""
    report = BaselineReport()
    it = iter(requests)
    resume_at = 0.0
    end = time.monotonic() + deadline_s

    async def worker() -> None:
        nonlocal resume_at
        for request in it:
            attempt = 0
            while True:
                if time.monotonic() > end:
                    report.unanswered += 1
                    break
                while (left := resume_at - time.monotonic()) > 0:
                    await asyncio.sleep(left + random.uniform(0, 0.25))
                attempt += 1
                report.attempts += 1
                try:
                    await backend.complete(request)
                except InferenceError as e:
                    limited = e.kind in (ErrorKind.RATE_LIMITED, ErrorKind.OVERLOADED)
                    report.refused += limited
                    if not e.kind.retryable or attempt > max_retries:
                        report.unanswered += 1
                        break
                    if pause_on_429_s is not None:
                        if limited:
                            resume_at = max(resume_at, time.monotonic() + pause_on_429_s)
                        else:
                            await asyncio.sleep(random.uniform(0.25, 1.0) * min(60, 2 ** (attempt - 1)))
                        continue
                    cap = min(60.0, 2 ** (attempt - 1))
                    delay = e.retry_after if e.retry_after is not None else random.uniform(cap / 4, cap)
                    if limited:
                        resume_at = max(resume_at, time.monotonic() + delay)
                    else:
                        await asyncio.sleep(delay)
                    continue
                report.succeeded += 1
                break

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return report
