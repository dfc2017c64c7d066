"""The dataset lock where `flock` cannot reach: a lease object in the store, created only if absent, renewed
while held, and taken over only after it expired (its holder died)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from .remote_writes import ConditionalWrites

log = logging.getLogger(__name__)


class LeaseHeld(RuntimeError):
    """Another process holds the dataset's lease."""


@dataclass
class _Held:
    etag: str
    expires: float
    lost: bool = False


@contextlib.contextmanager
def hold_lease(writes: ConditionalWrites, path: str, what: str, ttl_s: float = 120.0) -> Iterator[None]:
    """Hold the lease object `path` while the block runs; another holder's unexpired lease refuses the block.

    It is renewed every ttl/3; a renewal that fails on a fault is retried until the lease would expire (and
    after that at once again, in case no one took it), so a flaky store does not drop it. Taken over by
    another process (after it expired), it is logged and left alone, not deleted at the end."""
    me = f"{os.uname().nodename} pid {os.getpid()} {uuid.uuid4().hex[:8]}"
    held = _acquire(writes, path, what, me, ttl_s)
    stop = threading.Event()
    thread = threading.Thread(target=_renew, args=(writes, path, what, me, ttl_s, held, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        if not held.lost:
            with contextlib.suppress(Exception):
                writes.delete(path)


def _body(me: str, ttl_s: float) -> bytes:
    return json.dumps({"holder": me, "expires": time.time() + ttl_s}).encode()


def _acquire(writes: ConditionalWrites, path: str, what: str, me: str, ttl_s: float) -> _Held:
    import obstore as obs
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    first = _body(me, ttl_s)
    try:
        etag = writes.put(path, first, "create")
    except AlreadyExistsError:
        got = obs.get(writes.store, path)
        holder = json.loads(bytes(got.bytes()))
        if holder.get("expires", 0) > time.time():
            raise LeaseHeld(
                f"{what} is already running ({holder.get('holder')}); wait for it or stop it first"
            ) from None
        first = _body(me, ttl_s)
        try:  # expired: its holder died; take it over, unless someone else just did
            etag = writes.put(path, first, {"e_tag": got.meta["e_tag"]})
        except PreconditionError:
            raise LeaseHeld(f"{what} was just started by another process") from None
    return _Held(etag, json.loads(first)["expires"])


def _renew(
    writes: ConditionalWrites, path: str, what: str, me: str, ttl_s: float, held: _Held, stop: threading.Event
) -> None:
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    wait = ttl_s / 3
    while not stop.wait(wait):
        data = _body(me, ttl_s)
        try:
            held.etag = writes.put(path, data, {"e_tag": held.etag}, deadline=held.expires, stop=stop)
            held.expires = json.loads(data)["expires"]
            wait = ttl_s / 3
        except (AlreadyExistsError, PreconditionError):
            if stop.is_set():  # released meanwhile (the lease is gone): nothing was lost
                return
            held.lost = True
            log.error(
                "the lease %s/%s was taken over by another process while %s ran", writes.url, path, what
            )
            return
        except Exception as e:  # the store kept failing until the lease's expiry: keep trying
            log.warning("renewing the lease %s/%s failed: %s", writes.url, path, e)
            wait = min(ttl_s / 3, 1.0)
