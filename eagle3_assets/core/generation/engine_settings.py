"""The engine's settings, apart from the engine: the scheduler and the run read them too, and a module of
their own keeps those imports one way (no circle through the engine)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineSettings:
    max_concurrency: int  # the ceiling; the adaptive window finds what the provider sustains below it
    max_retries: int = 8  # faults per prompt; backpressure does not count
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
    # After the operator's stop (Terminate), a shorter grace: the operator wants the spending to end at once;
    # what is cancelled is charged by the ledger and asked again by the next run.
    terminate_grace_s: float = 2.0
    # This many identical permanent errors with no answer in between stop the run as a configuration problem.
    streak_limit: int = 25
    # A provider that refuses every request this long, with no answer at all, stops the run (prompts
    # retryable).
    stall_timeout_s: float = 900.0
