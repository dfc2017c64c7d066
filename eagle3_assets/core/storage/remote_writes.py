"""Writes to the object store that its client cannot retry safely, retried here where a lost answer can be
checked.

obstore does not retry a conditional PUT or a delete whose connection was reset after the request went out: it
cannot know whether the write happened. Those go through a store with obstore's retries off, and
`ConditionalWrites` retries them under the same `RetryPolicy`; a refusal (412, "already exists") is called a
conflict only when the object does not hold exactly the bytes this writer sent, and a delete that finds
nothing succeeded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, TypeVar

from .proxy import object_store_options

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreUnavailable(RuntimeError):
    """The object store kept failing (5xx, dropped connections) after every retry of the policy."""


@dataclass(frozen=True)
class RetryPolicy:
    """How requests to the store are retried (`storage.options.retry`): at most `max_retries` retries and
    `retry_timeout_s` from the first attempt, the n-th waiting a random time between `init_backoff_s` and
    `base` times the previous wait, capped at `max_backoff_s` (object_store's jittered exponential
    backoff)."""

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


def make_store(url: str, options: dict[str, Any], retry: RetryPolicy | None = None) -> Any:
    """An obstore store for `url` (its path is the prefix); credentials come from the environment (AWS_*,
    ...). `retry` (default: `options["retry"]`) is its retry policy. Its proxy is the one `proxy` decides for
    every HTTP path, unless `client_options` names proxy settings of its own."""
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
    if not any(str(k).startswith("proxy_") for k in client):  # the user's own proxy settings stand as given
        client.update(object_store_options(_endpoint(url, opts)))
    kwargs: dict[str, Any] = {**opts, "client_options": client or None, "retry_config": retry.obstore()}
    return from_url(url, **kwargs)


def _endpoint(url: str, opts: dict[str, Any]) -> str | None:
    """Where the store's requests go, when the configuration says (None: the provider's own https
    endpoint)."""
    if url.startswith(("http://", "https://")):
        return url
    for key in ("endpoint", "aws_endpoint", "aws_endpoint_url", "azure_endpoint", "azure_storage_endpoint"):
        if opts.get(key):
            return str(opts[key])
    return None


_STATUS = re.compile(r"status code: (\d{3})")


class _Busy(RuntimeError):
    """A 409 to a conditional replacement: retried like a 503."""


def _transient(e: BaseException) -> bool:
    """A failure worth retrying: a 5xx / 429 / 408 answer, or a connection that failed or was dropped
    (obstore's GenericError without a 4xx status)."""
    from obstore.exceptions import BaseError, GenericError

    if isinstance(e, (ConnectionError, TimeoutError, _Busy)):
        return True
    if not (isinstance(e, GenericError) or type(e) is BaseError):
        return False  # not found, already exists, precondition, permission, ...: an answer, not a fault
    m = _STATUS.search(str(e))
    return not m or int(m.group(1)) >= 500 or int(m.group(1)) in (408, 429)


class ConditionalWrites:
    """Conditional PUTs and deletes on `url`, retried under `retry`. Reads (HEAD, GET) go to `store`, whose
    client retries them itself; writes to `writes`, a client of the same store with its retries off."""

    def __init__(self, url: str, store: Any, writes: Any, retry: RetryPolicy):
        self.url, self.store, self._writes, self.retry = url, store, writes, retry

    def retrying(
        self,
        what: str,
        attempt: Callable[[], T],
        deadline: float | None = None,
        stop: threading.Event | None = None,
    ) -> T:
        """`attempt()` until it succeeds or fails for good: transient failures (`_transient`) are retried
        under the policy, and not past `deadline` (a time.time()) nor once `stop` is set, when given."""
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

    def put(
        self,
        path: str,
        data: bytes,
        mode: Any,
        deadline: float | None = None,
        stop: threading.Event | None = None,
    ) -> str:
        """A conditional PUT ("create" or {"e_tag": ...}), retried; returns the new ETag. A refusal (412,
        already exists) is a conflict only if the object does not hold exactly `data`: when it does, an
        earlier attempt whose answer was lost stored it, and this write succeeded."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        def attempt() -> str:
            try:
                return _etag(obs.put(self._writes, path, data, mode=mode)["e_tag"], path)
            except (AlreadyExistsError, PreconditionError) as e:
                etag = self.holds(path, data)
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

        return self.retrying(f"PUT {self.url}/{path}", attempt, deadline, stop)

    def holds(self, path: str, data: bytes) -> str | None:
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

    def delete(self, path: str) -> None:
        """Delete, retried; an object already gone (an earlier attempt whose answer was lost) is a success."""
        import obstore as obs

        def attempt() -> None:
            with contextlib.suppress(FileNotFoundError):
                obs.delete(self._writes, path)

        self.retrying(f"DELETE {self.url}/{path}", attempt)


def _etag(etag: str | None, path: str) -> str:
    """Conditional writes need the ETag a PUT returns; a store that gives none cannot hold a partition
    safely."""
    if etag is None:
        raise StoreUnavailable(f"PUT {path}: the store returned no ETag (conditional writes need one)")
    return etag
