"""responses: answer every prompt of a dataset that has no stored answer yet, within its budget.

Resume is by id: whatever any earlier run or backend stored counts, so switching backends halfway through a
dataset is the normal case. Only one process may generate for a dataset at a time (a lock in its folder).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import polars as pl

from ...config import DatasetConfig
from ..storage.layout import DatasetLayout
from ..target.chat import ChatTokenizer, TemplateError
from .budget import Budget, PriorUsage
from .engine import EngineReport, EngineSettings, GenerationEngine
from .journal import JournalWriter, ResponseJournal
from .ledger import DispatchLedger
from .protocol import CompletionRequest, InferenceBackend, Sampling

PROMPT_CHUNK = 1024


class PreflightError(RuntimeError):
    """The run would fail or waste money; nothing was sent. Each line names a fix."""


@dataclass
class GenerationPlan:
    """One run over one dataset: its section of eagle3.yaml and what the launch chose."""

    key: str
    dataset: DatasetConfig
    sampling: Sampling
    retry_permanent_failures: bool = False
    limit: int | None = None  # answer at most this many prompts in this run


@dataclass
class GenerationSummary:
    key: str
    backend: str
    n_prompts: int
    already_done: int
    skipped_permanent: int
    todo: int
    prior: PriorUsage
    report: EngineReport | None
    n_responses: int
    n_failures: int
    stop_reason: str
    run_id: str
    lost_in_flight: int = 0  # requests bought and never stored (a crash, or a stop's cancelled stragglers)


def _requests(
    prompts: pl.DataFrame,
    plan: GenerationPlan,
    chat: ChatTokenizer | None,
    skip: Callable[[str, str, str], None],
) -> Iterator[CompletionRequest]:
    """Requests in source order; prompt ids are rendered lazily, a chunk at a time, when the backend needs them."""
    for start in range(0, prompts.height, PROMPT_CHUNK):
        chunk = prompts.slice(start, PROMPT_CHUNK)
        ids = chunk["id"].to_list()
        messages = chunk["messages"].to_list()
        rendered = chat.prompt_ids(messages) if chat is not None else [None] * len(ids)
        for pid, msgs, prompt_ids in zip(ids, messages, rendered, strict=True):
            if isinstance(prompt_ids, TemplateError):
                skip(pid, "template", str(prompt_ids))
                continue
            yield CompletionRequest(pid, msgs, plan.dataset.max_tokens, plan.sampling, prompt_ids)


def generate_responses(
    layout: DatasetLayout,
    plan: GenerationPlan,
    backend: InferenceBackend,
    chat: ChatTokenizer,
    settings: EngineSettings,
    log: Callable[[str], None] = print,
    extra_preflight: list[str] | None = None,
    lock: Callable[[str], AbstractContextManager] | None = None,
    on_flush: Callable[[], None] | None = None,
) -> GenerationSummary:
    """`lock(what)`: one generating process per dataset (default: a file lock in its folder). `on_flush`: called
    after every journal flush (an object-store root pushes the new parts at once)."""
    prompts = pl.read_parquet(layout.prompts, columns=["id", "messages"])
    journal = ResponseJournal(layout)
    run_id = uuid.uuid4().hex[:12]
    lock = lock or journal.responses.exclusive
    with lock(f"generation for dataset {plan.key}"):
        journal.finalize()  # fold what a crashed run left behind
        prior = journal.prior_usage()
        budget = Budget.for_dataset(plan.dataset, prior)
        lost_before = _settle(journal, budget)  # requests a crashed run had in flight: bought, never stored
        if lost_before:
            log(
                f"{plan.key}: {lost_before:,} requests were in flight when an earlier run died; charged "
                f"{budget.expected_tokens():,.0f} tokens each to the budget (they were probably billed)"
            )
        done = journal.done_ids()
        skip = set() if plan.retry_permanent_failures else journal.permanent_failure_ids() - done
        todo = prompts.filter(~pl.col("id").is_in(pl.Series(list(done | skip), dtype=pl.String).implode()))
        if plan.limit is not None:
            todo = todo.head(plan.limit)
        summary = GenerationSummary(
            key=plan.key,
            backend=backend.name,
            n_prompts=prompts.height,
            already_done=len(done & set(prompts["id"])),
            skipped_permanent=len(skip),
            todo=todo.height,
            prior=prior,
            report=None,
            n_responses=len(done),
            n_failures=0,
            stop_reason="done",
            run_id=run_id,
            lost_in_flight=lost_before,
        )
        if todo.height == 0:
            log(
                f"{plan.key}: all {prompts.height:,} prompts are answered or permanently failed; nothing to send"
            )
        elif not budget.can_dispatch():
            summary.stop_reason = "budget"
            log(f"{plan.key}: budget reached ({budget.describe()}); {todo.height:,} prompts stay unanswered")
        else:
            log(
                f"{plan.key}: {todo.height:,} of {prompts.height:,} prompts to answer with {backend.name} "
                f"({len(done):,} answered before; budget {budget.describe()})"
            )
            writer = JournalWriter(journal, backend.name, run_id, on_flush=on_flush)
            ledger = journal.ledger(run_id)
            try:
                summary.report = asyncio.run(
                    _run_engine(
                        backend,
                        writer,
                        budget,
                        ledger,
                        settings,
                        todo,
                        plan,
                        chat,
                        log,
                        extra_preflight or [],
                    )
                )
            finally:  # also after a fatal stop: what was paid for is compacted into the table now
                ledger.close()
                summary.lost_in_flight += _settle(journal, budget)
                summary.n_responses, summary.n_failures = journal.finalize()
            summary.stop_reason = summary.report.stop_reason
            return summary
        summary.n_responses, summary.n_failures = journal.finalize()
    return summary


def _settle(journal: ResponseJournal, budget: Budget) -> int:
    """Charge the budget for what runs bought and never stored; how many requests that was."""
    tokens = budget.expected_tokens()
    lost = journal.settle_ledgers(tokens, budget.estimated_usd(tokens))
    budget.charge(lost.tokens, lost.usd)
    return lost.requests


async def _run_engine(
    backend: InferenceBackend,
    writer: JournalWriter,
    budget: Budget,
    ledger: DispatchLedger,
    settings: EngineSettings,
    todo: pl.DataFrame,
    plan: GenerationPlan,
    chat: ChatTokenizer,
    log: Callable[[str], None],
    extra_preflight: list[str],
) -> EngineReport:
    started = time.monotonic()
    problems = list(extra_preflight) + await backend.preflight()
    if problems:
        await backend.close()
        raise PreflightError("preflight failed, nothing was sent:\n- " + "\n- ".join(problems))
    try:
        await backend.start()
        log(f"{plan.key}: {backend.name} ready in {time.monotonic() - started:.1f}s")
        engine = GenerationEngine(
            backend, writer, budget, settings, log=lambda m: log(f"{plan.key}: {m}"), ledger=ledger
        )
        requests = _requests(todo, plan, chat if backend.wants_prompt_ids else None, engine.record_skipped)
        return await engine.run(requests, total=todo.height)
    finally:
        await backend.close()
