"""A read-only fsspec filesystem over the project's obstore store, so DuckDB reads the storage root's Parquet
files where they are (`duckdb.register_filesystem`).

Why not DuckDB's own S3 support: its httpfs extension is downloaded at first use, which an offline or
locked-down machine cannot do, and it would need the store's settings spelled a second time. This adapter
reuses the store `remote_writes.make_store` builds from `storage.root` and `storage.options` (endpoint,
region, proxy, retries), so whatever the stages can reach, the warehouse can read. Paths are
`<protocol>://<key relative to the root>`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import obstore
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem
from obstore.exceptions import NotFoundError

PROTOCOL = "eagle3root"
PARQUET_MAGIC = b"PAR1"
# The last bytes of each object read once and kept: a Parquet footer (schema, row groups) is read again
# each time DuckDB binds a view over the file, and every view built on a view binds it again.
TAIL_BYTES = 64 * 1024


class _ObjectFile(AbstractBufferedFile):
    """One object, read by ranged GETs (DuckDB reads a Parquet footer, then only the columns it needs)."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        fs: ObjectStoreFileSystem = self.fs
        if end <= start:
            return b""
        key = fs.key(self.path)
        tail_start, tail = fs.tail(key)
        if start >= tail_start:
            return tail[start - tail_start : end - tail_start]
        return bytes(obstore.get_range(fs.store, key, start=start, end=end))


class ObjectStoreFileSystem(AbstractFileSystem):
    """The objects under a store's prefix, read-only. `info` answers from the last listing when it can (DuckDB
    asks for a file's size several times per query), and each object's tail is fetched once (`tail`)."""

    protocol = PROTOCOL
    cachable = False  # one instance per store: fsspec's instance cache would share it between roots

    def __init__(self, store: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.store = store
        self._meta: dict[str, dict[str, Any]] = {}
        self._tails: dict[str, tuple[int, bytes]] = {}

    def key(self, path: str) -> str:
        p = path.split("://", 1)[1] if "://" in path else path
        return p.strip("/")

    def url(self, key: str) -> str:
        return f"{PROTOCOL}://{key}"

    def list_files(self, prefix: str) -> list[str]:
        """Keys of the objects directly under `prefix` (a folder key), sorted."""
        folder = prefix.strip("/") + "/"
        out = []
        for batch in obstore.list(self.store, prefix=folder):
            for meta in batch:
                name = str(meta["path"])
                if "/" not in name[len(folder) :]:
                    self._meta[name] = _entry(self.url(name), meta)
                    out.append(name)
        return sorted(out)

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return False

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        k = self.key(path)
        if k not in self._meta:
            try:
                self._meta[k] = _entry(self.url(k), obstore.head(self.store, k))
            except NotFoundError as e:  # fsspec's callers (DuckDB's included) expect the builtin
                raise FileNotFoundError(path) from e
        return self._meta[k]

    def modified(self, path: str) -> datetime:
        return self.info(path)["modified"]

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        keys = self.list_files(self.key(path))
        return [self._meta[k] for k in keys] if detail else [self.url(k) for k in keys]

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        if start is None and end is None:
            return bytes(obstore.get(self.store, self.key(path)).bytes())
        return super().cat_file(path, start, end, **kwargs)

    def tail(self, key: str) -> tuple[int, bytes]:
        """(offset, bytes) of the object's last `TAIL_BYTES` (all of a smaller one), fetched once. Objects
        are immutable here (parts are written once; a replaced file has a new listing entry), and the cache
        lives as long as this filesystem: one warehouse connection."""
        if key not in self._tails:
            size = self.info(key)["size"]
            start = max(0, size - TAIL_BYTES)
            self._tails[key] = (start, bytes(obstore.get_range(self.store, key, start=start, end=size)))
        return self._tails[key]

    def is_parquet(self, key: str) -> bool:
        """Both ends say PAR1: an object cut short or not Parquet at all fails (as `has_parquet_magic`)."""
        size = self.info(key)["size"]
        if size < 8:
            return False
        start, tail = self.tail(key)
        head = tail[:4] if start == 0 else bytes(obstore.get_range(self.store, key, start=0, end=4))
        return head == PARQUET_MAGIC and tail[-4:] == PARQUET_MAGIC

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict | None = None,
        **kwargs: Any,
    ) -> _ObjectFile:
        if mode != "rb":
            raise PermissionError(f"{PROTOCOL}:// is read-only (asked to open {path} with mode {mode!r})")
        return _ObjectFile(
            self,
            path,
            mode,
            block_size=block_size or 4 * 2**20,
            cache_options=cache_options,
            size=self.info(path)["size"],
        )


def _entry(name: str, meta: Any) -> dict[str, Any]:
    return {"name": name, "size": int(meta["size"]), "type": "file", "modified": meta["last_modified"]}
