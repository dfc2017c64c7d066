"""Inputs versions: a short stable hash of everything a computation reads (files, settings, code), recorded
beside its output, so a rerun with nothing changed re-reports the stored output instead of recomputing it.

A file's identity is what is cheap and correct on a local root and on an object-store working copy alike:

- a file up to `CONTENT_HASH_LIMIT` bytes (prompts, tokens, indexes, answers' parts, reports): its content
  hash. Content, not mtime: a stage that rewrites the same bytes (an index rebuilt, a pod's fresh working copy
  pulled from the store) keeps the version;
- a larger file (hidden-state shards): its size, its safetensors header for a shard (the header names the
  model, layers, dtype and each sample's content hash), and its stored identity: the object's ETag where the
  working copy's manifest vouches for the local file (same size and mtime as when it was pulled or pushed),
  else its mtime_ns. A shard rewritten in place changes the ETag or the mtime; one that did not does not, and
  hashing gigabytes of states on every rerun would cost what the rerun is meant to save.

Settings enter as canonical JSON (pydantic models dumped with sorted keys); code as a version string (e.g.
`sources_version` of the package that computes the output). `InputsVersion.parts` keeps each input's own
version, so a rerun can say what changed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .files import write_json

CONTENT_HASH_LIMIT = 64 << 20  # bytes: files up to this size are hashed whole
INPUTS_VERSION = "inputs_version.json"
REMOTE_MANIFEST = ".remote-manifest.json"  # the object-store working copy's (storage.remote.MANIFEST)
_SAFETENSORS_HEADER_LIMIT = 100 << 20


def _digest(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _content_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    """The shard's JSON header (tensor names, shapes, offsets and the metadata), or nothing if unreadable."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return b""
        (n,) = struct.unpack("<Q", head)
        return fh.read(n) if n <= _SAFETENSORS_HEADER_LIMIT else b""


@dataclass
class _Manifests:
    """The object-store working copies' manifests above the files versioned (read once each)."""

    cache: dict[Path, dict[str, list]] = field(default_factory=dict)

    def etag(self, path: Path, size: int, mtime_ns: int) -> str | None:
        """The ETag the manifest of `path`'s working copy records for it, if the local file is the one that
        was pulled or pushed (same size and mtime_ns)."""
        for folder in path.parents:
            manifest = folder / REMOTE_MANIFEST
            if folder not in self.cache:
                self.cache[folder] = json.loads(manifest.read_text()) if manifest.exists() else {}
            entries = self.cache[folder]
            if entries:
                entry = entries.get(path.relative_to(folder).as_posix())
                if entry and len(entry) >= 3 and int(entry[1]) == size and int(entry[2]) == mtime_ns:
                    return str(entry[0])
                return None
        return None


def file_identity(path: Path, manifests: _Manifests | None = None) -> str:
    """One file's identity (see the module's docstring); "missing" for a file that does not exist."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing"
    if st.st_size <= CONTENT_HASH_LIMIT:
        return f"{st.st_size}:{_content_hash(path)}"
    stored = (manifests or _Manifests()).etag(path, st.st_size, st.st_mtime_ns)
    header = _digest(_safetensors_header(path)) if path.suffix == ".safetensors" else "-"
    return f"{st.st_size}:{header}:" + (f"etag={stored}" if stored else f"mtime_ns={st.st_mtime_ns}")


def files_version(paths: Iterable[Path], base: Path) -> str:
    """The version of a set of files (or folders: every file under them, hidden ones left out), by path
    relative to `base`: a file added, removed, renamed or rewritten changes it."""
    manifests = _Manifests()
    found: dict[str, str] = {}
    for p in paths:
        p = Path(p)
        files = (
            [f for f in sorted(p.rglob("*")) if f.is_file() and not _hidden(f.relative_to(p))]
            if p.is_dir()
            else [p]
        )
        for f in files:
            found[f.relative_to(base).as_posix()] = file_identity(f, manifests)
    return _digest(json.dumps(found, sort_keys=True))


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def settings_version(settings: BaseModel | Mapping[str, Any] | str | int | float | None) -> str:
    """Settings as canonical JSON (keys sorted), hashed: the same settings give the same version however they
    were written."""
    value = settings.model_dump(mode="json") if isinstance(settings, BaseModel) else settings
    return _digest(json.dumps(value, sort_keys=True, default=str))


def sources_version(folder: Path, pattern: str = "*.py") -> str:
    """A code version from the sources under `folder` (their names and bytes): it moves with every edit, so a
    stored result can never outlive the code that computed it."""
    files = sorted(Path(folder).rglob(pattern))
    return _digest(
        json.dumps({f.relative_to(folder).as_posix(): _content_hash(f) for f in files}, sort_keys=True)
    )


@dataclass(frozen=True)
class InputsVersion:
    """The version of everything a computation read, and each input's own (named parts)."""

    version: str
    parts: dict[str, str]

    @classmethod
    def of(cls, parts: Mapping[str, str]) -> InputsVersion:
        ordered = dict(sorted(parts.items()))
        return cls(version=_digest(json.dumps(ordered)), parts=ordered)

    def changed(self, other: InputsVersion | None) -> list[str]:
        """The parts whose version differs from `other`'s (every part where there is no other)."""
        if other is None:
            return sorted(self.parts)
        names = set(self.parts) | set(other.parts)
        return sorted(n for n in names if self.parts.get(n) != other.parts.get(n))


@dataclass(frozen=True)
class RecordedVersion:
    """An output's recorded inputs version, and when the output was computed from them."""

    inputs: InputsVersion
    recorded_at: str  # ISO 8601, UTC


def record_inputs_version(folder: Path, inputs: InputsVersion) -> RecordedVersion:
    """Record, beside an output just written in `folder`, the inputs it was computed from. Write it last: an
    output whose computation failed keeps the previous record (or none), so it is recomputed."""
    rec = RecordedVersion(inputs, datetime.now(UTC).isoformat(timespec="seconds"))
    write_json(
        {"version": inputs.version, "parts": inputs.parts, "recorded_at": rec.recorded_at},
        Path(folder) / INPUTS_VERSION,
    )
    return rec


def recorded_inputs_version(folder: Path) -> RecordedVersion | None:
    """The inputs version recorded in `folder`, None where none is (or it cannot be read: recompute)."""
    path = Path(folder) / INPUTS_VERSION
    try:
        raw = json.loads(path.read_text())
        parts = {k: str(v) for k, v in raw["parts"].items()}
        inputs = InputsVersion(version=str(raw["version"]), parts=parts)
        return RecordedVersion(inputs, str(raw["recorded_at"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None


def unchanged_since(folder: Path, inputs: InputsVersion) -> RecordedVersion | None:
    """The record in `folder` if it was computed from exactly `inputs`, else None (compute again)."""
    rec = recorded_inputs_version(folder)
    return rec if rec is not None and rec.inputs.version == inputs.version else None


def forget_inputs_version(folder: Path) -> None:
    """Remove the record before an output is recomputed: a computation that dies halfway leaves no record
    naming inputs that the output in the folder no longer matches."""
    (Path(folder) / INPUTS_VERSION).unlink(missing_ok=True)
