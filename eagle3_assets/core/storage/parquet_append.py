"""Append row groups to a Parquet file without decoding the ones it already has.

A top-up adds 1,000 rows to a tokens.parquet of 200,000: re-encoding the whole file (gigabytes) for that is
what made a top-up cost a tenth of a full build. A Parquet file is its column-chunk bytes followed by one
footer that lists the row groups by byte offset, so appending is: the old file's bytes up to its footer, then
the new file's row-group bytes, then one footer naming both sets of row groups, the new ones' offsets shifted
by where their bytes now start.

pyarrow writes only whole files (its writer refuses to start at a non-zero position) and cannot edit a footer,
and fastparquet's footer codec drops the fields it does not know; so the footer is handled here by a small
codec of Thrift's compact protocol (the footer's wire format) that keeps every field it reads, known or not,
and changes only the offsets and the row count. Its round trip is byte-exact (tested on pyarrow-written
files).
"""

from __future__ import annotations

import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import cast

# Compact-protocol type ids.
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT, _UUID = range(1, 14)
MAGIC = b"PAR1"


@dataclass
class Field:
    id: int
    type: int
    value: object  # int | bool | float | bytes | Struct | ListValue | MapValue


@dataclass
class ListValue:
    elem_type: int
    items: list


@dataclass
class MapValue:
    key_type: int
    value_type: int
    items: list[tuple[object, object]]


@dataclass
class Struct:
    fields: list[Field]

    def get(self, fid: int) -> Field | None:
        return next((f for f in self.fields if f.id == fid), None)

    def required(self, fid: int) -> Field:
        """A field every Parquet footer holds (schema, row groups, row count)."""
        found = self.get(fid)
        if found is None:
            raise ValueError(f"cannot append: the Parquet footer has no field {fid}")
        return found


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def byte(self) -> int:
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, t: int) -> object:
        if t in (_TRUE, _FALSE):  # only inside lists/maps: one byte, kept as read
            return self.byte()
        if t == _BYTE:
            return self.byte()
        if t in (_I16, _I32, _I64):
            return self.zigzag()
        if t == _DOUBLE:
            self.pos += 8
            return self.buf[self.pos - 8 : self.pos]
        if t == _BINARY:
            n = self.varint()
            self.pos += n
            return self.buf[self.pos - n : self.pos]
        if t == _UUID:
            self.pos += 16
            return self.buf[self.pos - 16 : self.pos]
        if t in (_LIST, _SET):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            return ListValue(elem, [self.value(elem) for _ in range(size)])
        if t == _MAP:
            size = self.varint()
            if not size:
                return MapValue(0, 0, [])
            kinds = self.byte()
            kt, vt = kinds >> 4, kinds & 0x0F
            return MapValue(kt, vt, [(self.value(kt), self.value(vt)) for _ in range(size)])
        if t == _STRUCT:
            return self.struct()
        raise ValueError(f"unknown Thrift compact type {t} at byte {self.pos}")

    def struct(self) -> Struct:
        fields: list[Field] = []
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return Struct(fields)
            delta, t = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            if t in (_TRUE, _FALSE):
                value: object = t == _TRUE
            else:
                value = self.value(t)
            fields.append(Field(fid, t, value))
            last = fid


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while True:
            if n < 0x80:
                self.out.append(n)
                return
            self.out.append((n & 0x7F) | 0x80)
            n >>= 7

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, t: int, v: object) -> None:
        if t in (_TRUE, _FALSE, _BYTE):
            self.out.append(cast(int, v))
        elif t in (_I16, _I32, _I64):
            self.zigzag(cast(int, v))
        elif t in (_DOUBLE, _UUID):
            self.out += cast(bytes, v)
        elif t == _BINARY:
            self.varint(len(cast(bytes, v)))
            self.out += cast(bytes, v)
        elif t in (_LIST, _SET):
            lv = cast(ListValue, v)
            n = len(lv.items)
            if n < 15:
                self.out.append((n << 4) | lv.elem_type)
            else:
                self.out.append(0xF0 | lv.elem_type)
                self.varint(n)
            for item in lv.items:
                self.value(lv.elem_type, item)
        elif t == _MAP:
            mv = cast(MapValue, v)
            self.varint(len(mv.items))
            if mv.items:
                self.out.append((mv.key_type << 4) | mv.value_type)
                for k, x in mv.items:
                    self.value(mv.key_type, k)
                    self.value(mv.value_type, x)
        elif t == _STRUCT:
            self.struct(cast(Struct, v))
        else:
            raise ValueError(f"unknown Thrift compact type {t}")

    def struct(self, s: Struct) -> None:
        last = 0
        for f in s.fields:
            t = (_TRUE if f.value else _FALSE) if f.type in (_TRUE, _FALSE) else f.type
            delta = f.id - last
            if 0 < delta <= 15:
                self.out.append((delta << 4) | t)
            else:
                self.out.append(t)
                self.zigzag(f.id)
            if t not in (_TRUE, _FALSE):
                self.value(t, f.value)
            last = f.id
        self.out.append(0)


def decode_footer(raw: bytes) -> Struct:
    return _Reader(raw).struct()


def encode_footer(footer: Struct) -> bytes:
    w = _Writer()
    w.struct(footer)
    return bytes(w.out)


# Field ids of parquet.thrift that this module reads or changes.
_FMD_SCHEMA, _FMD_NUM_ROWS, _FMD_ROW_GROUPS = 2, 3, 4
_RG_COLUMNS, _RG_FILE_OFFSET, _RG_ORDINAL = 1, 6, 7
_CC_FILE_OFFSET, _CC_META, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX = 2, 3, 4, 6
_CM_OFFSETS = (
    9,
    10,
    11,
    14,
)  # data_page_offset, index_page_offset, dictionary_page_offset, bloom_filter_offset


def read_footer(path: Path) -> tuple[Struct, int]:
    """(the decoded footer, the byte offset where it starts = the end of the row-group bytes)."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size < 12 or fh.read(4) != MAGIC:
            raise ValueError(f"{path} is not a Parquet file")
        fh.seek(size - 8)
        tail = fh.read(8)
        if tail[4:] != MAGIC:
            raise ValueError(
                f"{path} is not a Parquet file (no footer magic; encrypted files are not handled)"
            )
        n = struct.unpack("<I", tail[:4])[0]
        fh.seek(size - 8 - n)
        return decode_footer(fh.read(n)), size - 8 - n


def _shift(s: Struct | None, fids: tuple[int, ...], delta: int) -> None:
    for fid in fids:
        f = s.get(fid) if s is not None else None
        if f is not None and isinstance(f.value, int) and f.value > 0:  # 0 / absent: not set
            f.value += delta


def append_file(base: Path, extra: Path, out: Path) -> int:
    """Write `out` = the rows of `base` followed by the rows of `extra`, copying both files' page bytes as
    they are. The schemas must be identical; the key-value metadata (and writer) of `extra` wins, so a file
    written with new metadata carries it. Returns the row count of `out`."""
    base_footer, base_end = read_footer(base)
    extra_footer, extra_end = read_footer(extra)
    if base_footer.get(_FMD_SCHEMA) != extra_footer.get(_FMD_SCHEMA):
        raise ValueError("cannot append: the two files' schemas differ")
    delta = base_end - len(MAGIC)  # extra's bytes [4, extra_end) land at base_end
    base_groups = cast(ListValue, base_footer.required(_FMD_ROW_GROUPS).value)
    extra_groups = cast(ListValue, extra_footer.required(_FMD_ROW_GROUPS).value)
    for k, group in enumerate(extra_groups.items):
        _shift(group, (_RG_FILE_OFFSET,), delta)
        ordinal = group.get(_RG_ORDINAL)
        if ordinal is not None:
            ordinal.value = len(base_groups.items) + k
        for chunk in group.get(_RG_COLUMNS).value.items:
            if chunk.get(1) is not None:  # file_path: the chunk lives in another file
                raise ValueError("cannot append: row groups that point into other files")
            _shift(chunk, (_CC_FILE_OFFSET, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX), delta)
            meta = chunk.get(_CC_META)
            _shift(meta.value if meta is not None else None, _CM_OFFSETS, delta)
    merged = Struct([Field(f.id, f.type, f.value) for f in extra_footer.fields])
    merged.required(_FMD_ROW_GROUPS).value = ListValue(_STRUCT, base_groups.items + extra_groups.items)
    rows = cast(int, base_footer.required(_FMD_NUM_ROWS).value) + cast(
        int, extra_footer.required(_FMD_NUM_ROWS).value
    )
    merged.required(_FMD_NUM_ROWS).value = rows
    footer = encode_footer(merged)
    shutil.copyfile(base, out)  # sendfile / copy_file_range: no Python in the copy
    with open(out, "r+b") as dst, open(extra, "rb") as src:
        dst.truncate(base_end)
        dst.seek(base_end)
        src.seek(len(MAGIC))
        remaining = extra_end - len(MAGIC)
        while remaining:
            block = src.read(min(remaining, 1 << 22))
            if not block:
                raise ValueError(f"{extra} ended early")
            dst.write(block)
            remaining -= len(block)
        dst.write(footer)
        dst.write(struct.pack("<I", len(footer)))
        dst.write(MAGIC)
    return int(rows)
