"""overview: every dataset side by side (answers, cost, trained tokens, failures, acceptance), queried with
DuckDB over the partitions' files, shown as table metadata and bar charts, and written to
`<root>/overview.md`.

Not partitioned: it reads whatever partitions exist, so it runs when only some are materialised (a partition
without files is a row of zeros or nulls, not an error). It depends on every partition of validation_report
(Dagster's default mapping from a partitioned asset to an unpartitioned one: all partitions) so the UI
shows it stale when any dataset's report changes; it is not automated, as no single partition's run should
re-read all of them.
"""

from typing import Any

import dagster as dg

from resources import Project

from ..core.report.overview import OVERVIEW_FILE, QueryTable, build_overview_fresh
from ..core.storage.versions import content_version
from .common import GROUP

# DuckDB type name -> Dagster's table column type.
_TYPES = {"VARCHAR": "string", "BOOLEAN": "bool", "DOUBLE": "float", "FLOAT": "float"}


def _dagster_type(duck: str) -> str:
    if duck in _TYPES:
        return _TYPES[duck]
    if duck.endswith("INT") or duck in ("HUGEINT", "TINYINT", "SMALLINT", "INTEGER"):
        return "int"
    return "string"


def _value(v: Any) -> Any:
    if v is None or isinstance(v, str | int | float | bool):
        return v
    if isinstance(v, list | tuple):
        return ", ".join(str(x) for x in v)
    return str(v)


def table_metadata(t: QueryTable) -> dg.TableMetadataValue:
    schema = dg.TableSchema(
        columns=[dg.TableColumn(n, _dagster_type(ty)) for n, ty in zip(t.columns, t.types, strict=True)]
    )
    rows = [dg.TableRecord({n: _value(v) for n, v in zip(t.columns, row, strict=True)}) for row in t.rows]
    return dg.MetadataValue.table(rows, schema=schema)


def build_overview_asset() -> dg.AssetsDefinition:
    @dg.asset(
        name="overview",
        deps=["validation_report"],
        group_name=GROUP,
        kinds={"duckdb", "python"},
        code_version="1",
        description="Every dataset side by side: answers, cost, trained tokens, failures and acceptance, "
        "from DuckDB over every partition's files (`eagle3 sql` opens the same views); <root>/overview.md.",
    )
    def overview(
        context: dg.AssetExecutionContext, project: dg.ResourceParam[Project]
    ) -> dg.MaterializeResult:
        from ..core.report.warehouse import open_project_warehouse, project_root_files

        cfg = project.cfg
        result = build_overview_fresh(lambda: open_project_warehouse(cfg))
        where = project_root_files(cfg).write_text(OVERVIEW_FILE, result.markdown)
        context.log.info(f"overview of {len(cfg.datasets)} datasets written to {where}")
        content = {name: [list(map(str, r)) for r in t.rows] for name, t in result.tables.items()}
        summary = result.tables["summary"]
        return dg.MaterializeResult(
            data_version=dg.DataVersion(content_version(content)),
            metadata={
                "overview": dg.MetadataValue.md(result.markdown),
                **{f"{name}_table": table_metadata(t) for name, t in result.tables.items()},
                "datasets_with_answers": sum(1 for a in summary.column("answers") if a),
                "overview_md": dg.MetadataValue.path(where),
            },
        )

    return overview
