"""DuckDB over every partition: the cross-partition tables (answers, failures, cost, tokens, acceptance) as
views over the partitions' own files, local or on the object store, read where they lie (nothing copied, no
database file: DuckDB allows one writer, and the stages keep writing Parquet per partition).

The journal's folders may hold a crash's duplicate of an answer; the `answers` view keeps the copy
`JournalTable.read(keep="first")` keeps (the first by part name, then row) and `failures` the last, as the
validation report does, so no figure here counts an answer twice. A partition without a file is left out of
that view; a view over no partition is an empty table with its columns. The file lists are taken when the
connection opens: a compaction that removes parts afterwards needs a new connection.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from ...config import ProjectConfig
from ..storage.layout import DATA_VALUE_REPORT, DatasetLayout
from ..storage.root_files import RootFiles, root_files
from ..storage.tables import FAILURE_SCHEMA, RESPONSE_SCHEMA, SET_ASIDE_SCHEMA
from .warehouse_acceptance import ACCEPTANCE_COLUMNS, acceptance_rows

if TYPE_CHECKING:
    import duckdb


# What each view holds, for `eagle3 sql` (docs/warehouse.md lists the columns).
VIEWS: dict[str, str] = {
    "answers": "one row per answered prompt id and dataset (the journal's first copy of an id)",
    "failures": "one row per failed prompt id and dataset (its last failure); `answered` once answered",
    "set_aside": "one row per answer set aside (never trained, still paid for): why, and what it cost",
    "cost": "per dataset and model: answers, prompt and completion tokens, cost_usd, usd_per_1k_tokens",
    "token_rows": "one row per training sample: dataset, id, n_tokens, trained_tokens, reference_match",
    "tokens": "per dataset: samples, tokens, trained_tokens, reference_match_rate",
    "acceptance": "per gate report (source 'gate') and data_value row (source 'data_value')",
    "summary": "per configured dataset: answers, cost, trained tokens, failures, the gate's acceptance and "
    "spent_usd (kept and set-aside answers: the validation report's cost_usd)",
    "datasets": "the configured dataset keys",
}

# Heavy answer columns left out of the views (`output_ids`: the answer again as ids).
_LEFT_OUT = {"output_ids"}

_DUCK_TYPES: dict[type[pl.DataType], str] = {
    pl.String: "VARCHAR",
    pl.Int64: "BIGINT",
    pl.Int32: "INTEGER",
    pl.Float64: "DOUBLE",
    pl.Boolean: "BOOLEAN",
}


def duck_columns(schema: dict[str, pl.DataType]) -> list[tuple[str, str]]:
    """(name, DuckDB type) of a journal schema's scalar columns, in order."""
    return [(n, _DUCK_TYPES[type(t)]) for n, t in schema.items() if n not in _LEFT_OUT]


ANSWER_COLUMNS = duck_columns(RESPONSE_SCHEMA)
FAILURE_COLUMNS = duck_columns(FAILURE_SCHEMA)
SET_ASIDE_COLUMNS = duck_columns(SET_ASIDE_SCHEMA)
TOKEN_ROW_COLUMNS = [
    ("id", "VARCHAR"),
    ("n_tokens", "BIGINT"),
    ("trained_tokens", "BIGINT"),
    ("reference_match", "BOOLEAN"),
]


@dataclass(frozen=True)
class Partitioned:
    """One partition's files of a view, in the order the journal reads them."""

    dataset: str
    files: list[str]


def project_root_files(cfg: ProjectConfig) -> RootFiles:
    """The project's storage root where it is stored (the object store itself, not a working copy)."""
    if cfg.storage_is_remote:
        return root_files(cfg.storage.root, cfg.storage.options, remote=True)
    return root_files(cfg.storage_root)


def open_project_warehouse(cfg: ProjectConfig) -> duckdb.DuckDBPyConnection:
    """`open_warehouse` over the configured root and every configured dataset."""
    return open_warehouse(project_root_files(cfg), list(cfg.datasets))


def open_warehouse(root: RootFiles, keys: Sequence[str]) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the views of `VIEWS` over the partitions `keys` of `root`."""
    import duckdb

    con = duckdb.connect(":memory:")
    root.attach(con)
    con.execute("CREATE TABLE datasets (dataset VARCHAR)")
    if keys:
        con.executemany("INSERT INTO datasets VALUES (?)", [[k] for k in keys])
    layouts = {k: DatasetLayout(Path(), k) for k in keys}  # paths relative to the root
    answers = [Partitioned(k, root.parquet_files(str(layouts[k].responses_dir))) for k in keys]
    failures = [Partitioned(k, root.parquet_files(str(layouts[k].failures_dir))) for k in keys]
    aside = [Partitioned(k, root.parquet_files(str(layouts[k].set_aside_dir))) for k in keys]
    _journal_view(con, "answers", answers, ANSWER_COLUMNS, keep="first")
    _journal_view(con, "failures_rows", failures, FAILURE_COLUMNS, keep="last")
    _journal_view(con, "set_aside", aside, SET_ASIDE_COLUMNS, keep="first", key="aside_key")
    con.execute(
        """CREATE VIEW failures AS SELECT f.*, EXISTS (
               SELECT 1 FROM answers a WHERE a.dataset = f.dataset AND a.id = f.id) AS answered
           FROM failures_rows f"""
    )
    con.execute(
        """CREATE VIEW cost AS SELECT dataset, model, count(*) AS answers,
               CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens,
               CAST(sum(completion_tokens) AS BIGINT) AS completion_tokens,
               sum(cost_usd) AS cost_usd,
               1000 * sum(cost_usd) / nullif(sum(completion_tokens), 0) AS usd_per_1k_tokens
           FROM answers GROUP BY dataset, model ORDER BY dataset, model"""
    )
    tokens = [Partitioned(k, [p]) for k in keys if (p := root.sql_path(str(layouts[k].tokens)))]
    _token_rows_view(con, tokens)
    con.execute(
        """CREATE VIEW tokens AS SELECT dataset, count(*) AS samples, CAST(sum(n_tokens) AS BIGINT) AS tokens,
               CAST(sum(trained_tokens) AS BIGINT) AS trained_tokens,
               avg(CAST(reference_match AS DOUBLE)) AS reference_match_rate,
               count(reference_match) AS reference_checked
           FROM token_rows GROUP BY dataset ORDER BY dataset"""
    )
    _acceptance_table(con, root, layouts)
    con.execute(
        """CREATE VIEW summary AS
           WITH c AS (SELECT dataset, CAST(sum(answers) AS BIGINT) AS answers,
                             CAST(sum(completion_tokens) AS BIGINT) AS completion_tokens,
                             sum(cost_usd) AS cost_usd FROM cost GROUP BY dataset),
                f AS (SELECT dataset, count(*) AS failures FROM failures WHERE NOT answered GROUP BY dataset),
                g AS (SELECT dataset, acceptance_length AS heldout_acceptance_length,
                             untrained_acceptance_length FROM acceptance WHERE source = 'gate'),
                s AS (SELECT dataset, count(*) AS set_aside, sum(cost_usd) AS set_aside_usd
                      FROM set_aside GROUP BY dataset)
           SELECT d.dataset, coalesce(c.answers, 0) AS answers,
                  coalesce(c.completion_tokens, 0) AS completion_tokens, c.cost_usd,
                  coalesce(t.samples, 0) AS samples, coalesce(t.trained_tokens, 0) AS trained_tokens,
                  t.reference_match_rate, coalesce(f.failures, 0) AS failures,
                  g.heldout_acceptance_length, g.untrained_acceptance_length,
                  coalesce(s.set_aside, 0) AS set_aside, s.set_aside_usd,
                  CASE WHEN c.cost_usd IS NULL AND s.set_aside_usd IS NULL THEN NULL
                       ELSE coalesce(c.cost_usd, 0) + coalesce(s.set_aside_usd, 0) END AS spent_usd
           FROM datasets d LEFT JOIN c USING (dataset) LEFT JOIN tokens t USING (dataset)
                LEFT JOIN f USING (dataset) LEFT JOIN g USING (dataset) LEFT JOIN s USING (dataset)
           ORDER BY d.dataset"""
    )
    return con


def _empty_select(columns: Sequence[tuple[str, str]]) -> str:
    cols = ", ".join(f"CAST(NULL AS {t}) AS {n}" for n, t in [("dataset", "VARCHAR"), *columns])
    return f"SELECT {cols} WHERE false"


def _sql_list(paths: Sequence[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def _present(con: duckdb.DuckDBPyConnection, source: str) -> set[str]:
    """The columns the files of `source` hold (parts written by older versions may lack newer ones)."""
    return {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}


def _journal_view(
    con: duckdb.DuckDBPyConnection,
    name: str,
    parts: Sequence[Partitioned],
    columns: Sequence[tuple[str, str]],
    keep: str,
    key: str = "id",
) -> None:
    """View `name`: the journal parts of every partition, one row per (dataset, `key`): the first copy
    (`keep="first"`) or the last, in the order `JournalTable` reads them (part name, then row)."""
    order = [(p.dataset, i, f) for p in parts for i, f in enumerate(p.files)]
    if not order:
        con.execute(f"CREATE VIEW {name} AS {_empty_select(columns)}")
        return
    files_table = f"_{name}_files"
    con.execute(f"CREATE TABLE {files_table} (filename VARCHAR, dataset VARCHAR, ordinal INTEGER)")
    con.executemany(f"INSERT INTO {files_table} VALUES (?, ?, ?)", [[f, d, i] for d, i, f in order])
    paths = _sql_list([f for _, _, f in order])
    have = _present(con, f"read_parquet({paths}, union_by_name = true)")
    cols = ", ".join(
        f"CAST(r.{n} AS {t}) AS {n}" if n in have else f"CAST(NULL AS {t}) AS {n}" for n, t in columns
    )
    direction = "" if keep == "first" else " DESC"
    reader = f"read_parquet({paths}, union_by_name = true, filename = true, file_row_number = true)"
    con.execute(
        f"""CREATE VIEW {name} AS SELECT f.dataset, {cols}
            FROM {reader} r JOIN {files_table} f ON r.filename = f.filename
            QUALIFY row_number() OVER (
                PARTITION BY f.dataset, r.{key}
                ORDER BY f.ordinal{direction}, r.file_row_number{direction}) = 1"""
    )


def _token_rows_view(con: duckdb.DuckDBPyConnection, parts: Sequence[Partitioned]) -> None:
    if not parts:
        con.execute(f"CREATE VIEW token_rows AS {_empty_select(TOKEN_ROW_COLUMNS)}")
        return
    selects = []
    for p in parts:
        source = f"read_parquet({_sql_list(p.files)})"
        have = _present(con, source)
        match = "reference_match" if "reference_match" in have else "CAST(NULL AS BOOLEAN)"
        dataset = "'" + p.dataset.replace("'", "''") + "'"
        selects.append(
            f"""SELECT {dataset} AS dataset, CAST(id AS VARCHAR) AS id,
                   CAST(len(input_ids) AS BIGINT) AS n_tokens,
                   CAST(coalesce(list_sum(CAST(loss_mask AS INTEGER[])), 0) AS BIGINT) AS trained_tokens,
                   CAST({match} AS BOOLEAN) AS reference_match
                FROM {source}"""
        )
    con.execute("CREATE VIEW token_rows AS " + " UNION ALL ".join(selects))


def _acceptance_table(
    con: duckdb.DuckDBPyConnection, root: RootFiles, layouts: dict[str, DatasetLayout]
) -> None:
    """The gate's reports and the data_value rows, parsed here (small JSON files) into one typed table."""
    cols = ", ".join(f"{n} {t}" for n, t in ACCEPTANCE_COLUMNS)
    con.execute(f"CREATE TABLE acceptance ({cols})")
    reports: dict[str, dict[str, Any]] = {}
    for k, layout in layouts.items():
        text = root.read_text(str(layout.acceptance_report))
        if text is not None:
            reports[k] = json.loads(text)
    data_value_text = root.read_text(DATA_VALUE_REPORT)
    data_value = json.loads(data_value_text) if data_value_text is not None else None
    rows = acceptance_rows(reports, data_value, list(layouts))
    if rows:
        marks = ", ".join("?" for _ in ACCEPTANCE_COLUMNS)
        con.executemany(f"INSERT INTO acceptance VALUES ({marks})", [r.values() for r in rows])
