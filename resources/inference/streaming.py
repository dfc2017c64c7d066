"""Server-sent event streams at tens of thousands of events a second, on the one core the engine's loop has.

Why not aiohttp for the streams: measured here (`bench/limits.py`, `streaming_cpu`), a minimal aiohttp client
spends ~16 µs of client CPU per event when every event comes in its own TCP segment, as providers send them
(one token at a time): a wake-up of the loop, a read, Python callbacks of the HTTP parser per chunk, a switch
to the reading task. A backfill's 40,000 events/s would take two thirds of a core; the engine has one, for
everything. Here a connection's protocol hands what arrives to a C HTTP parser (httptools: the chunked framing
is undone with no Python frame per chunk), then pauses its socket; a pump, every `tick_s`, takes each waiting
stream's payload, parses its `data:` events in one orjson call, hands them on as one batch, and lets the
socket read again, so the kernel collects the events in between and one read takes several (3-5 µs per event
in all, measured beside the 16). A stream's last chunk is seen as it arrives, unless it comes while its socket
is paused: ticks adapt to the answers, a twentieth of the shortest answers' time (5 ms to 250 ms), so an
answer's end waits for at most a small share of its own length; only streams that received something are
visited.

Connections are HTTP/1.1 keep-alive, per origin, reused for the next request; TLS through the standard
library. The rest of the backend (non-streamed requests, preflight, error bodies' classification) stays on
aiohttp; an error status here is read whole and classified by the same `http._error_response`.

Behind a proxy (`core.storage.proxy` decides, once per client, so its pool holds connections of one route
only): an https origin is reached through a CONNECT tunnel opened on a plain socket, then TLS with the
origin's name; an http origin gets absolute-form requests sent to the proxy, as curl does. A proxy that
refuses (407, 403) is named in the error, its credentials never.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from eagle3_assets.core.generation.protocol import ErrorKind, InferenceError
from eagle3_assets.core.storage.proxy import Proxies

from .http import _error_response, proxy_refused, redact
from .sse import EventBatches, OnEvents, Response

KEEPALIVE_S = 30.0  # an idle connection older than this is closed, not reused (servers drop them around 60 s)
MIN_TICK_S, MAX_TICK_S, FIRST_TICK_S = 0.005, 0.25, 0.01
TIMEOUT_CHECK_S = 1.0  # how often the pump looks for silent or overlong streams
MAX_PROXY_HEAD = 64 * 1024  # a CONNECT answer's head longer than this is not a proxy speaking


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: sends a request, reads its response; between ticks it only gathers bytes."""

    def __init__(self, client: StreamClient):
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.response: Response | None = None  # None while idle
        self.parser: Any = None
        self.head_ready: asyncio.Future | None = None
        self.events: EventBatches | None = None  # set once the reader has taken over the response
        self.queued = False  # paused, waiting for the pump
        self.got_bytes = False
        self.started_at = self.last_data_at = time.monotonic()

    def begin(self, head_ready: asyncio.Future) -> None:
        """A new request on this connection: a fresh response and parser."""
        self.response = Response(self._head_complete)
        self.parser = httptools.HttpResponseParser(self.response)
        self.head_ready = head_ready
        self.events = None
        self.got_bytes = False
        self.started_at = self.last_data_at = time.monotonic()

    def idle(self) -> None:
        self.response = self.parser = self.head_ready = self.events = None
        self.idle_since = time.monotonic()

    @property
    def wire(self) -> asyncio.Transport:
        """The transport, on a connection asyncio has made (every use after `connect`)."""
        assert self.transport is not None
        return self.transport

    # -- asyncio.Protocol ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a socket connection's

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None:
            return  # bytes on an idle connection: the server is closing it
        self.got_bytes = True
        self.last_data_at = time.monotonic()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self.wire.close()  # a parser that failed cannot read on
            if r.complete:
                return  # bytes after the response: this connection is not reused, the answer stands
            r.error = InferenceError(ErrorKind.MALFORMED, f"bad HTTP response: {e}", status=200)
            if self.head_ready is not None and not self.head_ready.done():
                self.head_ready.set_exception(r.error)
        if self.events is None:
            return  # the head is not read yet, or the reader has not taken over: the payload waits in `parts`
        if r.complete or r.error is not None:
            self.client._service(self)  # the last chunk: finish now
        elif not self.queued:
            self.queued = True
            self.wire.pause_reading()  # the pump reads on at its tick
            self.client._ready.append(self)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._forget(self)
        err = exc or ConnectionResetError("the server closed the connection")
        r = self.response
        if self.head_ready is not None and not self.head_ready.done():
            self.head_ready.set_exception(err)
        elif r is not None and not r.complete and r.error is None:
            if r.close_delimited:
                r.complete = True  # an unframed body ends when the connection does
            else:
                r.error = InferenceError(ErrorKind.CONNECTION, f"response cut off: {err}")
        if self.events is not None:
            self.client._service(self)

    def _head_complete(self) -> None:
        r = self.response
        assert r is not None  # the parser calls back only while a response is being read
        chunked = "chunked" in r.headers.get("transfer-encoding", "").lower()
        r.close_delimited = not chunked and "content-length" not in r.headers
        r.keep_alive = self.parser.should_keep_alive()  # (llhttp forgets it at the end)
        if self.head_ready is not None and not self.head_ready.done():  # the caller may have been cancelled
            self.head_ready.set_result(None)

    def reusable(self) -> bool:
        r = self.response
        return (
            r is not None
            and r.complete
            and r.error is None
            and not r.close_delimited
            and not self.closed
            and r.keep_alive
        )


class StreamClient:
    """Streamed POSTs to one origin over reused HTTP/1.1 connections, decoded by one pump for all streams."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        *,
        connect_timeout_s: float = 30.0,
        idle_timeout_s: float = 300.0,
        total_timeout_s: float = 900.0,
        secrets: tuple[bytes, ...] = (),
        ssl_context: ssl.SSLContext | None = None,
        proxies: Proxies | None = None,
    ):
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.tls else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        name = f"[{self.host}]" if ":" in self.host else self.host
        host_header = name if parts.port is None else f"{name}:{parts.port}"
        self.proxy = (proxies or Proxies()).for_url(url)
        auth = self.proxy.authorization() if self.proxy is not None else None
        base = {
            "Host": host_header,
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",
            "Connection": "keep-alive",
            "Content-Type": "application/json",
            **headers,
        }
        if self.proxy is not None and not self.tls:
            # Absolute-form to the proxy, which takes its credentials from the request itself.
            self.path = f"http://{host_header}{self.path}"
            if auth is not None:
                base["Proxy-Authorization"] = auth
        self._head = "".join(f"{k}: {v}\r\n" for k, v in base.items()).encode("latin-1")
        self._target = f"{name}:{self.port}"
        self._connect = (
            f"CONNECT {self._target} HTTP/1.1\r\nHost: {self._target}\r\n"
            + (f"Proxy-Authorization: {auth}\r\n" if auth is not None else "")
            + "\r\n"
        ).encode("latin-1")
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.total_timeout_s = total_timeout_s
        self.secrets = secrets
        self._ssl = (ssl_context or ssl.create_default_context()) if self.tls else None
        self._addr: tuple[int, Any] | None = None  # (family, address) of the origin or of the proxy
        self._idle: deque[_Connection] = deque()
        self._active: set[_Connection] = set()
        self._ready: list[_Connection] = []  # paused with something to decode
        self._pump: asyncio.Task | None = None
        self._durations: deque[float] = deque(maxlen=256)
        self.tick_s = FIRST_TICK_S
        self._closed = False

    # -- public --------------------------------------------------------------------------------------------
    async def post(self, body: bytes, on_events: OnEvents) -> bool:
        """POST `body` and hand every `data:` event to `on_events`, in batches and in order. Returns True when
        the stream ended with `[DONE]`; an error status raises the classified InferenceError."""
        for attempt in (0, 1):
            conn = await self._acquire()
            try:
                await self._send(conn, body)
            except InferenceError:
                self._discard(conn)
                raise
            except (ConnectionError, OSError) as e:
                self._discard(conn)
                # A reused connection the server had closed before reading the request: nothing was processed.
                if conn.reused and not conn.got_bytes and attempt == 0:
                    continue
                raise InferenceError(ErrorKind.CONNECTION, f"{type(e).__name__}: {e}") from None
            return await self._read(conn, on_events)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        self._closed = True
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        for conn in [*self._idle, *self._active]:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
        self._active.clear()

    # -- connections ---------------------------------------------------------------------------------------
    async def _acquire(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_S:
                conn.reused = True
                return conn
            if conn.transport is not None:
                conn.transport.close()
        conn = _Connection(self)
        via = "" if self.proxy is None else f" to the proxy {self.proxy} ({self.proxy.source})"
        try:
            await asyncio.wait_for(self._open(conn), self.connect_timeout_s)
        except TimeoutError:
            raise InferenceError(
                ErrorKind.TIMEOUT, f"could not connect{via} within the connect timeout"
            ) from None
        except OSError as e:
            self._addr = None  # resolve again next time
            raise InferenceError(ErrorKind.CONNECTION, f"connecting{via}: {type(e).__name__}: {e}") from None
        return conn

    async def _open(self, conn: _Connection) -> None:
        """A new connection for `conn`: to the origin, to the proxy (http), or through the proxy's tunnel
        (https)."""
        loop = asyncio.get_running_loop()
        if self._addr is None:
            host, port = (self.host, self.port) if self.proxy is None else (self.proxy.host, self.proxy.port)
            info = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
            self._addr = (int(info[0]), info[4])
        family, addr = self._addr
        if self.proxy is not None and self.tls:
            sock = await self._tunnel(family, addr)
            try:
                await loop.create_connection(
                    lambda: conn, sock=sock, ssl=self._ssl, server_hostname=self.host
                )
            except BaseException:
                sock.close()
                raise
            return
        await loop.create_connection(
            lambda: conn,
            host=str(addr[0]),
            port=int(addr[1]),
            ssl=self._ssl,
            server_hostname=self.host if self.tls else None,
        )

    async def _tunnel(self, family: int, addr: Any) -> socket.socket:
        """A socket connected to the proxy with a CONNECT tunnel to the origin established on it."""
        assert self.proxy is not None
        loop = asyncio.get_running_loop()
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, addr)
            await loop.sock_sendall(sock, self._connect)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await loop.sock_recv(sock, 4096)
                if not chunk:
                    raise ConnectionResetError(
                        f"the proxy closed the connection before answering CONNECT {self._target}"
                    )
                head += chunk
                if len(head) > MAX_PROXY_HEAD:
                    break
            status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            version, _, rest = status_line.partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/") or not code.isdigit():
                raise InferenceError(
                    ErrorKind.CONNECTION,
                    f"the proxy {self.proxy} ({self.proxy.source}) answered CONNECT with "
                    f"{status_line[:80]!r}",
                )
            if int(code) != 200:
                raise proxy_refused(self.proxy, self._target, int(code), reason)
            if not head.endswith(b"\r\n\r\n"):  # the origin speaks only after the client's TLS hello
                raise InferenceError(
                    ErrorKind.CONNECTION, f"the proxy {self.proxy} sent bytes after its CONNECT answer"
                )
            return sock
        except BaseException:
            sock.close()
            raise

    async def _send(self, conn: _Connection, body: bytes) -> None:
        if conn.closed:
            raise ConnectionResetError("the server closed the connection")
        head_ready = asyncio.get_running_loop().create_future()
        conn.begin(head_ready)
        conn.wire.resume_reading()
        conn.wire.write(
            b"POST " + self.path.encode() + b" HTTP/1.1\r\n" + self._head + b"Content-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body
        )  # fmt: skip
        try:
            await asyncio.wait_for(head_ready, self.idle_timeout_s)
        except TimeoutError:
            raise InferenceError(ErrorKind.TIMEOUT, "no response head within the idle timeout") from None

    async def _read(self, conn: _Connection, on_events: OnEvents) -> bool:
        r = conn.response
        assert r is not None
        events = EventBatches(r.headers, on_events, self.secrets)
        events.finished = asyncio.get_running_loop().create_future()
        status = conn.parser.get_status_code()
        if status != 200:
            events.collect = bytearray()
        conn.events = events
        self._active.add(conn)
        self._service(conn)  # what came with the head, or all of it
        self._ensure_pump()
        try:
            await events.finished
        finally:
            self._active.discard(conn)
        if events.error is not None:
            self._discard(conn)
            raise events.error
        if events.collect is not None:
            self._discard(conn)
            if status == 407 and self.proxy is not None:  # absolute-form: the proxy's own refusal
                raise proxy_refused(self.proxy, self._target, 407, "Proxy Authentication Required")
            raise _error_response(status, redact(bytes(events.collect), self.secrets), r.headers)
        self._durations.append(time.monotonic() - conn.started_at)
        if conn.reusable():
            conn.idle()
            conn.wire.resume_reading()  # to notice the server closing it
            self._idle.append(conn)
        else:
            self._discard(conn)
        return events.done

    def _discard(self, conn: _Connection) -> None:
        self._active.discard(conn)
        if conn.transport is not None and not conn.closed:
            conn.transport.close()

    def _forget(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    # -- decoding ------------------------------------------------------------------------------------------
    def _service(self, conn: _Connection) -> None:
        """Decode what the connection gathered; finish its stream when its body ended."""
        e, r = conn.events, conn.response
        if e is None or r is None or e.finished is None or e.finished.done():
            return
        try:
            if r.error is not None:
                raise r.error
            payload = r.take()
            if e.collect is not None:
                e.collect += payload
            elif payload or r.complete:
                e.feed(payload, final=r.complete)
        except BaseException as error:  # a classified error event, malformed framing or JSON, a bug
            self._fail(conn, error)
            return
        if r.complete and not e.finished.done():
            e.finished.set_result(None)

    def _fail(self, conn: _Connection, error: BaseException) -> None:
        e = conn.events
        if e is not None and e.finished is not None and not e.finished.done():
            e.error = error
            e.finished.set_result(None)

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def _run_pump(self) -> None:
        every = min(TIMEOUT_CHECK_S, self.idle_timeout_s / 4)
        next_check = time.monotonic() + every
        while self._active and not self._closed:
            await asyncio.sleep(self.tick_s)
            ready, self._ready = self._ready, []
            for conn in ready:
                conn.queued = False
                self._service(conn)
                if not conn.closed and conn.transport is not None:
                    conn.transport.resume_reading()
            now = time.monotonic()
            if now >= next_check:
                next_check = now + every
                self._check_timeouts(now)
            self._adapt_tick()

    def _check_timeouts(self, now: float) -> None:
        for conn in list(self._active):
            if now - conn.last_data_at > self.idle_timeout_s:
                self._fail(conn, InferenceError(ErrorKind.TIMEOUT, "the stream went silent (idle timeout)"))
            elif now - conn.started_at > self.total_timeout_s:
                self._fail(conn, InferenceError(ErrorKind.TIMEOUT, "no complete answer within the timeout"))

    def _adapt_tick(self) -> None:
        """A twentieth of the time of the shortest answers (their 10th percentile), within [5 ms, 250 ms]."""
        if len(self._durations) < 16:
            return
        xs = sorted(self._durations)
        self.tick_s = min(MAX_TICK_S, max(MIN_TICK_S, xs[len(xs) // 10] / 20))
