"""Inputs versions (core/storage/data_version.py): each kind of input change moves the version, a rewrite of
the same bytes does not, and the record beside an output is found again only for the same inputs."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from pydantic import BaseModel

from eagle3_assets.core.storage import data_version as dv


class Settings(BaseModel):
    k: int = 3
    lr: float = 1e-3


def _shard(path: Path, meta: dict, payload: bytes) -> None:
    header = json.dumps({"__metadata__": meta}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)


def test_files_version_follows_content_not_rewrites(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.parquet").write_bytes(b"one")
    (tmp_path / "a" / ".tmp-ignored").write_bytes(b"junk")
    v0 = dv.files_version([tmp_path / "a"], tmp_path)
    # The same bytes rewritten (new mtime): same version.
    (tmp_path / "a" / "x.parquet").write_bytes(b"one")
    os.utime(tmp_path / "a" / "x.parquet", ns=(1, 1))
    assert dv.files_version([tmp_path / "a"], tmp_path) == v0
    # A hidden temporary does not count; a file added, changed or removed does.
    (tmp_path / "a" / ".other.tmp").write_bytes(b"more junk")
    assert dv.files_version([tmp_path / "a"], tmp_path) == v0
    (tmp_path / "a" / "y.parquet").write_bytes(b"two")
    v1 = dv.files_version([tmp_path / "a"], tmp_path)
    assert v1 != v0
    (tmp_path / "a" / "y.parquet").write_bytes(b"tw0")
    assert dv.files_version([tmp_path / "a"], tmp_path) not in (v0, v1)
    (tmp_path / "a" / "y.parquet").unlink()
    assert dv.files_version([tmp_path / "a"], tmp_path) == v0
    # A missing file is an input too.
    assert dv.files_version([tmp_path / "none.json"], tmp_path) != dv.files_version([], tmp_path)


def test_large_files_by_header_and_stored_identity(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(dv, "CONTENT_HASH_LIMIT", 16)
    shard = tmp_path / "hs" / "shard-1.safetensors"
    shard.parent.mkdir()
    _shard(shard, {"layers": "[1, 2, 3]"}, b"\0" * 64)
    st = shard.stat()
    v0 = dv.files_version([shard.parent], tmp_path)
    assert "mtime_ns=" in dv.file_identity(shard)
    # Rewritten in place with other layers (same size): the header moves it.
    _shard(shard, {"layers": "[4, 5, 6]"}, b"\0" * 64)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert dv.files_version([shard.parent], tmp_path) != v0
    # A working copy's manifest vouches for the file: its ETag is the identity, whatever the local mtime was
    # when it was pulled (a fresh pod's copy gives the same version).
    st = shard.stat()
    manifest = {"hs/shard-1.safetensors": ["etag-1", st.st_size, st.st_mtime_ns]}
    (tmp_path / dv.REMOTE_MANIFEST).write_text(json.dumps(manifest))
    assert dv.file_identity(shard).endswith("etag=etag-1")
    a = dv.files_version([shard.parent], tmp_path)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5))
    manifest["hs/shard-1.safetensors"][2] = st.st_mtime_ns + 5
    (tmp_path / dv.REMOTE_MANIFEST).write_text(json.dumps(manifest))
    assert dv.files_version([shard.parent], tmp_path) == a
    # A local file the manifest does not describe (written since): its mtime, not the stale ETag.
    shard.write_bytes(shard.read_bytes())
    assert "mtime_ns=" in dv.file_identity(shard)


def test_settings_and_sources_versions(tmp_path: Path) -> None:
    assert dv.settings_version(Settings()) == dv.settings_version({"lr": 1e-3, "k": 3})
    assert dv.settings_version(Settings(k=4)) != dv.settings_version(Settings())
    (tmp_path / "m.py").write_text("x = 1\n")
    v = dv.sources_version(tmp_path)
    (tmp_path / "m.py").write_text("x = 2\n")
    assert dv.sources_version(tmp_path) != v


def test_record_and_lookup(tmp_path: Path) -> None:
    a = dv.InputsVersion.of({"states": "1", "settings": "2", "code": "3"})
    assert dv.recorded_inputs_version(tmp_path) is None and dv.unchanged_since(tmp_path, a) is None
    rec = dv.record_inputs_version(tmp_path, a)
    found = dv.unchanged_since(tmp_path, a)
    assert found is not None and found.inputs == a and found.recorded_at == rec.recorded_at
    b = dv.InputsVersion.of({"states": "1", "settings": "changed", "code": "3"})
    assert b.version != a.version and b.changed(a) == ["settings"]
    assert dv.unchanged_since(tmp_path, b) is None
    (tmp_path / dv.INPUTS_VERSION).write_text("{not json")
    assert dv.recorded_inputs_version(tmp_path) is None
