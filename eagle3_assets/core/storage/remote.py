"""Object storage for `storage.root` (s3://bucket/prefix, and the other schemes obstore speaks: gs://, az://).

Why a synchronised working copy and not every reader and writer rewritten for object stores: every stage
already writes crash-safe files in a local folder and is tested that way; object stores have no rename, no
append and no file locks, but they do have what that folder needs: an atomic PUT per object, and conditional
PUTs. So a stage works in a local copy of its partition and:

- `pull(reads)` fetches the objects under the paths it reads whose ETag changed since its last pull (a top-up
  downloads what was added, not the partition);
- `push(writes)` uploads the files that changed locally: a new object only if none exists (If-None-Match), a
  replaced one only if it still has the ETag this copy last saw (If-Match). Of two writers racing on the same
  file, one wins and the other gets `ConflictError`; appends are new objects with unique names, so they never
  collide, and a file deleted locally (parts folded by a compaction) is deleted remotely after the new file is
  in place;
- the journal pushes its parts at every flush, so a pod that dies loses what a local kill -9 loses;
- `lease()` is the dataset lock where `flock` cannot reach: an object created only if absent, renewed while
  held, and taken over only after it expired (a dead holder).

The library is obstore (Rust `object_store`): one client for S3 and the others, conditional puts, range reads.

Faults are ridden, not fatal. A store that answers 503 SlowDown or drops connections slows a stage down:

- reads (GET, HEAD, LIST) and plain overwrites go through obstore's own retries, which cover 5xx, 429, 408,
  connection errors and, for requests it knows are idempotent, timeouts and resets;
- obstore does not retry a conditional PUT or a delete whose connection was reset after the request went out
  (it cannot know whether the write happened; a connection closed without an answer it does retry, as if the
  request had not been sent, and the retry of a PUT that landed meets its own object), so those go through a
  store with obstore's retries off and this module retries them itself, with the same policy (a 409 to an
  If-Match PUT, S3's "concurrent conditional request", is retried too). A conditional PUT that meets 412 /
  "already exists" is then checked before it is called a conflict: if the object holds exactly the bytes this
  copy uploaded (size, then the MD5 ETag or else a GET compare), an earlier attempt landed and the write
  succeeded. A delete that finds nothing succeeded too;
- the policy is `storage.options.retry` (keys of `RetryPolicy`: max_retries, init_backoff_s, max_backoff_s,
  base, retry_timeout_s), by default 10 retries with exponential backoff from 0.1 s to 15 s (x2, jittered), at
  most 180 s per request; obstore's defaults are the same numbers, set here explicitly so they are ours to
  change;
- nothing is half-published: a push uploads data files first and the files that name others (index.parquet,
  manifest.json, *.index.json, reports) last, deletes replaced files only after that, and records each step in
  the working copy's manifest as it lands. When the retries run out the push raises `StoreUnavailable`: what
  is stored is the old state plus whole new files, and the next push finishes the rest (uploads, then pending
  deletions);
- a lease renewal that fails is retried until the lease would expire, not dropped at the first error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Any

from .layout import check_key
from .remote_lease import hold_lease
from .remote_writes import ConditionalWrites, RetryPolicy, StoreUnavailable, make_store
from .schemes import cache_folder

log = logging.getLogger(__name__)

MANIFEST = ".remote-manifest.json"  # per local partition copy: relative path -> [etag, size, mtime_ns]
LEASE = ".lease.json"
# Files that name other files of their folder: published after them, so a reader never follows a name to
# nothing.
PUBLISHED_LAST = ("index.parquet", "manifest.json", ".index.json", "report.json", "report.md")
PENDING_DELETE = "delete"  # 4th field of a manifest entry: deleted locally, the remote delete not yet done


class ConflictError(RuntimeError):
    """Another writer changed the object since this copy saw it (or created it first): this write lost."""


class RemoteRoot:
    """`storage.root` in an object store, mirrored per partition into `cache_dir`."""

    def __init__(self, url: str, options: dict[str, Any], cache_dir: Path):
        self.url = url.rstrip("/")
        self.retry = RetryPolicy.from_options(options.get("retry"))
        self.store = make_store(self.url, options, self.retry)  # reads and overwrites: obstore retries them
        # Conditional PUTs and deletes: retried here, where a lost answer can be checked
        # (`ConditionalWrites`). (memory:// is one store per client and never fails: the same one.)
        writes = (
            self.store
            if self.url.startswith("memory:")
            else make_store(self.url, options, RetryPolicy(max_retries=0))
        )
        self.writes = ConditionalWrites(self.url, self.store, writes, self.retry)
        self.cache = self.cache_folder(self.url, cache_dir)
        self.cache.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @staticmethod
    def cache_folder(url: str, cache_dir: Path) -> Path:
        return cache_folder(url, cache_dir)

    def local(self, key: str) -> Path:
        """The working copy of partition `key` (every pull and push starts here, so a key that would name an
        object outside the root's prefix, or a folder outside the cache, is refused here too)."""
        return self.cache / check_key(key)

    # -- manifest --------------------------------------------------------------------------------------------
    def _manifest(self, key: str) -> dict[str, list]:
        path = self.local(key) / MANIFEST
        return json.loads(path.read_text()) if path.exists() else {}

    def _save_manifest(self, key: str, manifest: dict[str, list]) -> None:
        path = self.local(key) / MANIFEST
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, path)

    # -- pull ------------------------------------------------------------------------------------------------
    def pull(self, key: str, reads: list[str]) -> int:
        """Fetch the objects under `reads` (file names or folder prefixes ending in "/") whose ETag changed;
        remove local copies of objects that are gone remotely. Returns how many objects were downloaded."""
        import obstore as obs

        with self._lock:
            manifest = self._manifest(key)
            folder = self.local(key)
            remote: dict[str, Any] = {}
            for prefix in reads:
                if prefix.endswith("/"):
                    for batch in obs.list(self.store, f"{key}/{prefix}"):
                        for meta in batch:
                            remote[meta["path"][len(key) + 1 :]] = meta
                else:
                    with contextlib.suppress(FileNotFoundError):
                        remote[prefix] = obs.head(self.store, f"{key}/{prefix}")
            fetched = 0
            for rel, meta in remote.items():
                if Path(rel).name.startswith("."):
                    continue  # leases and scratch objects are not data
                known = manifest.get(rel)
                target = folder / rel
                # Unchanged, or deleted here by a push whose remote delete is still to do: not fetched back.
                if known and known[0] == meta["e_tag"] and (target.exists() or known[3:] == [PENDING_DELETE]):
                    continue
                data = obs.get(self.store, f"{key}/{rel}").bytes()
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
                tmp.write_bytes(bytes(data))
                os.replace(tmp, target)
                st = target.stat()
                manifest[rel] = [meta["e_tag"], st.st_size, st.st_mtime_ns]
                fetched += 1
            for rel in list(manifest):
                if _under(rel, reads) and rel not in remote:
                    (folder / rel).unlink(missing_ok=True)
                    del manifest[rel]
            self._save_manifest(key, manifest)
            return fetched

    # -- push ------------------------------------------------------------------------------------------------
    def push(self, key: str, writes: list[str]) -> int:
        """Upload the local files under `writes` that are new or changed since the last pull/push,
        conditionally; delete remote objects whose local file was removed. Returns how many objects were
        uploaded.

        Order: data files, then the files that name them (`PUBLISHED_LAST`), then deletions; each step is
        recorded in the manifest as it lands, so after `StoreUnavailable` the store holds the old state plus
        whole new files and the next push does only what is left."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        with self._lock:
            manifest = self._manifest(key)
            folder = self.local(key)
            local: dict[str, os.stat_result] = {}
            for prefix in writes:
                base = folder / prefix
                paths = (p for p in base.rglob("*") if p.is_file()) if prefix.endswith("/") else [base]
                for p in paths:
                    if p.exists() and not p.name.startswith(".") and not p.name.endswith(".tmp"):
                        local[str(p.relative_to(folder))] = p.stat()
            # Files deleted here are marked first: a pull before their remote delete is done (after a push
            # that stopped) does not fetch them back, and the next push deletes them.
            gone = [rel for rel in manifest if _under(rel, writes) and rel not in local]
            if any(manifest[rel][3:] != [PENDING_DELETE] for rel in gone):
                for rel in gone:
                    manifest[rel] = [*manifest[rel][:3], PENDING_DELETE]
                self._save_manifest(key, manifest)
            uploaded = 0
            try:
                for rel, st in sorted(local.items(), key=lambda item: _publish_order(item[0])):
                    known = manifest.get(rel)
                    if known and len(known) == 3 and known[1] == st.st_size and known[2] == st.st_mtime_ns:
                        continue
                    mode: Any = {"e_tag": known[0]} if known else "create"
                    data = (folder / rel).read_bytes()
                    try:
                        etag = self.writes.put(f"{key}/{rel}", data, mode)
                    except (AlreadyExistsError, PreconditionError) as e:
                        raise ConflictError(
                            f"{self.url}/{key}/{rel} was changed by another writer since this copy saw it; "
                            "this write lost and the file was not stored (run it again: it starts from what "
                            "the store holds)"
                        ) from e
                    manifest[rel] = [etag, st.st_size, st.st_mtime_ns]
                    uploaded += 1
                # New files are in place before removed ones go: a reader never sees rows vanish.
                for rel in gone:
                    self.writes.delete(f"{key}/{rel}")
                    del manifest[rel]
            except StoreUnavailable as e:
                raise StoreUnavailable(
                    f"publishing {self.url}/{key} stopped: {e}. Nothing is half-published: the store holds "
                    f"the previous files plus {uploaded} whole new one(s); pushing again (running the stage "
                    "again) finishes it"
                ) from e
            finally:
                self._save_manifest(key, manifest)
            return uploaded

    def modified(self, key: str, rel: str) -> float | None:
        import obstore as obs

        try:
            return obs.head(self.store, f"{check_key(key)}/{rel}")["last_modified"].timestamp()
        except FileNotFoundError:
            return None

    def lease(self, key: str, what: str, ttl_s: float = 120.0) -> contextlib.AbstractContextManager[None]:
        """Hold `<key>/.lease.json` while the block runs (`remote_lease.hold_lease`)."""
        return hold_lease(self.writes, f"{check_key(key)}/{LEASE}", what, ttl_s)


def _publish_order(rel: str) -> tuple[int, str]:
    """Files that name others (an index, a manifest, a report) after the files they name."""
    return (1 if Path(rel).name.endswith(PUBLISHED_LAST) else 0, rel)


def _under(rel: str, prefixes: list[str]) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes)
