"""The stream client (resources/inference/streaming.py) against real servers on loopback that send exact
bytes: chunked framing split anywhere, events split across chunks, keep-alive reuse and a connection the
server dropped while idle, error statuses with their bodies, a cut, a malformed event, silence, an unframed
body, TLS, redaction.

TCP decides where a stream's bytes are cut into reads, so the splits themselves are tested on the client's
decoding with cuts the test chooses (`decode_in_pieces`); the loopback tests assert what holds for any cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import ssl

import httptools
import pytest

from eagle3_assets.core.generation.protocol import ErrorKind, InferenceError
from resources.inference.sse import EventBatches, Response
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
    """A TCP server on loopback whose handler gets each request and writes whatever bytes it likes.
    `dropped` is set once the server has closed a connection."""

    def __init__(self, handler, ssl_context: ssl.SSLContext | None = None):
        self.handler = handler
        self.ssl = ssl_context
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> RawServer:
        self.dropped = asyncio.Event()

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
                self.dropped.set()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=self.ssl)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/v1/chat/completions"


def collect() -> tuple[list[dict], callable]:
    seen: list[dict] = []

    def on_event(events, headers):
        seen.extend(events)

    return seen, on_event


def run(coro):
    return asyncio.run(coro)


async def failed_posts(client: StreamClient, n: int) -> list[InferenceError]:
    """`n` posts that must each fail: their errors, in order (the client closed after)."""
    errors = []
    for _ in range(n):
        with pytest.raises(InferenceError) as e:
            await client.post(b"{}", lambda ev, h: None)
        errors.append(e.value)
    await client.close()
    return errors


def decode_in_pieces(
    response: bytes, ends: list[int], secrets: tuple[bytes, ...] = ()
) -> tuple[list[dict], bool]:
    """The events of one HTTP response whose bytes arrive in pieces ending at `ends`, decoded as the client
    does at each pump tick (the C parser fed the piece, the payload it has undone handed to the event
    decoder), and whether the stream said `[DONE]`."""
    seen: list[dict] = []
    r = Response(lambda: None)
    parser = httptools.HttpResponseParser(r)
    events = EventBatches(r.headers, lambda batch, _headers: seen.extend(batch), secrets)
    for a, b in itertools.pairwise([0, *ends, len(response)]):
        parser.feed_data(response[a:b])
        payload = r.take()
        if payload or r.complete:
            events.feed(payload, final=r.complete)
    assert r.complete, "the response did not end"
    return seen, events.done


def every_way_to_cut(response: bytes, packet: int) -> list[list[int]]:
    """Cuts of `response`: at each single position, into `packet`-byte pieces, and into single bytes."""
    n = len(response)
    return [[i] for i in range(1, n)] + [list(range(packet, n, packet)), list(range(1, n))]


CHUNKED_BODY = HEAD + chunked(sse(*EVENTS, "[DONE]"), [7, 1, 50, 3, 120])


def test_framing_split_anywhere_and_events_split_across_chunks():
    for ends in every_way_to_cut(CHUNKED_BODY, 5):
        assert decode_in_pieces(CHUNKED_BODY, ends) == (EVENTS, True), ends


def test_a_stream_written_in_small_packets_is_read_whole():
    """Through a real socket: five bytes per write, merged or not by TCP, the same events."""
    body = CHUNKED_BODY

    async def handler(writer, _body, _n):
        for i in range(0, len(body), 5):
            writer.write(body[i : i + 5])
            await writer.drain()

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
            # The server has closed it (noticed while idle or on the next write): the next request opens
            # another.
            await server.dropped.wait()
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
            return await failed_posts(StreamClient(server.url(), {}, secrets=(b"secret-key-123",)), 2)

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
            errors = await failed_posts(StreamClient(server.url(), {}, idle_timeout_s=0.3), 3)
            return [e.kind for e in errors]

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
    """The budget counts a streamed answer's tokens while it is in flight: events are handed on at the
    pump's ticks, not only when the answer ends. The server holds the rest of the answer back until the
    caller has the first event (or, if it never gets it, a minute later, and the order below fails)."""
    order: list[str] = []

    async def main():
        first_seen = asyncio.Event()

        async def handler(writer, _body, _n):
            writer.write(HEAD + b"%x\r\n" % len(sse(EVENTS[0])) + sse(EVENTS[0]) + b"\r\n")
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(first_seen.wait(), 60)
            order.append("rest sent")
            writer.write(chunked(sse(EVENTS[1], "[DONE]"), []))
            await writer.drain()

        def on_events(events, _headers):
            order.extend("event" for _ in events)
            first_seen.set()

        async with RawServer(handler) as server:
            client = StreamClient(server.url(), {})
            done = await client.post(b"{}", on_events)
            await client.close()
            return done

    assert run(main())
    assert order == ["event", "rest sent", "event"]


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


def test_every_event_form_reaches_the_caller_in_order_and_the_key_never_does():
    """Providers' common form (`data: <json>` and a blank line) is decoded a batch at a time; everything else
    a server may send takes the line-by-line path with the same result: comments, other fields, `\\r\\n` line
    ends, an event that is not an object, a content that says `[DONE]`, an event split across packets; a key
    echoed back is redacted before anything is parsed."""
    ev = [{"choices": [{"delta": {"content": f"c{i}"}}]} for i in range(8)]
    said_done = {"choices": [{"delta": {"content": "data: [DONE] is how streams end"}}]}
    echoed = {"choices": [{"delta": {"content": "your key is secret-key-123"}}]}
    payload = (
        sse(ev[0], ev[1])
        + b": keep-alive\n\n"
        + sse(ev[2])
        + b"event: message\nid: 7\ndata: "
        + json.dumps(ev[3]).encode()
        + b"\r\n\r\ndata: 5\n\n"
        + sse(said_done, ev[4], echoed, ev[5])
        + b"data:"
        + json.dumps(ev[6]).encode()
        + b"\n\n"
        + sse(ev[7], "[DONE]")
    )

    response = HEAD + chunked(payload, [3, 40, 90, 11, 200])
    secrets = (b"secret-key-123",)
    redacted = {"choices": [{"delta": {"content": "your key is [redacted]"}}]}
    expected = [*ev[:4], said_done, ev[4], redacted, *ev[5:]]
    for ends in every_way_to_cut(response, 97):  # packets that end anywhere
        assert decode_in_pieces(response, ends, secrets) == (expected, True), ends

    async def handler(writer, _body, _n):
        for i in range(0, len(response), 97):
            writer.write(response[i : i + 97])
            await writer.drain()

    async def main():
        async with RawServer(handler) as server:
            client = StreamClient(server.url(), {}, secrets=secrets)
            seen, on_event = collect()
            done = await client.post(b"{}", on_event)
            await client.close()
            return done, seen

    done, seen = run(main())
    assert done and seen == expected


def test_broken_http_is_classified_as_malformed():
    """A bad status line and a bad chunk size: the C parser's refusal becomes a MALFORMED error, and the
    connection is not reused."""

    async def handler(writer, _body, n):
        if n == 1:
            writer.write(b"HTTP/1.1 OK\r\n\r\n")
        else:
            writer.write(HEAD + b"zz\r\n" + sse(EVENTS[0]) + b"\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    async def main():
        async with RawServer(handler) as server:
            return await failed_posts(StreamClient(server.url(), {}), 2), server.connections

    errors, connections = run(main())
    assert [e.kind for e in errors] == [ErrorKind.MALFORMED, ErrorKind.MALFORMED], errors
    assert connections == 2


def test_token_ids_streamed_with_each_event_are_joined_in_order():
    """vLLM (`return_token_ids`) sends each event's ids: the answer keeps them all, in order, across
    batches."""
    from eagle3_assets.core.generation.protocol import CompletionRequest
    from resources.inference.openrouter import StreamedAnswer

    request = CompletionRequest("r", [{"role": "user", "content": "x"}], 64)
    answer = StreamedAnswer(request)
    batches = [
        [
            {"choices": [{"index": 0, "delta": {"content": f"t{i}"}, "token_ids": [i]}]}
            for i in range(j, j + 3)
        ]
        for j in (0, 3)
    ]
    last = {"choices": [{"index": 0, "delta": {}, "token_ids": [6, 7], "finish_reason": "stop"}]}
    answer(batches[0], {})
    answer([*batches[1], last], {})
    completion = answer.completion("m")
    assert completion.output_ids == list(range(8)) and completion.content == "t0t1t2t3t4t5"
    assert request.streamed_tokens == 6
