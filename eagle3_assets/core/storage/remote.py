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
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

MANIFEST = ".remote-manifest.json"  # per local partition copy: relative path -> [etag, size, mtime_ns]
LEASE = ".lease.json"
SCHEMES = ("s3://", "gs://", "az://", "abfs://", "abfss://", "memory://")


class ConflictError(RuntimeError):
    """Another writer changed the object since this copy saw it (or created it first): this write lost."""


class LeaseHeld(RuntimeError):
    """Another process holds the dataset's lease."""


def is_remote(root: str) -> bool:
    return root.startswith(SCHEMES)


def make_store(url: str, options: dict[str, Any]) -> Any:
    """An obstore store for `url` (its path is the prefix); credentials come from the environment (AWS_*, ...)."""
    from obstore.store import from_url

    opts = {k: v for k, v in options.items() if k not in ("allow_http", "client_options")}
    client = dict(options.get("client_options") or {})
    if options.get("allow_http") or str(opts.get("endpoint", opts.get("endpoint_url", ""))).startswith(
        "http://"
    ):
        client["allow_http"] = True
    if "endpoint_url" in opts:
        opts["endpoint"] = opts.pop("endpoint_url")
    return from_url(url, client_options=client or None, **opts)


class RemoteRoot:
    """`storage.root` in an object store, mirrored per partition into `cache_dir`."""

    def __init__(self, url: str, options: dict[str, Any], cache_dir: Path):
        self.url = url.rstrip("/")
        self.store = make_store(self.url, options)
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
                if known and known[0] == meta["e_tag"] and target.exists():
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
        delete remote objects whose local file was removed. Returns how many objects were uploaded."""
        import obstore as obs
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
            uploaded = 0
            for rel, st in sorted(local.items()):
                known = manifest.get(rel)
                if known and known[1] == st.st_size and known[2] == st.st_mtime_ns:
                    continue
                mode: Any = {"e_tag": known[0]} if known else "create"
                data = (folder / rel).read_bytes()
                try:
                    result = obs.put(self.store, f"{key}/{rel}", data, mode=mode)
                except (AlreadyExistsError, PreconditionError) as e:
                    raise ConflictError(
                        f"{self.url}/{key}/{rel} was changed by another writer since this copy saw it; this write "
                        "lost and nothing of it was stored (run it again: it starts from what the store holds)"
                    ) from e
                manifest[rel] = [result["e_tag"], st.st_size, st.st_mtime_ns]
                uploaded += 1
            # New files are in place before removed ones go: a reader never sees rows vanish.
            for rel in list(manifest):
                if _under(rel, writes) and rel not in local:
                    with contextlib.suppress(FileNotFoundError):
                        obs.delete(self.store, f"{key}/{rel}")
                    del manifest[rel]
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
        """Hold `<key>/.lease.json` while the block runs; another holder's unexpired lease refuses the block."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        path = f"{key}/{LEASE}"
        me = f"{os.uname().nodename} pid {os.getpid()} {uuid.uuid4().hex[:8]}"

        def body() -> bytes:
            return json.dumps({"holder": me, "expires": time.time() + ttl_s}).encode()

        try:
            etag = obs.put(self.store, path, body(), mode="create")["e_tag"]
        except AlreadyExistsError:
            meta = obs.head(self.store, path)
            held = json.loads(bytes(obs.get(self.store, path).bytes()))
            if held.get("expires", 0) > time.time():
                raise LeaseHeld(
                    f"{what} is already running ({held.get('holder')}); wait for it or stop it first"
                ) from None
            try:  # expired: its holder died; take it over, unless someone else just did
                etag = obs.put(self.store, path, body(), mode={"e_tag": meta["e_tag"]})["e_tag"]
            except PreconditionError:
                raise LeaseHeld(f"{what} was just started by another process") from None
        stop = threading.Event()
        state = {"etag": etag}

        def renew() -> None:
            while not stop.wait(ttl_s / 3):
                with contextlib.suppress(Exception):
                    state["etag"] = obs.put(self.store, path, body(), mode={"e_tag": state["etag"]})["e_tag"]

        thread = threading.Thread(target=renew, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5)
            with contextlib.suppress(Exception):
                obs.delete(self.store, path)


def _under(rel: str, prefixes: list[str]) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes)
