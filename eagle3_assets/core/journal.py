"""The response journal of one dataset: what is done, what failed, and a buffered writer for a running engine."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from .budget import RunningStats
from .protocol import Completion
from .store import FAILURE_SCHEMA, RESPONSE_SCHEMA, JournalTable, empty_columns


@dataclass
class PriorUsage:
    n_responses: int
    completion_tokens: int
    cost_usd: float
    token_stats: RunningStats
    usd_stats: RunningStats


class ResponseJournal:
    """`responses/` and `failures/` of one dataset folder."""

    def __init__(self, dataset_dir: Path):
        self.responses = JournalTable(dataset_dir / "responses", RESPONSE_SCHEMA)
        self.failures = JournalTable(dataset_dir / "failures", FAILURE_SCHEMA)

    def done_ids(self) -> set[str]:
        return self.responses.keys()

    def permanent_failure_ids(self) -> set[str]:
        """Ids whose latest failure is permanent (a later retryable row for the same id wins)."""
        latest = self.failures.scan(["id", "permanent"]).unique(
            subset=["id"], keep="last", maintain_order=True
        )
        return set(latest.filter(pl.col("permanent")).collect()["id"].to_list())

    def prior_usage(self) -> PriorUsage:
        df = (
            self.responses.scan(["id", "completion_tokens", "cost_usd"])
            .unique(subset=["id"], keep="first")
            .collect()
        )
        tokens = df["completion_tokens"].fill_null(0)
        costs = df["cost_usd"].drop_nulls()
        return PriorUsage(
            n_responses=df.height,
            completion_tokens=int(tokens.sum()),
            cost_usd=float(costs.sum()) if costs.len() else 0.0,
            token_stats=_stats(tokens),
            usd_stats=_stats(costs),
        )

    def finalize(self) -> tuple[int, int]:
        """Compact both tables: one row per answered id; failures only for ids still without an answer."""
        n_resp = self.responses.compact(keep="first")
        n_fail = self.failures.compact(keep="last", drop_keys=self.done_ids())
        return n_resp, n_fail


def _stats(series: pl.Series) -> RunningStats:
    n = series.len()
    if n == 0:
        return RunningStats()
    mean = float(series.mean())
    var = float(series.var()) if n > 1 else 0.0
    return RunningStats(n=n, mean=mean, m2=var * (n - 1))


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

    def __init__(self, journal: ResponseJournal, backend: str, run_id: str, source: str = "generated"):
        self.journal = journal
        self.backend = backend
        self.run_id = run_id
        self.source = source
        self._resp = empty_columns(RESPONSE_SCHEMA)
        self._fail = empty_columns(FAILURE_SCHEMA)
        self._lock = asyncio.Lock()
        self.rows_written = 0

    def add_completion(self, request_id: str, c: Completion) -> None:
        r = self._resp
        r["id"].append(request_id)
        r["backend"].append(self.backend)
        r["model"].append(c.model)
        r["provider"].append(_str(c.provider))
        r["content"].append(str(c.content))
        r["reasoning"].append(_str(c.reasoning))
        r["finish_reason"].append(str(c.finish_reason))
        r["prompt_tokens"].append(_int(c.prompt_tokens))
        r["completion_tokens"].append(_int(c.completion_tokens))
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
        return len(self._resp["id"]) + len(self._fail["id"])

    def _swap(self) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        resp, fail = self._resp, self._fail
        self._resp, self._fail = empty_columns(RESPONSE_SCHEMA), empty_columns(FAILURE_SCHEMA)
        return resp, fail

    def _restore(self, resp: dict[str, list[Any]], fail: dict[str, list[Any]]) -> None:
        """Put rows that could not be written back in front of the buffer: a failed write must lose nothing."""
        for name, values in resp.items():
            self._resp[name][:0] = values
        for name, values in fail.items():
            self._fail[name][:0] = values

    async def flush(self) -> None:
        """Write what is buffered; rows whose write fails go back in front of the buffer (on the event loop, where
        rows are added) and the error propagates."""
        async with self._lock:
            if not self.pending:
                return
            resp, fail = self._swap()
            try:
                await asyncio.to_thread(self.journal.responses.append, resp)
            except BaseException:
                self._restore(resp, fail)
                raise
            self.rows_written += len(resp["id"])
            try:
                await asyncio.to_thread(self.journal.failures.append, fail)
            except BaseException:
                self._restore(empty_columns(RESPONSE_SCHEMA), fail)
                raise

    def flush_sync(self) -> None:
        if not self.pending:
            return
        resp, fail = self._swap()
        try:
            self.journal.responses.append(resp)
        except BaseException:
            self._restore(resp, fail)
            raise
        self.rows_written += len(resp["id"])
        try:
            self.journal.failures.append(fail)
        except BaseException:
            self._restore(empty_columns(RESPONSE_SCHEMA), fail)
            raise
