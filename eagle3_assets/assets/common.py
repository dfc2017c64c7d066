"""Small helpers shared by the asset modules (metadata formatting)."""

from collections.abc import Mapping
from typing import Any

import dagster as dg

GROUP = "eagle3"


def counts_table(counts: Mapping[str, Any], key: str = "kind", value: str = "count") -> dg.TableMetadataValue:
    schema = dg.TableSchema(columns=[dg.TableColumn(key, "string"), dg.TableColumn(value, "int")])
    rows = [dg.TableRecord({key: str(k), value: int(v)}) for k, v in counts.items()]
    return dg.MetadataValue.table(rows, schema=schema)
