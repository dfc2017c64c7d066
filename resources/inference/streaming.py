"""Server-sent event streams at tens of thousands of events a second, on the one core the engine's loop has.

Why not aiohttp for the streams: measured here, aiohttp spends ~30 µs of client CPU per event when every event comes
in its own TCP packet, as providers send them (one token at a time): a wake-up of the loop, a read, three Python
callbacks of the HTTP parser per chunk, and a switch to the reading task. The seed's 40,000 events/s would need 1.2
cores; the engine has one. Here a connection's protocol only appends what arrives and pauses its socket; a pump, every
`tick_s`, decodes what each stream gathered (chunked framing, then `data:` lines, parsed by orjson in one batch) and
lets every socket read again, so the kernel collects the events in between and one read takes several. A stream's
last chunk is seen as it arrives. Ticks adapt to the answers: a twentieth of the shortest answers' time (5 ms to 250
ms), so a stream's end waits for at most a small share of its own length.

Connections are HTTP/1.1 keep-alive, per origin, reused for the next request; TLS through the standard library. The
rest of the backend (non-streamed requests, preflight, error bodies' classification) stays on aiohttp; an error
status here is read whole and classified by the same `http._error_response`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from eagle3_assets.core.generation.protocol import ErrorKind, InferenceError, describe

from .http import _error_response, loads, redact

KEEPALIVE_S = 30.0  # an idle connection older than this is closed, not reused (servers drop them around 60 s)
MIN_TICK_S, MAX_TICK_S, FIRST_TICK_S = 0.005, 0.25, 0.01

OnEvent = Callable[[dict, Mapping[str, str]], None]


class _Headers(dict):
    """Response headers, looked up without regard to case (`Retry-After`, `X-RateLimit-Reset`)."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> Any:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())


class _Stream:
    """One streamed response being decoded: its framing state, its events, its outcome."""

    __slots__ = (
        "body",
        "chunk_left",
        "collect",
        "done",
        "ended",
        "error",
        "finished",
        "headers",
        "length_left",
        "lines",
        "on_event",
        "secrets",
    )

    def __init__(self, headers: _Headers, on_event: OnEvent, secrets: tuple[bytes, ...]):
        self.headers = headers
        self.on_event = on_event
        self.secrets = secrets
        self.body = bytearray()  # raw body bytes not decoded yet
        self.chunk_left = -1  # bytes left in the current chunk; -1: a size line is next; -2: trailers
        self.lines = bytearray()  # decoded payload not yet split into complete lines
        self.done = False  # saw `data: [DONE]`
        self.ended = False  # the body ended (last chunk, or the connection closed an unframed body)
        self.finished: asyncio.Future | None = None
        self.error: BaseException | None = None
        self.length_left: int | None = None  # a Content-Length body (a server that did not stream)
        self.collect: bytearray | None = (
            None  # an error status: the body is kept whole, not decoded as events
        )

    def unframed(self) -> bytes:
        """The payload of a body that is not chunked: up to its Content-Length, or until the connection ends."""
        out = bytes(self.body)
        self.body.clear()
        if self.length_left is not None:
            out = out[: self.length_left]
            self.length_left -= len(out)
            if self.length_left <= 0:
                self.ended = True
        return out

    def dechunk(self) -> bytes:
        """Decode the chunked framing of what has arrived; returns the payload bytes now complete. One pass over an
        immutable copy, slices joined once: a provider's events come one per chunk, so this loop runs per event."""
        data = bytes(self.body)
        n, pos, left, parts = len(data), 0, self.chunk_left, []
        find = data.find
        while True:
            if left > 0:
                end = pos + left
                if end > n:
                    parts.append(data[pos:])
                    left -= n - pos
                    pos = n
                    break
                parts.append(data[pos:end])
                pos, left = end, -3
            if left == -3:  # the CRLF after a chunk's data
                if n - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise InferenceError(
                        ErrorKind.MALFORMED, "bad chunked framing (no CRLF after a chunk)", status=200
                    )
                pos, left = pos + 2, -1
            eol = find(b"\r\n", pos)
            if eol < 0:
                break
            line = data[pos:eol]
            pos = eol + 2
            if left == -2:  # trailers, up to an empty line
                if not line:
                    self.ended = True
                    break
                continue
            try:
                size = int(line, 16)
            except ValueError:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)  # a chunk extension
                except ValueError:
                    raise InferenceError(
                        ErrorKind.MALFORMED,
                        f"bad chunk size line {describe(line.decode('latin-1'))}",
                        status=200,
                    ) from None
            left = size if size else -2
        self.chunk_left = left
        del self.body[:pos]
        return b"".join(parts)

    def feed(self, payload: bytes) -> None:
        """Complete `data:` lines of the payload so far, parsed in one batch and handed on in order."""
        if payload:
            self.lines += payload
        cut = self.lines.rfind(b"\n")
        if cut < 0:
            return
        chunk = bytes(self.lines[: cut + 1])
        del self.lines[: cut + 1]
        datas = []
        for line in chunk.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # blank separators, ": keep-alive" comments, event:/id: fields
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                break
            if data:
                datas.append(data)
        if not datas:
            return
        if self.secrets and any(secret in chunk for secret in self.secrets):
            datas = [redact(d, self.secrets) for d in datas]
        try:
            events = loads(b"[" + b",".join(datas) + b"]")
        except ValueError:
            events = []
            for d in datas:
                try:
                    events.append(loads(d))
                except ValueError:
                    raise InferenceError(
                        ErrorKind.MALFORMED,
                        f"unparsable stream event: {describe(d.decode('utf-8', 'replace'))}",
                        status=200,
                    ) from None
        for event in events:
            if isinstance(event, dict):
                self.on_event(event, self.headers)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: sends a request, reads its response; between ticks it only gathers bytes."""

    def __init__(self, client: StreamClient):
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.raw = bytearray()  # before the headers are complete
        self.status = 0
        self.headers: _Headers | None = None
        self.head_ready: asyncio.Future | None = None
        self.early = bytearray()  # body bytes that came before the reader took over
        self.length: int | None = None  # Content-Length of an error body
        self.chunked = False
        self.keep_alive = True
        self.stream: _Stream | None = None
        self.got_bytes = False
        self.last_data_at = time.monotonic()
        self.started_at = time.monotonic()

    # -- asyncio.Protocol ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_data_at = time.monotonic()
        s = self.stream
        if s is not None:
            s.body += data
            if data.endswith(b"0\r\n\r\n") or not self.chunked:
                self.client._service(self)  # the last chunk (or an unframed body): finish now
            else:
                self.transport.pause_reading()  # type: ignore[union-attr]  # the pump reads on at its tick
            return
        if self.headers is not None:
            self.early += data  # the head is parsed; the reader has not taken over yet
            return
        if self.head_ready is None:
            return  # bytes on an idle connection: the server is closing it
        self.raw += data
        end = self.raw.find(b"\r\n\r\n")
        if end >= 0:
            self._parse_head(end)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._forget(self)
        err = exc or ConnectionResetError("the server closed the connection")
        if self.head_ready is not None and not self.head_ready.done():
            self.head_ready.set_exception(err)
        elif self.stream is not None and not self.stream.ended:
            if self.chunked:
                self.client._fail(self, InferenceError(ErrorKind.CONNECTION, f"response cut off: {err}"))
            else:
                self.stream.ended = True  # an unframed body ends when the connection does
                self.client._service(self)

    # -- the response head ----------------------------------------------------------------------------------
    def _parse_head(self, end: int) -> None:
        head = bytes(self.raw[:end])
        self.early = bytearray(self.raw[end + 4 :])
        self.raw = bytearray()
        lines = head.split(b"\r\n")
        try:
            version, status = lines[0].split(b" ", 2)[:2]
            self.status = int(status)
        except ValueError:
            if not self.head_ready.done():  # type: ignore[union-attr]
                self.head_ready.set_exception(  # type: ignore[union-attr]
                    InferenceError(
                        ErrorKind.MALFORMED, f"bad status line {describe(lines[0].decode('latin-1'))}"
                    )
                )
            return
        headers = _Headers()
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
        self.headers = headers
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        connection = headers.get("connection", "").lower()
        self.keep_alive = version == b"HTTP/1.1" and "close" not in connection
        length = headers.get("content-length")
        self.length = int(length) if length and length.isdigit() and not self.chunked else None
        if not self.head_ready.done():  # type: ignore[union-attr]  # the caller may have been cancelled meanwhile
            self.head_ready.set_result(None)  # type: ignore[union-attr]


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
    ):
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.tls else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host_header = self.host if parts.port is None else f"{self.host}:{parts.port}"
        base = {
            "Host": host_header,
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",
            "Connection": "keep-alive",
            "Content-Type": "application/json",
            **headers,
        }
        self._head = "".join(f"{k}: {v}\r\n" for k, v in base.items()).encode("latin-1")
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.total_timeout_s = total_timeout_s
        self.secrets = secrets
        self._ssl = (ssl_context or ssl.create_default_context()) if self.tls else None
        self._addr: tuple[Any, ...] | None = None
        self._idle: deque[_Connection] = deque()
        self._active: set[_Connection] = set()
        self._pump: asyncio.Task | None = None
        self._durations: deque[float] = deque(maxlen=256)
        self.tick_s = FIRST_TICK_S
        self._closed = False

    # -- public --------------------------------------------------------------------------------------------
    async def post(self, body: bytes, on_event: OnEvent) -> bool:
        """POST `body` and feed every `data:` event to `on_event` (which may raise a classified error). Returns
        True when the stream ended with `[DONE]`; an error status raises the classified InferenceError."""
        for attempt in (0, 1):
            conn = await self._acquire()
            try:
                await self._send(conn, body)
            except InferenceError:
                self._discard(conn)
                raise
            except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
                self._discard(conn)
                # A reused connection the server had closed before reading the request: nothing was processed.
                if conn.reused and not conn.got_bytes and attempt == 0:
                    continue
                raise InferenceError(ErrorKind.CONNECTION, f"{type(e).__name__}: {e}") from None
            return await self._read(conn, on_event)
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
                conn._reset()
                return conn
            if conn.transport is not None:
                conn.transport.close()
        loop = asyncio.get_running_loop()
        if self._addr is None:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            self._addr = infos[0][4]
        conn = _Connection(self)
        try:
            await asyncio.wait_for(
                loop.create_connection(
                    lambda: conn,
                    host=self._addr[0],
                    port=self._addr[1],
                    ssl=self._ssl,
                    server_hostname=self.host if self.tls else None,
                ),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise InferenceError(ErrorKind.TIMEOUT, "could not connect within the connect timeout") from None
        except OSError as e:
            self._addr = None  # resolve again next time
            raise InferenceError(ErrorKind.CONNECTION, f"{type(e).__name__}: {e}") from None
        return conn

    async def _send(self, conn: _Connection, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        conn.head_ready = loop.create_future()
        conn.started_at = time.monotonic()
        conn.transport.resume_reading()  # type: ignore[union-attr]
        conn.transport.write(  # type: ignore[union-attr]
            b"POST " + self.path.encode() + b" HTTP/1.1\r\n" + self._head + b"Content-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body
        )  # fmt: skip
        try:
            await asyncio.wait_for(conn.head_ready, self.idle_timeout_s)
        except TimeoutError:
            raise InferenceError(ErrorKind.TIMEOUT, "no response head within the idle timeout") from None

    async def _read(self, conn: _Connection, on_event: OnEvent) -> bool:
        loop = asyncio.get_running_loop()
        headers = conn.headers or _Headers()
        conn.head_ready = None
        rest, conn.early = bytes(conn.early), bytearray()
        stream = _Stream(headers, on_event, self.secrets)
        stream.finished = loop.create_future()
        if not conn.chunked:
            stream.length_left = conn.length
        if conn.status != 200:
            stream.collect = bytearray()
        conn.stream = stream
        self._active.add(conn)
        stream.body += rest
        if conn.closed and not conn.chunked and conn.length is None:
            stream.ended = True  # an unframed body that the server already finished by closing
        self._service(conn)
        if conn.closed and not stream.finished.done():
            self._fail(
                conn,
                InferenceError(ErrorKind.CONNECTION, "response cut off: the server closed the connection"),
            )
        self._ensure_pump()
        try:
            await stream.finished
        finally:
            self._active.discard(conn)
        if stream.error is not None:
            self._discard(conn)
            raise stream.error
        if stream.collect is not None:
            self._discard(conn)
            raise _error_response(conn.status, redact(bytes(stream.collect), self.secrets), headers)
        self._durations.append(time.monotonic() - conn.started_at)
        if conn.keep_alive and conn.chunked and not conn.closed:
            conn.stream = None
            conn.headers = None
            conn.idle_since = time.monotonic()
            conn.transport.resume_reading()  # type: ignore[union-attr]  # to notice the server closing it
            self._idle.append(conn)
        else:
            self._discard(conn)
        return stream.done

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
        s = conn.stream
        if s is None or s.finished is None or s.finished.done():
            return
        try:
            payload = s.dechunk() if conn.chunked else s.unframed()
            if s.collect is not None:
                s.collect += payload
            else:
                s.feed(payload)
            if s.ended and s.collect is None:
                s.feed(b"\n")  # a last line without its newline
        except BaseException as e:  # a classified error event, malformed framing or JSON, a bug
            self._fail(conn, e)
            return
        if s.ended and not s.finished.done():
            s.finished.set_result(None)

    def _fail(self, conn: _Connection, error: BaseException) -> None:
        s = conn.stream
        if s is not None and s.finished is not None and not s.finished.done():
            s.error = error
            s.finished.set_result(None)

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def _run_pump(self) -> None:
        while self._active and not self._closed:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            for conn in list(self._active):
                if conn.stream is None:
                    continue
                self._service(conn)
                if now - conn.last_data_at > self.idle_timeout_s:
                    self._fail(
                        conn, InferenceError(ErrorKind.TIMEOUT, "the stream went silent (idle timeout)")
                    )
                elif now - conn.started_at > self.total_timeout_s:
                    self._fail(
                        conn, InferenceError(ErrorKind.TIMEOUT, "no complete answer within the timeout")
                    )
                elif not conn.closed and conn.transport is not None:
                    conn.transport.resume_reading()
            self._adapt_tick()

    def _adapt_tick(self) -> None:
        """A twentieth of the time of the shortest answers (their 10th percentile), within [5 ms, 250 ms]."""
        if len(self._durations) < 16:
            return
        xs = sorted(self._durations)
        self.tick_s = min(MAX_TICK_S, max(MIN_TICK_S, xs[len(xs) // 10] / 20))
