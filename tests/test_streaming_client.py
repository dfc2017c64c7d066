"""The stream client (resources/inference/streaming.py) against real servers on loopback that send exact bytes:
chunked framing split anywhere, events split across chunks, keep-alive reuse and a connection the server dropped
while idle, error statuses with their bodies, a cut, a malformed event, silence, an unframed body, TLS, redaction.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time

import pytest

from eagle3_assets.core.generation.protocol import ErrorKind, InferenceError
from resources.inference.streaming import StreamClient


def sse(*events: dict | str) -> bytes:
    out = b""
    for e in events:
        out += b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
    return out


def chunked(payload: bytes, sizes: list[int]) -> bytes:
    """The payload in HTTP chunks of the given sizes (the rest in one), then the last chunk."""
    out, pos = b"", 0
    for n in [*sizes, len(payload)]:
        part = payload[pos : pos + n]
        if part:
            out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
        pos += len(part)
    return out + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [{"choices": [{"delta": {"content": f"w{i} "}}]} for i in range(20)]


class RawServer:
    """A TCP server on loopback whose handler gets each request and writes whatever bytes it likes."""

    def __init__(self, handler, ssl_context: ssl.SSLContext | None = None):
        self.handler = handler
        self.ssl = ssl_context
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> RawServer:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    body = await reader.readexactly(length)
                    self.requests.append(body)
                    if await self.handler(writer, body, len(self.requests)) == "close":
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=self.ssl)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/v1/chat/completions"


def collect() -> tuple[list[dict], callable]:
    seen: list[dict] = []

    def on_event(event, headers):
        seen.append(event)

    return seen, on_event


def run(coro):
    return asyncio.run(coro)


def test_framing_split_anywhere_and_events_split_across_chunks():
    payload = sse(*EVENTS, "[DONE]")
    body = HEAD + chunked(payload, [7, 1, 50, 3, 120])

    async def handler(writer, _body, _n):
        for i in range(0, len(body), 5):  # five bytes per packet: every boundary falls somewhere odd
            writer.write(body[i : i + 5])
            await writer.drain()
            await asyncio.sleep(0.0005)

    async def main():
        async with RawServer(handler) as server:
            client = StreamClient(server.url(), {"Authorization": "Bearer k"})
            seen, on_event = collect()
            done = await client.post(b"{}", on_event)
            await client.close()
            return done, seen

    done, seen = run(main())
    assert done and seen == EVENTS


def test_keep_alive_reuse_and_a_connection_dropped_while_idle():
    async def handler(writer, _body, n):
        writer.write(HEAD + chunked(sse(EVENTS[0], "[DONE]"), []))
        await writer.drain()
        return "close" if n == 2 else None  # the server drops the connection after the second answer

    async def main():
        async with RawServer(handler) as server:
            client = StreamClient(server.url(), {})
            for _ in range(2):
                assert await client.post(b"{}", lambda e, h: None)
            assert server.connections == 1  # the second request reused the first connection
            await asyncio.sleep(0.05)  # the server has closed it: the next request opens another
            assert await client.post(b"{}", lambda e, h: None)
            await client.close()
            return server.connections

    assert run(main()) == 2


def test_an_error_status_is_read_whole_and_classified():
    bodies = {
        1: (b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 7\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n", b'{"error": {"code": 429, "message": "slow down"}}'),
        2: (b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n", None),
    }  # fmt: skip

    async def handler(writer, _body, n):
        head, body = bodies[n]
        if body is None:
            writer.write(head + chunked(b'{"error": {"message": "over capacity secret-key-123"}}', [10]))
        else:
            writer.write(head % len(body) + body)
        await writer.drain()

    async def main():
        async with RawServer(handler) as server:
            client = StreamClient(server.url(), {}, secrets=(b"secret-key-123",))
            errors = []
            for _ in range(2):
                with pytest.raises(InferenceError) as e:
                    await client.post(b"{}", lambda ev, h: None)
                errors.append(e.value)
            await client.close()
            return errors

    rate, busy = run(main())
    assert rate.kind is ErrorKind.RATE_LIMITED and rate.retry_after == 7 and "slow down" in rate.message
    assert busy.kind is ErrorKind.OVERLOADED and "[redacted]" in busy.message and "secret" not in busy.message


def test_a_cut_a_malformed_event_and_silence_are_classified():
    async def handler(writer, body, n):
        if n == 1:  # cut after a few events
            writer.write(HEAD + b"%x\r\n" % len(sse(EVENTS[0])) + sse(EVENTS[0]) + b"\r\n")
            await writer.drain()
            return "close"
        if n == 2:
            writer.write(HEAD + chunked(sse(EVENTS[0]) + b"data: {not json}\n\n", []))
        if n == 3:  # a head, then nothing
            writer.write(HEAD)
            await writer.drain()
            await asyncio.sleep(2)
        await writer.drain()

    async def main():
        async with RawServer(handler) as server:
            client = StreamClient(server.url(), {}, idle_timeout_s=0.3)
            kinds = []
            for _ in range(3):
                with pytest.raises(InferenceError) as e:
                    await client.post(b"{}", lambda ev, h: None)
                kinds.append(e.value.kind)
            await client.close()
            return kinds

    assert run(main()) == [ErrorKind.CONNECTION, ErrorKind.MALFORMED, ErrorKind.TIMEOUT]


def test_an_unframed_body_ends_with_its_connection():
    async def handler(writer, _body, _n):
        writer.write(
            b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + sse(*EVENTS[:3], "[DONE]")
        )
        await writer.drain()
        return "close"

    async def main():
        async with RawServer(handler) as server:
            client = StreamClient(server.url(), {})
            seen, on_event = collect()
            done = await client.post(b"{}", on_event)
            await client.close()
            return done, seen

    done, seen = run(main())
    assert done and seen == EVENTS[:3]


def test_events_reach_the_caller_while_the_stream_is_still_open():
    """The budget counts a streamed answer's tokens while it is in flight: events are handed on at the pump's
    ticks, not only when the answer ends."""
    first_at: list[float] = []

    async def handler(writer, _body, _n):
        writer.write(HEAD + b"%x\r\n" % len(sse(EVENTS[0])) + sse(EVENTS[0]) + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.write(chunked(sse(EVENTS[1], "[DONE]"), []))
        await writer.drain()

    async def main():
        async with RawServer(handler) as server:
            client = StreamClient(server.url(), {})
            t0 = time.monotonic()
            await client.post(b"{}", lambda ev, h: first_at.append(time.monotonic() - t0))
            await client.close()
            return time.monotonic() - t0

    total = run(main())
    assert len(first_at) == 2 and first_at[0] < total - 0.3


def test_tls():
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)

    async def handler(writer, _body, _n):
        writer.write(HEAD + chunked(sse(*EVENTS[:5], "[DONE]"), [9]))
        await writer.drain()

    async def main():
        async with RawServer(handler, server_ctx) as server:
            client = StreamClient(server.url("https"), {}, ssl_context=client_ctx)
            seen, on_event = collect()
            done = await client.post(b"{}", on_event)
            await client.close()
            return done, seen

    done, seen = run(main())
    assert done and seen == EVENTS[:5]
