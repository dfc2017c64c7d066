"""responses: answer every prompt of a dataset that has no standing answer yet, within its budget.

Resume is by id and by what was asked: whatever any earlier run or backend stored counts while it still
answers the prompt as it stands (`binding`), so switching backends halfway through a dataset is the normal
case, and a prompt edited in the source is asked again. Answers that no longer stand (an edited or removed
prompt, changed settings, another model) are set aside before anything is sent, and set-aside answers that fit
their prompt again come back. The partition's answers belong to one target (`identity`): a run for another
refuses before any request unless it starts a fresh answer set. Only one process may generate for a dataset at
a time (a lock in its folder).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field

import polars as pl

from ...config import DatasetConfig
from ..prompts.fingerprints import request_fingerprint
from ..prompts.ingest import read_prompts
from ..prompts.tools import RowTools
from ..storage.layout import DatasetLayout
from ..storage.tables import BusyError
from ..target_model.chat import ChatTokenizer, TemplateError
from ..target_model.tool_render import tools_of
from .binding import TARGET_CHANGED, AnswerRules, AsideReason, Standing, standing_answers
from .budget import Budget, PriorUsage
from .conversations import Chain, Chains, assistant_slots, split_turn_id, stored_turn_answers, turn_id
from .engine import GenerationEngine
from .engine_settings import EngineSettings
from .flushing import StorageRoom
from .identity import TargetIdentity, read_identity, refusal, write_identity
from .journal import JournalWriter, ResponseJournal, SetAside
from .lanes import Lane
from .progress_report import EngineReport
from .protocol import CompletionRequest, InferenceBackend, Sampling
from .stopping import run_loop

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
    # What stored answers must match to stand, from the project config (`AnswerRules.from_config`); None: a
    # plan written in code, held to the dataset's sampling and the backend's own served names.
    rules: AnswerRules | None = None
    # The target the config names (`identity`); None: not recorded (a plan written in code).
    target: TargetIdentity | None = None
    fresh_answers: bool = False  # the target changed: set the earlier answers aside and start afresh

    def rules_for(self, backend: InferenceBackend) -> AnswerRules:
        if self.rules is not None:
            return self.rules
        return AnswerRules.for_backend(self.dataset.turns, self.sampling, backend.name, backend.served)


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
    busy: str | None = None  # why the dataset was skipped: another process is generating it
    # Damaged journal files set aside (core.storage.quarantine); the answers they held are asked again.
    set_aside: SetAside | None = None
    # Stored answers set aside before this run sent anything (edited or removed prompts, changed settings,
    # another model, an earlier target), by reason; and answers set aside earlier that fit their prompt again.
    answers_set_aside: dict[str, int] = field(default_factory=dict)
    answers_restored: int = 0
    answers_unbound: int = 0  # stored before answers carried fingerprints: kept as they are


def _requests(
    prompts: pl.DataFrame,
    plan: GenerationPlan,
    chat: ChatTokenizer | None,
    skip: Callable[[str, str, str], None],
) -> Iterator[CompletionRequest]:
    """Requests in source order; prompt ids are rendered lazily, a chunk at a time, when the backend needs
    them."""
    for start in range(0, prompts.height, PROMPT_CHUNK):
        chunk = prompts.slice(start, PROMPT_CHUNK)
        ids = chunk["id"].to_list()
        messages = chunk["messages"].to_list()
        offered = RowTools.of(chunk)
        tools = [tools_of(t) for t in offered.tools]
        rendered = chat.prompt_ids(messages, tools) if chat is not None else [None] * len(ids)
        for i, (pid, msgs, prompt_ids) in enumerate(zip(ids, messages, rendered, strict=True)):
            if isinstance(prompt_ids, TemplateError):
                skip(pid, "template", str(prompt_ids))
                continue
            yield CompletionRequest(
                pid,
                msgs,
                plan.dataset.max_tokens,
                plan.sampling,
                prompt_ids,
                fingerprint=request_fingerprint(msgs, offered.tools[i], offered.tool_choice[i]),
                tools=tools[i],
                tool_choice=offered.choice(i),
            )


@dataclass
class DatasetJob:
    """One dataset of a generation run: where its files are, what the launch chose, its lock and flush
    hook."""

    layout: DatasetLayout
    plan: GenerationPlan
    # `lock(what)`: one generating process per dataset (default: a file lock in its folder).
    lock: Callable[[str], AbstractContextManager] | None = None
    # Called after every journal flush (an object-store root pushes the new parts at once).
    on_flush: Callable[[], None] | None = None


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
    """One dataset: `generate_datasets` with a single job."""
    job = DatasetJob(layout, plan, lock, on_flush)
    return generate_datasets([job], backend, chat, settings, log, extra_preflight)[plan.key]


@dataclass
class _Prepared:
    job: DatasetJob
    journal: ResponseJournal
    budget: Budget
    summary: GenerationSummary
    todo: pl.DataFrame
    chains: list[Chain] | None = (
        None  # turns: all: the conversations with a turn left, with their stored answers
    )


def generate_datasets(
    jobs: Sequence[DatasetJob],
    backend: InferenceBackend,
    chat: ChatTokenizer,
    settings: EngineSettings,
    log: Callable[[str], None] = print,
    extra_preflight: list[str] | None = None,
) -> dict[str, GenerationSummary]:
    """Answer the prompts of every dataset of `jobs` through one engine and one adaptive window, each within
    its own budget, journal and lock. A dataset another process is generating is skipped with that reason (the
    others go on); when every one is, the BusyError is raised."""
    run_id = uuid.uuid4().hex[:12]
    summaries: dict[str, GenerationSummary] = {}
    refused = [why for job in jobs if (why := _target_refusal(job, backend)) is not None]
    if refused:
        raise PreflightError("\n".join(refused))
    with ExitStack() as stack:
        ready: list[_Prepared] = []  # datasets with prompts to send and room in their budget
        idle: list[_Prepared] = []  # nothing to send, or no room: their tables are folded all the same
        busy: list[BusyError] = []
        # One message for every dataset's state: under Dagster each message is a write to the event log, and
        # eight of them would add a tenth of a second before the first request.
        notes: list[str] = []
        try:
            for job in jobs:
                journal = ResponseJournal(job.layout)
                lock = job.lock or journal.responses.exclusive
                try:
                    stack.enter_context(lock(f"generation for dataset {job.plan.key}"))
                except BusyError as e:
                    busy.append(e)
                    notes.append(f"{job.plan.key}: skipped, {e}")
                    summaries[job.plan.key] = _busy_summary(job, backend, run_id, str(e))
                    continue
                prepared = _prepare(job, journal, backend, run_id, notes.append)
                summaries[job.plan.key] = prepared.summary
                if prepared.summary.stop_reason == "done" and prepared.todo.height:
                    ready.append(prepared)
                else:
                    idle.append(prepared)
        finally:
            if notes:
                log("\n".join(notes))
        if busy and len(busy) == len(jobs):
            raise busy[0]
        if ready:
            lanes: list[Lane] = []
            try:
                _run(ready, lanes, backend, chat, settings, log, extra_preflight or [], run_id)
            finally:  # also after a fatal stop: what was paid for is compacted into the table here
                # Each dataset in its own folder, folded side by side (parquet reads and writes release the
                # GIL): the run's end waits for the slowest dataset, not for their sum.
                built: list[Lane | None] = [*lanes, *[None] * (len(ready) - len(lanes))]
                with ThreadPoolExecutor(max_workers=min(len(ready), 8)) as pool:
                    list(pool.map(_close, ready, built))
        for prepared in idle:
            _close(prepared, None)
    return summaries


def _close(prepared: _Prepared, lane: Lane | None) -> None:
    """After a run (or its failure): what it bought and never stored is charged, its parts fold into the
    tables. A dataset that sent nothing (no lane) only has its tables folded."""
    s = prepared.summary
    if lane is not None:
        if lane.ledger is not None:
            lane.ledger.close()
        s.report = lane.report
        s.lost_in_flight += _settle(prepared.journal, prepared.budget)
    s.n_responses, s.n_failures = prepared.journal.finalize()
    s.set_aside = prepared.journal.set_aside()
    if s.report is not None:
        s.stop_reason = s.report.stop_reason


def _prepare(
    job: DatasetJob,
    journal: ResponseJournal,
    backend: InferenceBackend,
    run_id: str,
    log: Callable[[str], None],
) -> _Prepared:
    """With the dataset's lock held: fold what a crashed run left, charge what it had in flight, and find what
    is left to send within the budget."""
    plan = job.plan
    prompts = read_prompts(job.layout.prompts)
    journal.finalize()  # fold what a crashed run left behind (and set damaged files aside)
    aside = journal.set_aside()
    if aside.files:
        log(f"{plan.key}: {aside.describe()}: " + "; ".join(q.describe() for q in aside.files))
    moved = _record_target(job, journal, backend.name, log)
    standing = _bind_stored_answers(prompts, journal, plan.rules_for(backend))
    for kind, n in standing.counts().items():
        moved[kind] = moved.get(kind, 0) + n
    if moved or standing.restore:
        log(f"{plan.key}: {_describe_binding(moved, len(standing.restore))}")
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
    chains = None
    if plan.dataset.turns == "all":
        todo, chains, done, skip = _open_chains(prompts, journal, done, skip)
    else:
        todo = prompts.filter(~pl.col("id").is_in(pl.Series(list(done | skip), dtype=pl.String).implode()))
    if plan.limit is not None:
        todo = todo.head(plan.limit)
        if chains is not None:
            chains = chains[: plan.limit]
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
        set_aside=aside,
        answers_set_aside=moved,
        answers_restored=len(standing.restore),
        answers_unbound=standing.unbound,
    )
    if todo.height == 0:
        log(f"{plan.key}: all {prompts.height:,} prompts are answered or permanently failed; nothing to send")
    elif not budget.can_dispatch():
        summary.stop_reason = "budget"
        log(f"{plan.key}: budget reached ({budget.describe()}); {todo.height:,} prompts stay unanswered")
    else:
        log(
            f"{plan.key}: {todo.height:,} of {prompts.height:,} prompts to answer with {backend.name} "
            f"({len(done):,} answered before; budget {budget.describe()})"
        )
    return _Prepared(job, journal, budget, summary, todo, chains)


def _target_refusal(job: DatasetJob, backend: InferenceBackend) -> str | None:
    """Why this run may not answer the dataset: its answers belong to another target (and no fresh answer set
    was asked for). Read without the lock: nothing is written here."""
    current = job.plan.target
    if current is None or job.plan.fresh_answers:
        return None
    recorded = read_identity(job.layout.target_identity)
    if recorded is None:
        return None
    conflicts = recorded.conflicts(current, backend.name)
    if not conflicts or not ResponseJournal(job.layout).responses.files():
        return None  # the same target, or nothing stored to mix with
    return refusal(job.plan.key, recorded, current, conflicts)


def _record_target(
    job: DatasetJob, journal: ResponseJournal, backend: str, log: Callable[[str], None]
) -> dict[str, int]:
    """With the lock held: record the target the partition's answers belong to. A fresh answer set for
    another target first sets every stored answer aside (and forgets the failures). Returns what was set
    aside, by reason."""
    current = job.plan.target
    if current is None:
        return {}
    path = job.layout.target_identity
    recorded = read_identity(path)
    stored = journal.done_ids()
    conflicts = recorded.conflicts(current, backend) if recorded is not None else []
    if recorded is None or (conflicts and not stored):
        write_identity(path, current.fresh(backend))
        return {}
    if not conflicts:
        joined = recorded.joined(current, backend)
        if joined != recorded:
            write_identity(path, joined)
        return {}
    # A fresh answer set (`_target_refusal` let it through only so).
    why = AsideReason(TARGET_CHANGED, f"answers of {recorded.name()}, before a fresh answer set")
    n = journal.set_answers_aside(dict.fromkeys(stored, why))
    failures = journal.clear_failures()
    write_identity(path, current.fresh(backend))
    log(
        f"{job.plan.key}: fresh answer set for {current.name()}: {n:,} answers of {recorded.name()} set "
        f"aside (kept in set_aside/, never trained), {failures:,} failure rows forgotten"
    )
    return {TARGET_CHANGED: n}


def _bind_stored_answers(prompts: pl.DataFrame, journal: ResponseJournal, rules: AnswerRules) -> Standing:
    """Set aside the stored answers that no longer answer their prompt as it stands, and bring back set-aside
    answers that do again. Call with the dataset's lock held."""
    text = rules.turns == "all"  # a turn's history is its earlier answers
    standing = standing_answers(prompts, journal.stored_answers(text), rules, journal.aside_answers(text))
    journal.set_answers_aside(standing.aside)
    journal.restore_answers(standing.restore)
    return standing


def _describe_binding(moved: dict[str, int], restored: int) -> str:
    parts = [f"{n:,} {kind.replace('_', ' ')}" for kind, n in sorted(moved.items())]
    out = f"answers set aside before sending (kept, never trained): {', '.join(parts)}" if parts else ""
    if restored:
        out += ("; " if out else "") + f"{restored:,} set-aside answers fit their prompt again and are back"
    return out


def _open_chains(
    prompts: pl.DataFrame, journal: ResponseJournal, done: set[str], skip: set[str]
) -> tuple[pl.DataFrame, list[Chain], set[str], set[str]]:
    """turns: all. A conversation is done when every turn is stored, ended when a turn failed for good (later
    turns would depend on it); any other continues after its last stored turn, with the stored answers as its
    history. Returns the conversations left, their chains, and done/skip as conversation ids."""
    stored: dict[str, set[int]] = {}
    for rid in done:
        parsed = split_turn_id(rid)
        if parsed is not None:
            stored.setdefault(parsed[0], set()).add(parsed[1])
    failed = {p[0] for rid in skip if (p := split_turn_id(rid)) is not None}
    answers = stored_turn_answers(journal.responses, [rid for rid in done if split_turn_id(rid) is not None])
    chains: list[Chain] = []
    done_convs: set[str] = set()
    keep: list[bool] = []
    offered = RowTools.of(prompts)
    for i, (cid, messages) in enumerate(
        zip(prompts["id"].to_list(), prompts["messages"].to_list(), strict=True)
    ):
        n = len(assistant_slots(messages))
        have = stored.get(cid, set())
        k = 0
        while k + 1 in have:
            k += 1
        if k >= n:
            done_convs.add(cid)
        if k >= n or cid in failed:
            keep.append(False)
            continue
        history = [answers[turn_id(cid, j)] for j in range(1, k + 1)]
        chain = Chain(cid, messages, history, offered.tools[i], offered.tool_choice[i])
        chains.append(chain)
        keep.append(True)
    todo = prompts.filter(pl.Series(keep, dtype=pl.Boolean))
    return todo, chains, done_convs, failed - done_convs


def _busy_summary(job: DatasetJob, backend: InferenceBackend, run_id: str, why: str) -> GenerationSummary:
    from .budget import CostFit, LengthHistory

    return GenerationSummary(
        key=job.plan.key,
        backend=backend.name,
        n_prompts=0,
        already_done=0,
        skipped_permanent=0,
        todo=0,
        prior=PriorUsage(0, 0, 0.0, LengthHistory(), CostFit()),
        report=None,
        n_responses=0,
        n_failures=0,
        stop_reason="busy",
        run_id=run_id,
        busy=why,
    )


def _settle(journal: ResponseJournal, budget: Budget) -> int:
    """Charge the budget for what runs bought and never stored; how many requests that was."""
    tokens = budget.expected_tokens()
    lost = journal.settle_ledgers(tokens, budget.estimated_usd(tokens))
    budget.charge(lost.tokens, lost.usd)
    return lost.requests


def _run(
    ready: list[_Prepared],
    lanes: list[Lane],
    backend: InferenceBackend,
    chat: ChatTokenizer,
    settings: EngineSettings,
    log: Callable[[str], None],
    extra_preflight: list[str],
    run_id: str,
) -> None:
    """Build a lane per dataset (appended to `lanes` as they are made, for the caller's cleanup) and run
    them."""
    engine = GenerationEngine(backend, settings, log=log if len(ready) > 1 else _prefixed(log, ready[0]))
    for prepared in ready:
        job = prepared.job
        rules = job.plan.rules_for(backend)
        writer = JournalWriter(
            prepared.journal,
            backend.name,
            run_id,
            on_flush=job.on_flush,
            settings_fingerprint=rules.settings.get(backend.name),
        )
        lane = Lane(
            job.plan.key,
            (),
            prepared.todo.height,
            prepared.budget,
            writer,
            prepared.journal.ledger(run_id),
        )
        lane.served = rules.served.get(backend.name)
        lane.on_refused = writer.add_refused
        room = _storage_room(prepared.journal, job.plan.dataset.max_tokens)
        lane.room = lambda now, at_stake, w=writer, r=room: r.problem(
            now, at_stake, (w.rows_written, w.bytes_written)
        )
        skip = lane.record_skipped
        if prepared.chains is not None:
            chains = Chains(
                prepared.chains,
                job.plan.dataset.max_tokens,
                job.plan.sampling,
                _render_one(chat) if backend.wants_prompt_ids else None,
                skip,
                keep_reasoning=chat.template_has_reasoning,
            )
            lane.follow = chains.follow
            lane.it = chains.first_requests()
        else:
            lane.it = iter(
                _requests(prepared.todo, job.plan, chat if backend.wants_prompt_ids else None, skip)
            )
        lanes.append(lane)
    run_loop(_run_engine(engine, lanes, backend, log, extra_preflight), on_stop=engine.terminate)


def _storage_room(journal: ResponseJournal, max_tokens: int) -> StorageRoom:
    """The room check of a dataset's journal, sized by what its stored answers take so far (an answer of
    `max_tokens` at 4 bytes a token where none is stored yet)."""
    files = journal.responses.files()
    rows = journal.responses.row_count()[0] if files else 0
    size = sum(f.stat().st_size for f in files)
    return StorageRoom(journal.layout.dir, size / rows if rows else 4.0 * max_tokens + 512)


def _render_one(chat: ChatTokenizer) -> Callable[[list[dict], list[dict] | None], list[int] | Exception]:
    def render(messages: list[dict], tools: list[dict] | None) -> list[int] | Exception:
        out = chat.prompt_ids([messages], [tools])[0]
        return out if isinstance(out, Exception) else list(out)

    return render


def _prefixed(log: Callable[[str], None], prepared: _Prepared) -> Callable[[str], None]:
    key = prepared.job.plan.key
    return lambda m: log(f"{key}: {m}")


async def _run_engine(
    engine: GenerationEngine,
    lanes: list[Lane],
    backend: InferenceBackend,
    log: Callable[[str], None],
    extra_preflight: list[str],
) -> None:
    started = time.monotonic()
    problems = list(extra_preflight) + await backend.preflight()
    if problems:
        await backend.close()
        raise PreflightError("preflight failed, nothing was sent:\n- " + "\n- ".join(problems))
    try:
        if engine.terminated:  # stopped during the preflight: nothing is sent
            return
        await backend.start()
        names = ", ".join(lane.key for lane in lanes)
        log(f"{names}: {backend.name} ready in {time.monotonic() - started:.1f}s")
        await engine.run(lanes)
    finally:
        await backend.close()
