"""A faulty object store for tests: an HTTP/1.1 reverse proxy on loopback in front of an S3-compatible server
(the moto server of tests/support/object_store.py) that, on a share of requests, answers what a busy or flaky
S3 answers.

Faults, each decided per request from a seeded RNG (the same seed and the same requests give the same faults):

- `slowdown`: `503 SlowDown` with S3's XML error body, without asking the server;
- `drop_before`: the connection is reset (RST) before the request reaches the server: nothing happened;
- `drop_after`: a write (PUT, POST, DELETE) is forwarded, the server applies it, and then the connection is
  reset instead of answering: the write happened but the client cannot know. A retried conditional PUT then
  meets its own object (412 Precondition Failed), which is the case a client must not report as a conflict.

`rules` add targeted faults that outlast any retry policy: `proxy.rule("PUT", "shard-", "slowdown", times=50)`
answers the next 50 PUTs whose path contains "shard-" with 503. `counts` says what was injected; `requests`
counts every request seen.
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import struct
import threading
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlparse

SLOWDOWN_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    "<RequestId>{rid}</RequestId><HostId>{host}</HostId></Error>"
)
WRITES = ("PUT", "POST", "DELETE")  # obstore deletes with a bulk POST ?delete
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


@dataclass
class Rule:
    method: str
    contains: str
    kind: str
    times: int


@dataclass
class FaultProxy:
    """`FaultProxy(upstream_url, slowdown=0.15, drop_before=0.05, drop_after=0.1, seed=1)`; `.url` is where to
    point the client; `with proxy:` starts and stops it."""

    upstream: str
    slowdown: float = 0.0
    drop_before: float = 0.0
    drop_after: float = 0.0
    seed: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"slowdown": 0, "drop_before": 0, "drop_after": 0})
    requests: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._server: socketserver.ThreadingTCPServer | None = None
        up = urlparse(self.upstream)
        self._up = (up.hostname or "127.0.0.1", up.port or 80)

    # -- control
    # -------------------------------------------------------------------------------------------------
    def set(self, slowdown: float = 0.0, drop_before: float = 0.0, drop_after: float = 0.0) -> None:
        with self._lock:
            self.slowdown, self.drop_before, self.drop_after = slowdown, drop_before, drop_after

    def healthy(self) -> None:
        with self._lock:
            self.slowdown = self.drop_before = self.drop_after = 0.0
            self._rules.clear()

    def rule(self, method: str, contains: str, kind: str, times: int = 1) -> None:
        assert kind in self.counts, kind
        with self._lock:
            self._rules.append(Rule(method.upper(), contains, kind, times))

    @property
    def injected(self) -> int:
        return sum(self.counts.values())

    def reset_counts(self) -> None:
        with self._lock:
            self.counts = dict.fromkeys(self.counts, 0)
            self.requests = 0

    def _decide(self, method: str, target: str, body: bytes) -> str | None:
        with self._lock:
            self.requests += 1
            for rule in self._rules:
                # A bulk delete (POST ?delete) names its keys in the body.
                where = target + (body[:4096].decode("latin-1") if method == "POST" else "")
                if rule.times > 0 and rule.method == method and rule.contains in where:
                    rule.times -= 1
                    self.counts[rule.kind] += 1
                    return rule.kind
            roll = self._rng.random()
            kind = None
            if roll < self.slowdown:
                kind = "slowdown"
            elif roll < self.slowdown + self.drop_before:
                kind = "drop_before"
            elif roll < self.slowdown + self.drop_before + self.drop_after and method in WRITES:
                kind = "drop_after"
            if kind:
                self.counts[kind] += 1
            return kind

    # -- lifecycle
    # -----------------------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.connection, self.rfile)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start the proxy first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- one client connection: requests until it closes
    # -------------------------------------------------------
    def _serve(self, conn: socket.socket, rfile) -> None:
        upstream = http.client.HTTPConnection(*self._up, timeout=60)
        try:
            while True:
                request = _read_request(rfile)
                if request is None:
                    return
                method, target, headers, body = request
                kind = self._decide(method, target, body)
                if kind == "drop_before":
                    return _reset(conn)
                if kind == "slowdown":
                    payload = SLOWDOWN_BODY.format(rid=uuid.uuid4().hex[:16], host=uuid.uuid4().hex).encode()
                    _respond(
                        conn,
                        503,
                        "Slow Down",
                        [
                            ("Content-Type", "application/xml"),
                            ("Content-Length", str(len(payload))),
                            ("x-amz-request-id", "fault-proxy"),
                        ],
                        payload,
                    )
                    continue
                fwd = {k: v for k, v in headers if k.lower() not in HOP_BY_HOP}
                upstream.request(method, target, body=body, headers=fwd)
                resp = upstream.getresponse()
                data = resp.read()
                if kind == "drop_after":
                    return _reset(conn)
                out = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
                if method != "HEAD":
                    out = [(k, v) for k, v in out if k.lower() != "content-length"]
                    out.append(("Content-Length", str(len(data))))
                _respond(conn, resp.status, resp.reason, out, b"" if method == "HEAD" else data)
        except (ConnectionError, OSError, http.client.HTTPException):
            return
        finally:
            upstream.close()


def _read_request(rfile) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    line = rfile.readline(65537)
    if not line or not line.strip():
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        h = rfile.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        k, v = h.decode("latin-1").split(":", 1)
        headers.append((k.strip(), v.strip()))
    lower = {k.lower(): v for k, v in headers}
    if lower.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(rfile.readline().split(b";")[0], 16)
            if size == 0:
                while rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                break
            chunks.append(rfile.read(size))
            rfile.readline()
        body = b"".join(chunks)
        headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        headers.append(("Content-Length", str(len(body))))
    else:
        body = rfile.read(int(lower.get("content-length", "0") or 0))
    return method.upper(), target, headers, body


def _respond(
    conn: socket.socket, status: int, reason: str, headers: list[tuple[str, str]], body: bytes
) -> None:
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    conn.sendall(head.encode("latin-1") + body)


def _reset(conn: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the client sees 'connection reset', as when a load balancer drops it."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()
