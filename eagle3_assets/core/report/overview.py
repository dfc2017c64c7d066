"""The cross-partition overview: the warehouse's tables a team deciding where the next dollars of answers go
reads first (per dataset: what was bought, what it trained, what the draft accepts), as typed tables and
as the markdown report `<root>/overview.md`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .markdown_table import bar_chart, markdown_table

if TYPE_CHECKING:
    import duckdb

OVERVIEW_FILE = "overview.md"

# Table name -> (title, query over the warehouse's views).
QUERIES: dict[str, tuple[str, str]] = {
    "summary": ("Per dataset", "SELECT * FROM summary"),
    "cost": ("Cost by dataset and model", "SELECT * FROM cost"),
    "tokens": ("Training tokens", "SELECT * FROM tokens"),
    "acceptance": (
        "Acceptance",
        """SELECT dataset, source, draft, engine, acceptance_length, untrained_acceptance_length,
                  gain_over_floor, train_acceptance_length, n_prompts, passed, cost_usd, gpu_seconds,
                  usd_per_0_1_acceptance, flags
           FROM acceptance ORDER BY source, draft""",
    ),
    "failures": (
        "Unanswered failures by kind",
        """SELECT dataset, error_kind, count(*) AS failures, count(*) FILTER (WHERE permanent) AS permanent
           FROM failures WHERE NOT answered GROUP BY dataset, error_kind ORDER BY dataset, error_kind""",
    ),
}


@dataclass(frozen=True)
class QueryTable:
    """A query's result: column names, DuckDB type names and rows."""

    title: str
    columns: list[str]
    types: list[str]
    rows: list[tuple[Any, ...]]

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]


def query_table(con: duckdb.DuckDBPyConnection, sql: str, title: str = "") -> QueryTable:
    rel = con.sql(sql)
    return QueryTable(
        title, list(rel.columns), [str(t) for t in rel.types], [tuple(r) for r in rel.fetchall()]
    )


@dataclass(frozen=True)
class Overview:
    tables: dict[str, QueryTable]
    markdown: str


def charts(tables: dict[str, QueryTable]) -> str:
    """Bar charts per dataset: the gate's held-out acceptance length, acceptance on the common suite (where
    the data_value asset measured it), dollars (where any were paid) and trained tokens."""
    summary = tables["summary"]
    datasets = [str(d) for d in summary.column("dataset")]
    out = [
        bar_chart(
            "Held-out acceptance length per dataset (the gate, each on its own prompts; bars from 1.0)",
            list(zip(datasets, summary.column("heldout_acceptance_length"), strict=True)),
            floor=1.0,
        )
    ]
    acc = tables["acceptance"]
    suite = [
        (str(d), a)
        for s, d, a in zip(*(acc.column(c) for c in ("source", "draft", "acceptance_length")), strict=True)
        if s == "data_value"
    ]
    if suite:
        out.append(
            bar_chart("Acceptance length on the common suite (data_value; bars from 1.0)", suite, floor=1.0)
        )
    spent = summary.column("spent_usd")
    if any(c is not None for c in spent):
        title = "Dollars spent per dataset (answers kept and set aside)"
        out.append(bar_chart(title, list(zip(datasets, spent, strict=True)), unit=" $"))
    out.append(
        bar_chart(
            "Trained tokens per dataset",
            [(d, float(t)) for d, t in zip(datasets, summary.column("trained_tokens"), strict=True)],
        )
    )
    return "\n".join(out)


def render_overview(tables: dict[str, QueryTable], generated_at: datetime | None = None) -> str:
    when = (generated_at or datetime.now(UTC)).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "# Overview of every dataset",
        "",
        f"Generated {when} from every partition's files (`eagle3 sql` opens the same views).",
        "",
        charts(tables),
    ]
    for t in tables.values():
        parts += [f"## {t.title}", "", markdown_table(t.columns, t.rows) if t.rows else "(none)\n"]
    return "\n".join(parts)


def build_overview(con: duckdb.DuckDBPyConnection) -> Overview:
    tables = {name: query_table(con, sql, title) for name, (title, sql) in QUERIES.items()}
    return Overview(tables, render_overview(tables))


def build_overview_fresh(
    open_connection: Callable[[], duckdb.DuckDBPyConnection], attempts: int = 3
) -> Overview:
    """`build_overview` on a new connection, again on another when a file listed at opening was gone by the
    time it was read (a partition's run folding its journal parts meanwhile: the new file is in place before
    the old ones go, so a fresh listing reads it)."""
    import duckdb

    for attempt in range(1, attempts + 1):
        con = open_connection()
        try:
            return build_overview(con)
        except (duckdb.IOException, FileNotFoundError):
            if attempt == attempts:
                raise
        finally:
            con.close()
    raise AssertionError("unreachable")
