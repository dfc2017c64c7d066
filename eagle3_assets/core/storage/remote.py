"""Object storage for `storage.root` (s3://bucket/prefix, and the other schemes obstore speaks: gs://, az://).

Why a synchronised working copy and not every reader and writer rewritten for object stores: every stage already
writes crash-safe files in a local folder and is tested that way; object stores have no rename, no append and no
file locks, but they do have what that folder needs: an atomic PUT per object, and conditional PUTs. So a stage works
in a local copy of its partition and:

- `pull(reads)` fetches the objects under the paths it reads whose ETag changed since its last pull (a top-up
  downloads what was added, not the partition);
- `push(writes)` uploads the files that changed locally: a new object only if none exists (If-None-Match), a
  replaced one only if it still has the ETag this copy last saw (If-Match). Of two writers racing on the same file,
  one wins and the other gets `ConflictError`; appends are new objects with unique names, so they never collide,
  and a file deleted locally (parts folded by a compaction) is deleted remotely after the new file is in place;
- the journal pushes its parts at every flush, so a pod that dies loses what a local kill -9 loses;
- `lease()` is the dataset lock where `flock` cannot reach: an object created only if absent, renewed while
  held, and taken over only after it expired (a dead holder).

The library is obstore (Rust `object_store`): one client for S3 and the others, conditional puts, range reads.

Faults are ridden, not fatal. A store that answers 503 SlowDown or drops connections slows a stage down:

- reads (GET, HEAD, LIST) and plain overwrites go through obstore's own retries, which cover 5xx, 429, 408,
  connection errors and, for requests it knows are idempotent, timeouts and resets;
- obstore does not retry a conditional PUT or a delete whose connection was reset after the request went out (it
  cannot know whether the write happened; a connection closed without an answer it does retry, as if the request
  had not been sent, and the retry of a PUT that landed meets its own object), so those go through a store with
  obstore's retries off and this module retries them itself, with the same policy (a 409 to an If-Match PUT, S3's
  "concurrent conditional request", is retried too). A conditional PUT that meets 412 / "already exists" is then
  checked before it is called a conflict: if the object holds exactly the bytes this copy uploaded (size, then the
  MD5 ETag or else a GET compare), an earlier attempt landed and the write succeeded. A delete that finds nothing
  succeeded too;
- the policy is `storage.options.retry` (keys of `RetryPolicy`: max_retries, init_backoff_s, max_backoff_s, base,
  retry_timeout_s), by default 10 retries with exponential backoff from 0.1 s to 15 s (x2, jittered), at most
  180 s per request; obstore's defaults are the same numbers, set here explicitly so they are ours to change;
- nothing is half-published: a push uploads data files first and the files that name others (index.parquet,
  manifest.json, *.index.json, reports) last, deletes replaced files only after that, and records each step in the
  working copy's manifest as it lands. When the retries run out the push raises `StoreUnavailable`: what is stored
  is the old state plus whole new files, and the next push finishes the rest (uploads, then pending deletions);
- a lease renewal that fails is retried until the lease would expire, not dropped at the first error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

log = logging.getLogger(__name__)
T = TypeVar("T")

MANIFEST = ".remote-manifest.json"  # per local partition copy: relative path -> [etag, size, mtime_ns]
LEASE = ".lease.json"
SCHEMES = ("s3://", "gs://", "az://", "abfs://", "abfss://", "memory://")
# Files that name other files of their folder: published after them, so a reader never follows a name to nothing.
PUBLISHED_LAST = ("index.parquet", "manifest.json", ".index.json", "report.json", "report.md")
PENDING_DELETE = "delete"  # 4th field of a manifest entry: deleted locally, the remote delete not yet done


class ConflictError(RuntimeError):
    """Another writer changed the object since this copy saw it (or created it first): this write lost."""


class LeaseHeld(RuntimeError):
    """Another process holds the dataset's lease."""


class StoreUnavailable(RuntimeError):
    """The object store kept failing (5xx, dropped connections) after every retry of the policy."""


@dataclass(frozen=True)
class RetryPolicy:
    """How requests to the store are retried (`storage.options.retry`): at most `max_retries` retries and
    `retry_timeout_s` from the first attempt, the n-th waiting a random time between `init_backoff_s` and `base`
    times the previous wait, capped at `max_backoff_s` (object_store's jittered exponential backoff)."""

    max_retries: int = 10
    init_backoff_s: float = 0.1
    max_backoff_s: float = 15.0
    base: float = 2.0
    retry_timeout_s: float = 180.0

    @classmethod
    def from_options(cls, value: Any) -> RetryPolicy:
        if value is None:
            return cls()
        if isinstance(value, RetryPolicy):
            return value
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(
                f"storage.options.retry: unknown keys {sorted(unknown)}; the keys are {sorted(known)}"
            )
        return cls(**value)

    def obstore(self) -> dict[str, Any]:
        """The policy as obstore's `retry_config`."""
        return {
            "max_retries": self.max_retries,
            "retry_timeout": timedelta(seconds=self.retry_timeout_s),
            "backoff": {
                "init_backoff": timedelta(seconds=self.init_backoff_s),
                "max_backoff": timedelta(seconds=self.max_backoff_s),
                "base": self.base,
            },
        }

    def waits(self) -> Iterator[float]:
        nxt = self.init_backoff_s
        while True:
            wait = nxt
            nxt = min(
                self.max_backoff_s,
                random.uniform(self.init_backoff_s, max(nxt * self.base, self.init_backoff_s)),
            )
            yield wait


def is_remote(root: str) -> bool:
    return root.startswith(SCHEMES)


def make_store(url: str, options: dict[str, Any], retry: RetryPolicy | None = None) -> Any:
    """An obstore store for `url` (its path is the prefix); credentials come from the environment (AWS_*, ...).
    `retry` (default: `options["retry"]`) is its retry policy."""
    from obstore.store import from_url

    retry = retry or RetryPolicy.from_options(options.get("retry"))
    opts = {k: v for k, v in options.items() if k not in ("allow_http", "client_options", "retry")}
    client = dict(options.get("client_options") or {})
    if options.get("allow_http") or str(opts.get("endpoint", opts.get("endpoint_url", ""))).startswith(
        "http://"
    ):
        client["allow_http"] = True
    if "endpoint_url" in opts:
        opts["endpoint"] = opts.pop("endpoint_url")
    return from_url(url, client_options=client or None, retry_config=retry.obstore(), **opts)


_STATUS = re.compile(r"status code: (\d{3})")


class _Busy(RuntimeError):
    """A 409 to a conditional replacement: retried like a 503."""


def _transient(e: BaseException) -> bool:
    """A failure worth retrying: a 5xx / 429 / 408 answer, or a connection that failed or was dropped (obstore's
    GenericError without a 4xx status)."""
    from obstore.exceptions import BaseError, GenericError

    if isinstance(e, (ConnectionError, TimeoutError, _Busy)):
        return True
    if not (isinstance(e, GenericError) or type(e) is BaseError):
        return False  # not found, already exists, precondition, permission, ...: an answer, not a fault
    m = _STATUS.search(str(e))
    return not m or int(m.group(1)) >= 500 or int(m.group(1)) in (408, 429)


class RemoteRoot:
    """`storage.root` in an object store, mirrored per partition into `cache_dir`."""

    def __init__(self, url: str, options: dict[str, Any], cache_dir: Path):
        self.url = url.rstrip("/")
        self.retry = RetryPolicy.from_options(options.get("retry"))
        self.store = make_store(self.url, options, self.retry)  # reads and overwrites: obstore retries them
        # Conditional PUTs and deletes: retried here, where a lost answer can be checked (`_put`, `_delete`).
        # (memory:// is one store per client and never fails: the same one.)
        self._writes = (
            self.store
            if self.url.startswith("memory:")
            else make_store(self.url, options, RetryPolicy(max_retries=0))
        )
        self.cache = self.cache_folder(self.url, cache_dir)
        self.cache.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @staticmethod
    def cache_folder(url: str, cache_dir: Path) -> Path:
        parsed = urlparse(url.rstrip("/"))
        return Path(cache_dir) / f"{parsed.scheme}-{parsed.netloc}{parsed.path}".replace("/", "_")

    def local(self, key: str) -> Path:
        return self.cache / key

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

    # -- writes obstore cannot retry safely ------------------------------------------------------------------
    def _retrying(
        self,
        what: str,
        attempt: Callable[[], T],
        deadline: float | None = None,
        stop: threading.Event | None = None,
    ) -> T:
        """`attempt()` until it succeeds or fails for good: transient failures (`_transient`) are retried under
        the policy, and not past `deadline` (a time.time()) nor once `stop` is set, when given."""
        start = time.monotonic()
        waits = self.retry.waits()
        tries = 0
        while True:
            try:
                return attempt()
            except Exception as e:
                if not _transient(e):
                    raise
                tries += 1
                wait = next(waits)
                elapsed = time.monotonic() - start
                if (
                    tries > self.retry.max_retries
                    or elapsed + wait > self.retry.retry_timeout_s
                    or (deadline is not None and time.time() + wait > deadline)
                ):
                    raise StoreUnavailable(
                        f"{what}: the object store kept failing ({tries} attempt(s) in {elapsed:.1f}s, "
                        f"storage.options.retry: {self.retry}): {str(e).splitlines()[0]}"
                    ) from e
                log.info("%s failed (%s); retry %d in %.2fs", what, str(e).splitlines()[0], tries, wait)
                if stop is not None and stop.wait(wait):
                    raise StoreUnavailable(f"{what}: stopped while retrying") from e
                if stop is None:
                    time.sleep(wait)

    def _put(
        self,
        path: str,
        data: bytes,
        mode: Any,
        deadline: float | None = None,
        stop: threading.Event | None = None,
    ) -> str:
        """A conditional PUT ("create" or {"e_tag": ...}), retried; returns the new ETag. A refusal (412, already
        exists) is a conflict only if the object does not hold exactly `data`: when it does, an earlier attempt
        whose answer was lost stored it, and this write succeeded."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        def attempt() -> str:
            try:
                return obs.put(self._writes, path, data, mode=mode)["e_tag"]
            except (AlreadyExistsError, PreconditionError) as e:
                etag = self._holds(path, data)
                if etag is None and isinstance(e, AlreadyExistsError) and mode != "create":
                    # 409 ConditionalRequestConflict: S3's "an If-Match PUT on this key is in flight, retry".
                    raise _Busy(str(e)) from e
                if etag is None:
                    raise
                log.info(
                    "PUT %s/%s: refused, but the object holds these bytes (a lost answer); done",
                    self.url,
                    path,
                )
                return etag

        return self._retrying(f"PUT {self.url}/{path}", attempt, deadline, stop)

    def _holds(self, path: str, data: bytes) -> str | None:
        """The object's ETag if it holds exactly `data`, else None. Compares the size, then S3's MD5 ETag of a
        single-part upload, and otherwise (multipart, encrypted, other stores) the bytes themselves."""
        import obstore as obs

        try:
            meta = obs.head(self.store, path)
        except FileNotFoundError:
            return None
        if meta["size"] != len(data):
            return None
        etag = meta["e_tag"] or ""
        if etag.strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest():
            return etag
        got = obs.get(self.store, path)
        return got.meta["e_tag"] if bytes(got.bytes()) == data else None

    def _delete(self, path: str) -> None:
        """Delete, retried; an object already gone (an earlier attempt whose answer was lost) is a success."""
        import obstore as obs

        def attempt() -> None:
            with contextlib.suppress(FileNotFoundError):
                obs.delete(self._writes, path)

        self._retrying(f"DELETE {self.url}/{path}", attempt)

    # -- pull ------------------------------------------------------------------------------------------------
    def pull(self, key: str, reads: list[str]) -> int:
        """Fetch the objects under `reads` (file names or folder prefixes ending in "/") whose ETag changed; remove
        local copies of objects that are gone remotely. Returns how many objects were downloaded."""
        import obstore as obs

        with self._lock:
            manifest = self._manifest(key)
            folder = self.local(key)
            remote: dict[str, dict] = {}
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
        """Upload the local files under `writes` that are new or changed since the last pull/push, conditionally;
        delete remote objects whose local file was removed. Returns how many objects were uploaded.

        Order: data files, then the files that name them (`PUBLISHED_LAST`), then deletions; each step is recorded
        in the manifest as it lands, so after `StoreUnavailable` the store holds the old state plus whole new files
        and the next push does only what is left."""
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
            # Files deleted here are marked first: a pull before their remote delete is done (after a push that
            # stopped) does not fetch them back, and the next push deletes them.
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
                        etag = self._put(f"{key}/{rel}", data, mode)
                    except (AlreadyExistsError, PreconditionError) as e:
                        raise ConflictError(
                            f"{self.url}/{key}/{rel} was changed by another writer since this copy saw it; this "
                            "write lost and the file was not stored (run it again: it starts from what the store "
                            "holds)"
                        ) from e
                    manifest[rel] = [etag, st.st_size, st.st_mtime_ns]
                    uploaded += 1
                # New files are in place before removed ones go: a reader never sees rows vanish.
                for rel in gone:
                    self._delete(f"{key}/{rel}")
                    del manifest[rel]
            except StoreUnavailable as e:
                raise StoreUnavailable(
                    f"publishing {self.url}/{key} stopped: {e}. Nothing is half-published: the store holds the "
                    f"previous files plus {uploaded} whole new one(s); pushing again (running the stage again) "
                    "finishes it"
                ) from e
            finally:
                self._save_manifest(key, manifest)
            return uploaded

    def modified(self, key: str, rel: str) -> float | None:
        import obstore as obs

        try:
            return obs.head(self.store, f"{key}/{rel}")["last_modified"].timestamp()
        except FileNotFoundError:
            return None

    # -- lease -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lease(self, key: str, what: str, ttl_s: float = 120.0) -> Iterator[None]:
        """Hold `<key>/.lease.json` while the block runs; another holder's unexpired lease refuses the block.

        It is renewed every ttl/3; a renewal that fails on a fault is retried until the lease would expire (and
        after that at once again, in case no one took it), so a flaky store does not drop it. Taken over by
        another process (after it expired), it is logged and left alone, not deleted at the end."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        path = f"{key}/{LEASE}"
        me = f"{os.uname().nodename} pid {os.getpid()} {uuid.uuid4().hex[:8]}"

        def body() -> bytes:
            return json.dumps({"holder": me, "expires": time.time() + ttl_s}).encode()

        first = body()
        try:
            etag = self._put(path, first, "create")
        except AlreadyExistsError:
            got = obs.get(self.store, path)
            held = json.loads(bytes(got.bytes()))
            if held.get("expires", 0) > time.time():
                raise LeaseHeld(
                    f"{what} is already running ({held.get('holder')}); wait for it or stop it first"
                ) from None
            first = body()
            try:  # expired: its holder died; take it over, unless someone else just did
                etag = self._put(path, first, {"e_tag": got.meta["e_tag"]})
            except PreconditionError:
                raise LeaseHeld(f"{what} was just started by another process") from None
        stop = threading.Event()
        state: dict[str, Any] = {"etag": etag, "expires": json.loads(first)["expires"], "lost": False}

        def renew() -> None:
            wait = ttl_s / 3
            while not stop.wait(wait):
                data = body()
                try:
                    state["etag"] = self._put(
                        path, data, {"e_tag": state["etag"]}, deadline=state["expires"], stop=stop
                    )
                    state["expires"] = json.loads(data)["expires"]
                    wait = ttl_s / 3
                except (AlreadyExistsError, PreconditionError):
                    if stop.is_set():  # released meanwhile (the lease is gone): nothing was lost
                        return
                    state["lost"] = True
                    log.error(
                        "the lease %s/%s was taken over by another process while %s ran", self.url, path, what
                    )
                    return
                except Exception as e:  # the store kept failing until the lease's expiry: keep trying
                    log.warning("renewing the lease %s/%s failed: %s", self.url, path, e)
                    wait = min(ttl_s / 3, 1.0)

        thread = threading.Thread(target=renew, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5)
            if not state["lost"]:
                with contextlib.suppress(Exception):
                    self._delete(path)


def _publish_order(rel: str) -> tuple[int, str]:
    """Files that name others (an index, a manifest, a report) after the files they name."""
    return (1 if Path(rel).name.endswith(PUBLISHED_LAST) else 0, rel)


def _under(rel: str, prefixes: list[str]) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes)
