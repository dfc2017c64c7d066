"""What the asset modules share: the group, metadata tables, and how a check's verdict becomes its result."""

from collections.abc import Mapping
from typing import Any

import dagster as dg
import polars as pl

from resources import Storage

from ..core.report.validation import Verdict

GROUP = "eagle3"

MISSING = dg.AssetCheckResult(
    passed=False, metadata={"reason": "the asset's file is missing: materialise it"}
)


def counts_table(counts: Mapping[str, Any], key: str = "kind", value: str = "count") -> dg.TableMetadataValue:
    schema = dg.TableSchema(columns=[dg.TableColumn(key, "string"), dg.TableColumn(value, "int")])
    rows = [dg.TableRecord({key: str(k), value: int(v)}) for k, v in counts.items()]
    return dg.MetadataValue.table(rows, schema=schema)


def check_result(v: Verdict, warn: bool = False) -> dg.AssetCheckResult:
    """A rule's verdict (core.report.validation) as a check result; `warn` for checks that do not block."""
    severity = dg.AssetCheckSeverity.WARN if warn else dg.AssetCheckSeverity.ERROR
    return dg.AssetCheckResult(passed=v.passed, severity=severity, metadata=v.metadata)


def scan_tokens(storage: Storage, key: str, columns: list[str]) -> pl.LazyFrame | None:
    """The partition's token rows, lazily: each check reduces them to what it needs (streaming, bounded memory)."""
    path = storage.checkout(key, "tokens").tokens
    return pl.scan_parquet(path).select(columns) if path.exists() else None
