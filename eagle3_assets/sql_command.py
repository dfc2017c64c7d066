"""`eagle3 sql`: the warehouse's views (core.report.warehouse) for a user's own SQL, one query or a prompt."""

from __future__ import annotations

import contextlib
import csv
import sys
from typing import TYPE_CHECKING, TextIO

from .config import ProjectConfig

if TYPE_CHECKING:
    import duckdb

PROMPT, MORE = "eagle3> ", "   ...> "


def print_result(
    con: duckdb.DuckDBPyConnection, sql: str, fmt: str = "box", out: TextIO = sys.stdout
) -> None:
    """Run `sql` and print what it returns (nothing for a statement that returns no rows)."""
    from .core.report.markdown_table import markdown_table

    rel = con.sql(sql)
    if rel is None:
        return
    if fmt == "markdown":
        out.write(markdown_table(rel.columns, rel.fetchall()))
    elif fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(rel.columns)
        w.writerows(rel.fetchall())
    else:
        out.write(_box(rel))
    out.flush()


def _box(rel: duckdb.DuckDBPyRelation) -> str:
    """DuckDB's own box rendering, every row and column shown."""
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        rel.show(max_width=100_000, max_rows=100_000, max_col_width=200)
    return buf.getvalue()


def help_text() -> str:
    from .core.report.warehouse import VIEWS

    lines = ["Views (columns: DESCRIBE <view>; docs/warehouse.md):"]
    lines += [f"  {name:<11} {what}" for name, what in VIEWS.items()]
    lines.append(
        "End a statement with ';'. .tables lists the views, .help this text, .quit (or Ctrl-D) leaves."
    )
    return "\n".join(lines)


def repl(
    con: duckdb.DuckDBPyConnection, fmt: str, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout
) -> int:
    """A small prompt: statements end with ';', errors are printed and the prompt goes on."""
    interactive = stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 (line editing and history for input())
        out.write(help_text() + "\n")
    buffer: list[str] = []
    while True:
        try:
            line = input(MORE if buffer else PROMPT) if interactive else stdin.readline()
        except EOFError:
            break
        if not interactive and line == "":
            break
        stripped = line.strip()
        if not buffer and stripped in (".quit", ".exit", "\\q"):
            break
        if not buffer and stripped in (".help", "help"):
            out.write(help_text() + "\n")
            continue
        if not buffer and stripped == ".tables":
            stripped = "SHOW TABLES;"
        buffer.append(stripped)
        if not stripped.endswith(";"):
            continue
        sql, buffer = "\n".join(buffer), []
        try:
            print_result(con, sql, fmt, out)
        except Exception as e:  # a user's SQL error: say it, keep the prompt
            out.write(f"error: {e}\n")
    if buffer and "".join(buffer).strip():
        try:
            print_result(con, "\n".join(buffer), fmt, out)
        except Exception as e:
            out.write(f"error: {e}\n")
            return 1
    return 0


def run_sql(cfg: ProjectConfig, query: str | None, fmt: str) -> int:
    import duckdb

    from .core.report.warehouse import open_project_warehouse

    con = open_project_warehouse(cfg)
    try:
        if query is None:
            return repl(con, fmt)
        try:
            print_result(con, query, fmt)
        except duckdb.Error as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    finally:
        con.close()
