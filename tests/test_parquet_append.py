"""Appending row groups to a Parquet file without decoding it: the footer codec keeps every byte it does not
change, and what comes out reads the same in every reader the platform and its users have (polars, pyarrow,
duckdb)."""

from __future__ import annotations

import struct

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from eagle3_assets.core.storage.parquet_append import append_file, encode_footer, read_footer

SCHEMA = {
    "id": pl.String,
    "ids": pl.List(pl.Int32),
    "flag": pl.Boolean,
    "score": pl.Float64,
    "kind": pl.String,
}


def frame(prefix: str, n: int, offset: int = 0) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "id": [f"{prefix}{i}" for i in range(n)],
            "ids": [list(range(i % 7 + offset)) for i in range(n)],
            "flag": [None if i % 5 == 0 else i % 2 == 0 for i in range(n)],
            "score": [i / 3 for i in range(n)],
            "kind": [None if i % 4 == 0 else f"k{i % 3}" for i in range(n)],
        },
        schema=SCHEMA,
    )


def write(df: pl.DataFrame, path, metadata: dict[str, str], **options) -> None:
    table = df.to_arrow()
    writer = pq.ParquetWriter(path, table.schema.with_metadata(metadata), compression="zstd", **options)
    for start in range(0, df.height, 100):  # several row groups
        writer.write_table(df[start : start + 100].to_arrow().replace_schema_metadata(metadata))
    writer.close()


WRITER_OPTIONS = [
    {},
    {"use_dictionary": ["kind"]},
    {"write_page_index": True},
    {"compression_level": 1, "write_statistics": ["id"]},
]


@pytest.mark.parametrize("options", WRITER_OPTIONS)
def test_the_footer_codec_round_trips_byte_for_byte(tmp_path, options):
    write(frame("a", 350), tmp_path / "f.parquet", {"k": "v"}, **options)
    raw = (tmp_path / "f.parquet").read_bytes()
    n = struct.unpack("<I", raw[-8:-4])[0]
    footer, start = read_footer(tmp_path / "f.parquet")
    assert start == len(raw) - 8 - n
    assert encode_footer(footer) == raw[start:-8]


@pytest.mark.parametrize("options", WRITER_OPTIONS)
def test_appended_rows_read_the_same_in_polars_pyarrow_and_duckdb(tmp_path, options):
    base, extra = frame("a", 350), frame("b", 130, offset=3)
    write(base, tmp_path / "base.parquet", {"state": "1"}, **options)
    write(extra, tmp_path / "extra.parquet", {"state": "2"}, **options)
    assert append_file(tmp_path / "base.parquet", tmp_path / "extra.parquet", tmp_path / "out.parquet") == 480
    out = tmp_path / "out.parquet"
    expected = pl.concat([base, extra])
    assert pl.read_parquet(out).equals(expected)
    assert pq.read_table(out).select(list(SCHEMA)).equals(expected.to_arrow())
    assert pq.read_schema(out).metadata[b"state"] == b"2"  # the appended file's metadata wins
    got = duckdb.sql(f"select count(*), sum(len(ids)), count(kind) from '{out}'").fetchall()
    assert got == [(480, int(expected["ids"].list.len().sum()), expected["kind"].count())]
    # Row-group statistics still point at the right bytes: a filter that prunes by them finds the new rows.
    assert pl.scan_parquet(out).filter(pl.col("id") == "b129").collect()["score"].item() == 129 / 3
    # The old bytes were copied, not re-encoded.
    _, base_end = read_footer(tmp_path / "base.parquet")
    assert out.read_bytes()[:base_end] == (tmp_path / "base.parquet").read_bytes()[:base_end]
    # And again onto the result (a second top-up).
    append_file(out, tmp_path / "extra.parquet", tmp_path / "out2.parquet")
    assert pl.read_parquet(tmp_path / "out2.parquet").equals(pl.concat([base, extra, extra]))


def test_an_empty_file_appends_nothing_but_its_metadata(tmp_path):
    write(frame("a", 120), tmp_path / "base.parquet", {"state": "1"})
    write(frame("b", 0), tmp_path / "empty.parquet", {"state": "2"})
    append_file(tmp_path / "base.parquet", tmp_path / "empty.parquet", tmp_path / "out.parquet")
    assert pl.read_parquet(tmp_path / "out.parquet").equals(frame("a", 120))
    assert pq.read_schema(tmp_path / "out.parquet").metadata[b"state"] == b"2"


def test_files_that_cannot_be_appended_are_refused(tmp_path):
    write(frame("a", 10), tmp_path / "base.parquet", {})
    other = frame("b", 10).with_columns(pl.col("score").cast(pl.Float32))
    write(other, tmp_path / "other.parquet", {})
    with pytest.raises(ValueError, match="schemas differ"):
        append_file(tmp_path / "base.parquet", tmp_path / "other.parquet", tmp_path / "out.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(ValueError, match="not a Parquet file"):
        append_file(tmp_path / "junk.parquet", tmp_path / "base.parquet", tmp_path / "out.parquet")
