"""Read-side access to every partition's files where they are stored, for readers that span partitions (the
DuckDB warehouse): a local root as paths, an object-store root through its obstore store, without the
per-partition working copies the stages use (a reader of eight partitions should not mirror eight folders).

Paths given and returned are relative to the root (`B3/responses`); `sql_path` is how DuckDB names the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .quarantine import has_parquet_magic


class RootFiles(Protocol):
    def parquet_files(self, folder: str) -> list[str]:
        """The readable Parquet files directly in `folder`, by name (hidden names and files cut short or not
        Parquet are left out, as `JournalTable.files` does), as DuckDB paths."""
        ...

    def sql_path(self, rel: str) -> str | None:
        """DuckDB's path of the file `rel`, or None where it does not exist."""
        ...

    def read_text(self, rel: str) -> str | None: ...

    def write_text(self, rel: str, text: str) -> str:
        """Write `rel` (whole, replacing it); returns where it went."""
        ...

    def attach(self, con: Any) -> None:
        """Make this root's paths readable by the DuckDB connection `con`."""
        ...


@dataclass
class LocalRootFiles:
    root: Path

    def parquet_files(self, folder: str) -> list[str]:
        d = self.root / folder
        if not d.is_dir():
            return []
        files = sorted(p for p in d.glob("*.parquet") if not p.name.startswith("."))
        return [str(p) for p in files if has_parquet_magic(p)]

    def sql_path(self, rel: str) -> str | None:
        p = self.root / rel
        return str(p) if p.is_file() else None

    def read_text(self, rel: str) -> str | None:
        p = self.root / rel
        return p.read_text(encoding="utf-8") if p.is_file() else None

    def write_text(self, rel: str, text: str) -> str:
        from .files import write_text

        return str(write_text(text, self.root / rel))

    def attach(self, con: Any) -> None:
        pass  # DuckDB reads local paths itself


@dataclass
class ObjectRootFiles:
    """`storage.root` in an object store (s3://bucket/prefix, ...), with `storage.options`."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from .object_fs import ObjectStoreFileSystem
        from .remote_writes import make_store

        self.url = self.url.rstrip("/")
        self.store = make_store(self.url, self.options)
        self.fs = ObjectStoreFileSystem(self.store)

    def parquet_files(self, folder: str) -> list[str]:
        keys = [
            k
            for k in self.fs.list_files(folder)
            if k.endswith(".parquet") and not k.rsplit("/", 1)[-1].startswith(".")
        ]
        # A ranged read or two per object, each a round trip: asked together (a part per flush adds up).
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=16) as pool:
            whole = list(pool.map(self.fs.is_parquet, keys))
        return [self.fs.url(k) for k, ok in zip(keys, whole, strict=True) if ok]

    def sql_path(self, rel: str) -> str | None:
        return self.fs.url(rel) if self.fs.exists(rel) else None

    def read_text(self, rel: str) -> str | None:
        try:
            return self.fs.cat_file(rel).decode("utf-8")
        except FileNotFoundError:
            return None
        except Exception as e:
            from obstore.exceptions import NotFoundError

            if isinstance(e, NotFoundError):
                return None
            raise

    def write_text(self, rel: str, text: str) -> str:
        import obstore

        obstore.put(self.store, rel, text.encode("utf-8"))
        return f"{self.url}/{rel}"

    def attach(self, con: Any) -> None:
        con.register_filesystem(self.fs)


def root_files(root: str | Path, options: dict[str, Any] | None = None, remote: bool = False) -> RootFiles:
    """The files of the storage root `root`: an object store when `remote`, else a local folder."""
    if remote:
        return ObjectRootFiles(str(root), dict(options or {}))
    return LocalRootFiles(Path(root))
