"""Reading a dataset source row by row: JSON Lines, a JSON document, or Parquet.

A row the parser cannot take (bad JSON, invalid UTF-8, a value nested deeper than any chat row, a number too
long to convert) comes back as an error with its reason, and the next row is read: one hostile line never
stops the file. Only what cannot be split into rows fails the whole source, with a message naming the file: a
`.json` document that does not parse (it is one value: there is no "rest" to go on with) and a Parquet file
whose footer cannot be read (its schema is shared by every row).

Nesting is bounded here, once, so that nothing after reading (the quarantine's preview, `str()` of a content
part, Polars) ever walks a row deep enough to hit Python's recursion limit.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

# How deep a row may nest containers (an object or a list is one level; the row itself is the first). A chat
# row needs 5 (row → messages → message → content parts → part); 32 leaves room for metadata such as tool
# schemas, and stays far below Python's recursion limit (1,000 frames), which `json.loads` of a 5,000-deep
# line hits.
MAX_NESTING = 32
RAW_PREVIEW_CHARS = 2000
NESTED_TOO_DEEP = f"nested more than {MAX_NESTING} levels deep"

SourceRow = tuple[int, Any, str | None]


class RowError(ValueError):
    """Why one source row cannot be used (becomes its quarantine reason)."""


def iter_source_rows(path: Path) -> Iterator[SourceRow]:
    """Yield (row number, parsed object or None, error) for each row of a jsonl, json or parquet file. A row
    with an error comes with a text preview of itself in place of the object."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_rows(path)
    elif suffix == ".json":
        yield from _json_document_rows(path)
    else:
        yield from _jsonl_rows(path)


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """How many containers (dicts, lists, tuples) are nested in `value`: 0 for a scalar, 1 for `{}`. Counted
    with an explicit stack, not recursion, and it stops as soon as the depth passes `limit` (the result is
    then `limit + 1`), so a hostile value costs at most its size and never a deep Python stack."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))
    return deepest


def json_problem(error: ValueError | RecursionError) -> str:
    """The reason a JSON text could not be parsed, in words: the decoder's message for bad syntax, and the
    real cause where the decoder gives up on valid JSON (nesting past the recursion limit, an integer past
    Python's digit limit for int conversion)."""
    if isinstance(error, RecursionError):
        return f"{NESTED_TOO_DEEP} (deeper than the JSON parser can read)"
    if isinstance(error, json.JSONDecodeError):
        return f"bad JSON: {error.msg} at column {error.colno}"
    digits = re.search(r"value has (\d+) digits", str(error))
    if digits:
        return (
            f"a number too long to read ({int(digits.group(1)):,} digits; Python converts at most "
            f"{sys.get_int_max_str_digits():,})"
        )
    return f"bad JSON: {error}"


def _loads(text: str) -> tuple[Any, str | None]:
    """One JSON value and None, or None and why it cannot be used (unparseable, or nested too deep)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        return None, json_problem(e)
    # Only a text with more brackets than the limit can nest deeper than it: most rows skip the walk.
    if text.count("[") + text.count("{") > MAX_NESTING and nesting_depth(value) > MAX_NESTING:
        return None, NESTED_TOO_DEEP
    return value, None


def _jsonl_rows(path: Path) -> Iterator[SourceRow]:
    with open(path, "rb") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                preview = line[:RAW_PREVIEW_CHARS].decode("utf-8", "replace")
                yield i, preview, f"invalid UTF-8 at byte {e.start}"
                continue
            value, problem = _loads(text)
            yield (i, text[:RAW_PREVIEW_CHARS], problem) if problem else (i, value, None)


def _json_document_rows(path: Path) -> Iterator[SourceRow]:
    """The rows of a `.json` document (a list, or `{"data": [...]}`). The document is one value: if it does
    not parse, no row of it can be used, and the error names the file."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RowError(f"{path}: not a readable JSON document (invalid UTF-8 at byte {e.start})") from e
    except (ValueError, RecursionError) as e:
        raise RowError(
            f"{path}: not a readable JSON document ({json_problem(e)}); a document cannot be used in part: "
            "write it as .jsonl (one object per line) so that a bad row is quarantined alone"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise RowError(f"{path}: a .json source must hold a list of objects")
    for i, row in enumerate(data):
        if nesting_depth(row) > MAX_NESTING:
            yield i, _preview_text(row), NESTED_TOO_DEEP
        else:
            yield i, row, None


def _parquet_rows(path: Path) -> Iterator[SourceRow]:
    """The rows of a Parquet file. Its schema is read first with pyarrow, which refuses a schema nested past
    its own limit cleanly (Polars' reader overflows the stack on such a file and kills the process); columns
    nested deeper than MAX_NESTING are measured row by row, and a row whose value is that deep is
    quarantined."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        frame = pl.read_parquet(path)
    except (OSError, pa.ArrowException, pl.exceptions.PolarsError) as e:
        raise RowError(
            f"{path}: not a readable Parquet file ({e}); a Parquet file's schema is shared by every row, so "
            "none of it can be used: flatten or drop the offending column"
        ) from None
    # The row is one level, so a column may nest one less than a row.
    deep = [f.name for f in schema if _type_depth(f.type) >= MAX_NESTING]
    for i, row in enumerate(frame.iter_rows(named=True)):
        too_deep = [c for c in deep if nesting_depth(row[c], MAX_NESTING - 1) >= MAX_NESTING]
        if too_deep:
            yield (
                i,
                _preview_text({k: v for k, v in row.items() if k not in deep}),
                (f"{NESTED_TOO_DEEP} (column {too_deep[0]!r})"),
            )
        else:
            yield i, row, None


def _type_depth(dtype: Any) -> int:
    """Containers nested in an Arrow type (lists, structs, maps), counted without recursion."""
    import pyarrow as pa

    deepest = 0
    stack = [(dtype, 0)]
    while stack:
        t, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(t, pa.ListType | pa.LargeListType | pa.FixedSizeListType):
            stack.append((t.value_type, depth + 1))
        elif isinstance(t, pa.MapType):
            stack += [(t.key_type, depth + 1), (t.item_type, depth + 1)]
        elif isinstance(t, pa.StructType):
            stack += [(t.field(j).type, depth + 1) for j in range(t.num_fields)]
    return deepest


def _preview_text(value: Any) -> str:
    """A short JSON preview of a row for the quarantine, from a clipped copy (`clip`): a huge row is never
    serialised whole."""
    return json.dumps(clip(value), ensure_ascii=False, default=str)[:RAW_PREVIEW_CHARS]


def clip(value: Any, budget: int = RAW_PREVIEW_CHARS) -> Any:
    """A copy of `value` small enough to serialise for a preview, whatever the row was: about `budget`
    characters of strings and entries in all (each string cut to what is left, each container stopped when
    nothing is left, "…" where something was cut), and nothing nested past MAX_NESTING."""
    return _Clipper(budget).copy(value, 0)


class _Clipper:
    def __init__(self, budget: int):
        self.left = budget

    def copy(self, value: Any, depth: int) -> Any:
        if isinstance(value, str):
            kept = value[: max(self.left, 0)]
            self.left -= len(kept)
            return kept if len(kept) == len(value) else kept + "…"
        if not isinstance(value, dict | list | tuple):
            return value
        if depth >= MAX_NESTING:
            return "…"
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            for k, v in value.items():
                if self.left <= 0:
                    out["…"] = "…"
                    break
                self.left -= 1
                out[str(k)[:80]] = self.copy(v, depth + 1)
            return out
        items: list[Any] = []
        for v in value:
            if self.left <= 0:
                items.append("…")
                break
            self.left -= 1
            items.append(self.copy(v, depth + 1))
        return items
