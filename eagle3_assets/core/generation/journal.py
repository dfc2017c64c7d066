"""The response journal of one dataset: what is done, what failed, and a buffered writer for a running
engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl

from ..prompts.ingest import read_prompts
from ..storage.layout import DatasetLayout
from ..storage.quarantine import Quarantined, sweep_parquet
from ..storage.tables import (
    FAILURE_SCHEMA,
    IMPORT_REJECTED_SCHEMA,
    RESPONSE_SCHEMA,
    SET_ASIDE_SCHEMA,
    JournalTable,
    empty_columns,
)
from ..target_model.tool_calls import calls_json
from .binding import FOREIGN_MODEL, STANDING_COLUMNS, AnswerRules, AsideReason, Standing, standing_answers
from .budget import CostFit, LengthHistory, PriorUsage
from .ledger import LOST_SCHEMA, DispatchLedger, bought_and_unstored, lost_rows
from .protocol import Completion, CompletionRequest


@dataclass(frozen=True)
class LostCharge:
    """What requests bought and never stored cost, for the caller to charge to its budget."""

    requests: int = 0
    tokens: float = 0.0
    usd: float = 0.0


# The columns a part cannot do without (older parts may lack the others; readers add them as nulls).
RESPONSE_REQUIRED = ("id", "content", "finish_reason", "completion_tokens")
FAILURE_REQUIRED = ("id", "error_kind", "permanent")
LOST_REQUIRED = ("run_id", "estimated_tokens", "estimated_usd")
ASIDE_REQUIRED = ("id", "aside_key", "aside_reason", "completion_tokens")
TEXT_COLUMNS = ("content", "reasoning", "tool_calls")  # what only a `turns: all` history needs of an answer
STAGE = "responses"  # the quarantine folder of what the journal sets aside


@dataclass
class SetAside:
    """What the journal found damaged and set aside in this object's lifetime (for the stage's metadata)."""

    files: list[Quarantined]
    answers: int  # answers the set-aside response parts held (from their tally): asked again
    answers_unknown: int  # response parts no tally knew (their prompts are asked again all the same)
    charged_tokens: float  # completion tokens charged to the budget for answers paid and lost
    charged_usd: float

    def describe(self) -> str:
        if not self.files:
            return "nothing"
        unknown = f" (+{self.answers_unknown} parts of unknown size)" if self.answers_unknown else ""
        return (
            f"{len(self.files)} damaged files set aside; {self.answers:,} answers they held are asked again"
            f"{unknown}; {self.charged_tokens:,.0f} tokens they cost stay charged to the budget"
        )


class ResponseJournal:
    """The responses, failures and dispatch ledgers of one dataset (their folders are its layout's)."""

    def __init__(self, layout: DatasetLayout):
        self.layout = layout
        tally = layout.journal_dir  # what each part held, kept where the parts are not (`JournalTable.sweep`)
        self.responses = JournalTable(
            layout.responses_dir,
            RESPONSE_SCHEMA,
            required=RESPONSE_REQUIRED,
            tally_file=tally / "tally-responses.json",
            tally=("completion_tokens", "cost_usd"),
        )
        self.failures = JournalTable(
            layout.failures_dir,
            FAILURE_SCHEMA,
            required=FAILURE_REQUIRED,
            tally_file=tally / "tally-failures.json",
        )
        self.ledger_dir = layout.journal_dir
        self.lost = JournalTable(
            layout.lost_dir,
            LOST_SCHEMA,
            required=LOST_REQUIRED,
            tally_file=tally / "tally-lost.json",
            tally=("estimated_tokens", "estimated_usd"),
        )
        # Answers that are not trained (edited or removed prompts, another model, an earlier target): kept.
        self.aside = JournalTable(
            layout.set_aside_dir,
            SET_ASIDE_SCHEMA,
            key="aside_key",
            required=ASIDE_REQUIRED,
            tally_file=tally / "tally-aside.json",
            tally=("completion_tokens", "cost_usd"),
        )
        self.quarantined: list[Quarantined] = []  # what `sweep` set aside so far
        self._charged = [0.0, 0.0]

    # -- damaged files
    # ----------------------------------------------------------------------------------------
    def sweep(self) -> list[Quarantined]:
        """Set aside every journal file that cannot be read (responses, failures, lost charges, import
        rejects), before anything reads them. The answers a response part held become unanswered, so the next
        dispatch asks them again; what they cost stays charged (`lost/`, from the part's tally), unless the
        run that wrote the part left its dispatch ledger, which then charges them as bought and unstored. A
        set-aside part of `lost/` is charged again from its tally. Call with the dataset's lock held."""
        d = self.layout.dir
        found = self.responses.sweep(d, STAGE, self._charge_lost_answers)
        found += self.aside.sweep(d, STAGE, self._charge_lost_answers)
        found += self.lost.sweep(d, STAGE, self._carry_lost_charges)
        found += self.failures.sweep(d, STAGE)
        imports = (
            sorted(self.layout.imports_dir.glob("*.parquet")) if self.layout.imports_dir.is_dir() else []
        )
        found += sweep_parquet(d, imports, STAGE, IMPORT_REJECTED_SCHEMA, list(IMPORT_REJECTED_SCHEMA))
        self.quarantined.extend(found)
        self.responses.fill_tally()  # so that a part damaged later can still be accounted for
        self.aside.fill_tally()
        self.lost.fill_tally()
        return found

    def set_aside(self) -> SetAside:
        parts = [q for q in self.quarantined if q.path.startswith(f"{self.layout.responses_dir.name}/")]
        return SetAside(
            files=list(self.quarantined),
            answers=sum(q.rows or 0 for q in parts),
            answers_unknown=sum(q.rows is None for q in parts),
            charged_tokens=self._charged[0],
            charged_usd=self._charged[1],
        )

    def _charge_lost_answers(self, path: str, entry: dict) -> None:
        """A damaged response part's answers were paid for: charge what its tally says they cost."""
        run_id, rows, sums = entry.get("run_id"), entry.get("rows"), entry.get("sums", {})
        if not rows or (run_id and (self.ledger_dir / f"dispatch-{run_id}.log").exists()):
            return  # unknown size, or the run's own ledger will charge these ids as bought and unstored
        self._append_charges(path, rows, sums.get("completion_tokens", 0.0), sums.get("cost_usd", 0.0))

    def _carry_lost_charges(self, path: str, entry: dict) -> None:
        """A damaged part of `lost/` held charges: they are carried over (a budget gains no room from
        damage)."""
        rows, sums = entry.get("rows"), entry.get("sums", {})
        if rows:
            self._append_charges(
                path, rows, sums.get("estimated_tokens", 0.0), sums.get("estimated_usd", 0.0)
            )

    def _append_charges(self, path: str, n: int, tokens: float, usd: float) -> None:
        """`n` charges of a set-aside file's spend into `lost/` (id null: no prompt is named, the file is)."""
        now = time.time()
        self.lost.append(
            pl.DataFrame(
                {
                    "id": [None] * n,
                    "run_id": [f"set aside: {path}"] * n,
                    "estimated_tokens": [float(tokens) / n] * n,
                    "estimated_usd": [float(usd or 0.0) / n] * n,
                    "created_at": [now] * n,
                },
                schema=LOST_SCHEMA,
            )
        )
        self._charged[0] += float(tokens)
        self._charged[1] += float(usd or 0.0)

    def ledger(self, run_id: str) -> DispatchLedger:
        return DispatchLedger(self.ledger_dir, run_id)

    def settle_ledgers(self, tokens_each: float, usd_each: float) -> LostCharge:
        """Record what each finished or crashed run bought and did not store, each request at the expected
        cost of an answer (it was probably billed); returns the charge for the caller's budget. Call with the
        dataset's lock held, after the run's own rows are flushed."""
        if not self.ledger_dir.is_dir():
            return LostCharge()
        lost = 0
        for path in sorted(self.ledger_dir.glob("dispatch-*.log")):
            run_id, ids = bought_and_unstored(path, self._stored_by)
            if ids:
                self.lost.append(lost_rows(run_id, ids, tokens_each, usd_each))
                lost += len(ids)
            path.unlink()
        return LostCharge(lost, tokens_each * lost, usd_each * lost)

    def _stored_by(self, run_id: str) -> set[str]:
        df = self.responses.scan(["id", "run_id"]).filter(pl.col("run_id") == run_id).collect()
        return set(df["id"].to_list())

    def done_ids(self) -> set[str]:
        return self.responses.keys()

    def permanent_failure_ids(self) -> set[str]:
        """Ids whose latest failure is permanent (a later retryable row for the same id wins)."""
        latest = self.failures.scan(["id", "permanent"]).unique(
            subset=["id"], keep="last", maintain_order=True
        )
        return set(latest.filter(pl.col("permanent")).collect()["id"].to_list())

    # -- answers set aside -----------------------------------------------------------------------------------
    def stored_answers(self, text: bool = True) -> pl.DataFrame:
        """The stored answers as `binding.standing_answers` reads them: one row per id. `text`: with their
        content and reasoning (a `turns: all` history needs them; otherwise left null, never read)."""
        columns = STANDING_COLUMNS if text else [c for c in STANDING_COLUMNS if c not in TEXT_COLUMNS]
        stored = self.responses.scan(columns).unique(subset=["id"], keep="first")
        blank = [pl.lit(None, pl.String).alias(c) for c in STANDING_COLUMNS if c not in columns]
        return stored.with_columns(blank).select(STANDING_COLUMNS).collect()

    def standing(self, rules: AnswerRules) -> Standing:
        """Which stored answers stand under `rules`, read without the lock (nothing is moved): what the tokens
        stage trains and the checks count."""
        prompts = (
            read_prompts(self.layout.prompts)
            if self.layout.prompts.exists()
            else pl.DataFrame(schema={"id": pl.String, "messages": pl.List(pl.Struct({"role": pl.String}))})
        )
        return standing_answers(prompts, self.stored_answers(text=rules.turns == "all"), rules)

    def aside_answers(self, text: bool = True) -> pl.DataFrame:
        """Every answer set aside, oldest first (`binding.standing_answers` decides which fit again); `text`
        as for `stored_answers`."""
        columns = [*STANDING_COLUMNS, "aside_key"]
        if not self.aside.files():
            return pl.DataFrame(schema={c: SET_ASIDE_SCHEMA[c] for c in columns})
        read = [c for c in columns if text or c not in TEXT_COLUMNS]
        return (
            self.aside.scan([*read, "set_aside_at"])
            .unique(subset=["aside_key"], keep="first")
            .sort("set_aside_at")
            .with_columns(pl.lit(None, pl.String).alias(c) for c in columns if c not in read)
            .select(columns)
            .collect()
        )

    def set_answers_aside(self, reasons: dict[str, AsideReason]) -> int:
        """Move the stored answers of `reasons` to set_aside/ with their reason. The copy is written before
        the answers leave responses/, so a crash in between leaves an answer in both (the next run sets it
        aside again, as the same `aside_key`), never in neither. Call with the dataset's lock held."""
        if not reasons:
            return 0
        rows = (
            self.responses.scan()
            .filter(pl.col("id").is_in(list(reasons)))
            .unique(subset=["id"], keep="first")
            .collect()
        )
        now = time.time()
        rows = rows.with_columns(
            aside_key=_aside_key(),
            aside_reason=pl.Series([reasons[i].kind for i in rows["id"]], dtype=pl.String),
            aside_detail=pl.Series([reasons[i].detail for i in rows["id"]], dtype=pl.String),
            set_aside_at=pl.lit(now, dtype=pl.Float64),
        )
        self.aside.append(rows.select(list(SET_ASIDE_SCHEMA)))
        self.responses.compact(keep="first", drop_keys=reasons)
        self.aside.compact(keep="first")
        return rows.height

    def restore_answers(self, keys: list[str]) -> int:
        """Bring set-aside answers back (their prompt is again what they answered): appended to responses/
        before they leave set_aside/ (a crash in between charges them twice, never loses one)."""
        if not keys:
            return 0
        rows = (
            self.aside.scan()
            .filter(pl.col("aside_key").is_in(keys))
            .unique(subset=["aside_key"], keep="first")
            .unique(subset=["id"], keep="last", maintain_order=True)
            .collect()
        )
        self.responses.append(rows.select(list(RESPONSE_SCHEMA)))
        self.aside.compact(keep="first", drop_keys=keys)
        return rows.height

    def aside_counts(self) -> dict[str, int]:
        """Answers set aside so far, by reason."""
        df = self.aside.scan(["aside_key", "aside_reason"]).unique(subset=["aside_key"]).collect()
        return dict(df["aside_reason"].value_counts().rows()) if df.height else {}

    def clear_failures(self) -> int:
        """Forget every failure row (a fresh answer set: the earlier target's failures say nothing of the new
        one's); returns how many there were."""
        n = self.failures.row_count()[1]
        self.failures.compact(keep="last", drop_keys=self.failures.keys())
        return n

    def prior_usage(self) -> PriorUsage:
        # Answers set aside were paid for all the same: their tokens and dollars count toward the budget.
        aside = (
            self.aside.scan(["aside_key", "completion_tokens", "cost_usd", "latency_s"])
            .unique(subset=["aside_key"], keep="first")
            .drop("aside_key")
        )
        df = pl.concat(
            [
                self.responses.scan(["id", "completion_tokens", "cost_usd", "latency_s"])
                .unique(subset=["id"], keep="first")
                .drop("id"),
                aside,
            ]
        ).collect()
        tokens = df["completion_tokens"].fill_null(0).to_numpy().astype(float)
        history = LengthHistory()
        history.add_many(tokens, df["latency_s"].fill_null(0.0).to_numpy())
        costs = CostFit()
        priced = df.filter(pl.col("cost_usd").is_not_null())
        costs.add_many(priced["completion_tokens"].fill_null(0).to_numpy(), priced["cost_usd"].to_numpy())
        lost = self.lost.scan(["estimated_tokens", "estimated_usd"]).collect()
        lost_tokens = float(lost["estimated_tokens"].sum()) if lost.height else 0.0
        lost_usd = float(lost["estimated_usd"].sum()) if lost.height else 0.0
        return PriorUsage(
            n_responses=df.height,
            completion_tokens=int(tokens.sum()) + round(lost_tokens),
            cost_usd=float(df["cost_usd"].drop_nulls().sum()) + lost_usd,
            history=history,
            costs=costs,
            lost_requests=lost.height,
            lost_tokens=lost_tokens,
        )

    MAX_PARTS = 200  # beyond this many files, reads slow down: fold everything once (the occasional step)

    def finalize(self) -> tuple[int, int]:
        """Make the tables what the contract says, at a cost proportional to what this run added: the run's
        own parts fold into one file, failures (small) drop the ids answered since, and the whole response
        table is compacted only when duplicates exist (a crash during a fold) or it has grown too many files.
        Damaged files are set aside first (`sweep`)."""
        self.sweep()
        self.responses.fold(self.responses.written)
        self.responses.written.clear()
        rows, keys = self.responses.row_count()
        if rows != keys or len(self.responses.files()) > self.MAX_PARTS:
            keys = self.responses.compact(keep="first")
        n_fail = self.failures.compact(keep="last", drop_keys=self.done_ids())
        return keys, n_fail

    def compact(self) -> tuple[int, int]:
        """The occasional full compaction (eagle3 compact): one file per table."""
        self.sweep()
        return self.responses.compact(keep="first"), self.failures.compact(
            keep="last", drop_keys=self.done_ids()
        )


def _aside_key() -> pl.Expr:
    """One answer, wherever it is copied: its id, the run that stored it and when."""
    return pl.concat_str(
        [
            pl.col("id"),
            pl.col("run_id").fill_null("-"),
            pl.col("created_at").cast(pl.String).fill_null("-"),
        ],
        separator="|",
    )


def _int(v: Any) -> int | None:
    """Server fields coerced to the column types, so one odd value cannot fail a whole flush."""
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def _float(v: Any) -> float | None:
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def _str(v: Any) -> str | None:
    return None if v is None else str(v)


class JournalWriter:
    """Buffers rows in columns and flushes them as atomic part files, off the event loop."""

    def __init__(
        self,
        journal: ResponseJournal,
        backend: str,
        run_id: str,
        source: str = "generated",
        on_flush: Callable[[], None] | None = None,
        settings_fingerprint: str | None = None,
    ):
        self.journal = journal
        self.on_flush = on_flush
        self.backend = backend
        self.run_id = run_id
        self.source = source
        # The sampling, template variables and backend knobs every request of this writer went out with.
        self.settings_fingerprint = settings_fingerprint
        self._resp = empty_columns(RESPONSE_SCHEMA)
        self._fail = empty_columns(FAILURE_SCHEMA)
        self._aside = empty_columns(SET_ASIDE_SCHEMA)
        self._lock = asyncio.Lock()
        self.rows_written = 0
        self.bytes_written = 0  # of the answers' parts: what a stored answer takes on disk

    def add_completion(self, request_id: str, c: Completion) -> None:
        self._add_answer(self._resp, request_id, c)

    def add_refused(self, request: CompletionRequest, c: Completion, why: str) -> None:
        """An answer that is not the target's: kept in set_aside/ (it was paid for), never in responses/."""
        c.prompt_fingerprint = c.prompt_fingerprint or request.fingerprint
        a = self._aside
        self._add_answer(a, request.id, c)
        a["aside_key"].append(f"{request.id}|{self.run_id}|{a['created_at'][-1]}")
        a["aside_reason"].append(FOREIGN_MODEL)
        a["aside_detail"].append(why[:2000])
        a["set_aside_at"].append(a["created_at"][-1])

    def _add_answer(self, r: dict[str, list[Any]], request_id: str, c: Completion) -> None:
        r["id"].append(request_id)
        r["backend"].append(self.backend)
        r["model"].append(c.model)
        r["provider"].append(_str(c.provider))
        r["content"].append(str(c.content))
        r["reasoning"].append(_str(c.reasoning))
        r["finish_reason"].append(str(c.finish_reason))
        r["prompt_tokens"].append(_int(c.prompt_tokens))
        r["completion_tokens"].append(c.charged_tokens)
        r["cost_usd"].append(_float(c.cost_usd))
        r["output_ids"].append(c.output_ids)
        r["native_finish_reason"].append(_str(c.native_finish_reason))
        r["reasoning_tokens"].append(_int(c.reasoning_tokens))
        r["cached_tokens"].append(_int(c.cached_tokens))
        r["request_id"].append(_str(c.request_id))
        r["latency_s"].append(_float(c.latency_s))
        r["created_at"].append(time.time())
        r["run_id"].append(self.run_id)
        r["source"].append(self.source)
        r["usage_estimated"].append(bool(c.usage_estimated))
        r["prompt_fingerprint"].append(c.prompt_fingerprint)
        r["settings_fingerprint"].append(self.settings_fingerprint)
        r["reported_completion_tokens"].append(_int(c.completion_tokens))
        r["counted_completion_tokens"].append(_int(c.counted_tokens))
        r["quantization"].append(_str(c.quantization))
        r["cut_at_max_tokens"].append(bool(c.cut_at_max_tokens))
        r["tool_calls"].append(calls_json(c.tool_calls))

    def add_failure(
        self, request_id: str, kind: str, message: str, attempts: int, permanent: bool, status: int | None
    ) -> None:
        f = self._fail
        f["id"].append(request_id)
        f["error_kind"].append(kind)
        f["message"].append(message[:2000])
        f["attempts"].append(attempts)
        f["permanent"].append(permanent)
        f["backend"].append(self.backend)
        f["status"].append(status)
        f["created_at"].append(time.time())
        f["run_id"].append(self.run_id)

    @property
    def pending(self) -> int:
        return len(self._resp["id"]) + len(self._fail["id"]) + len(self._aside["id"])

    def _swap(self) -> list[dict[str, list[Any]]]:
        buffers = [self._resp, self._aside, self._fail]
        self._resp = empty_columns(RESPONSE_SCHEMA)
        self._aside = empty_columns(SET_ASIDE_SCHEMA)
        self._fail = empty_columns(FAILURE_SCHEMA)
        return buffers

    def _restore(self, unwritten: list[dict[str, list[Any]]]) -> None:
        """Put rows that could not be written back in front of the buffers: a failed write must lose
        nothing."""
        for buffer, rows in zip((self._resp, self._aside, self._fail), unwritten, strict=True):
            for name, values in rows.items():
                buffer[name][:0] = values

    def _write(self, buffers: list[dict[str, list[Any]]]) -> None:
        """The buffered answers, set-aside answers and failures, in that order (a worker thread may run it);
        the rows a failed write leaves unwritten travel in the error, to be put back where rows are added."""
        tables = (self.journal.responses, self.journal.aside, self.journal.failures)
        for i, (table, rows) in enumerate(zip(tables, buffers, strict=True)):
            try:
                path = table.append(rows)
            except BaseException as error:
                unwritten = [b if j >= i else _empty_like(b) for j, b in enumerate(buffers)]
                raise _Unwritten(unwritten, error) from error
            if i == 0 and path is not None:
                self.rows_written += len(rows["id"])
                self.bytes_written += path.stat().st_size

    async def flush(self) -> None:
        """Write what is buffered; rows whose write fails go back in front of the buffer (on the event loop,
        where rows are added) and the error propagates."""
        async with self._lock:
            if not self.pending:
                return
            try:
                await asyncio.to_thread(self._write, self._swap())
            except _Unwritten as e:
                self._restore(e.buffers)
                raise e.error from None
            if self.on_flush is not None:
                await asyncio.to_thread(self.on_flush)

    def flush_sync(self) -> None:
        if not self.pending:
            return
        try:
            self._write(self._swap())
        except _Unwritten as e:
            self._restore(e.buffers)
            raise e.error from None


class _Unwritten(Exception):
    """Rows a flush in a worker thread could not write, and why."""

    def __init__(self, buffers: list[dict[str, list[Any]]], error: BaseException):
        super().__init__(str(error))
        self.buffers = buffers
        self.error = error


def _empty_like(columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {name: [] for name in columns}
