"""A lean loopback provider for measuring a client's CPU per streamed event, in its own process.

Providers send a streamed answer one token per event, each event in its own TCP segment, spread over the
answer's time. A server in Python that writes 64,000 events a second through aiohttp needs more than the one
core it has here: it falls behind, and late events arrive in clumps, which makes every client look cheaper per
event than it is against a real provider. This one keeps pace on a share of a core: a raw protocol, prebuilt
event bytes, one timer wheel for all streams, one `send` per event with Nagle off. It reports how far behind
it fell (its lag), so a measurement where it could not keep up says so.

A request with `"stream": true` gets `events` content events spread evenly over a log-normal time (median
`median_s`), then the finish event with usage and `[DONE]`, chunked, as OpenRouter sends them; any other
request gets the same answer unstreamed after the same time.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import multiprocessing as mp
import os
import random
import socket
import time
from pathlib import Path

TICK_S = 0.002

# An OpenRouter chunk as it comes (its fields, their order, their size: ~300 bytes).
_EVENT = (
    b'data: {"id":"gen-1764650000-AbCdEfGhIjKlMnOpQrSt","provider":"Moonshot AI",'
    b'"model":"moonshotai/kimi-k2",'
    b'"object":"chat.completion.chunk","created":1764650000,"choices":[{"index":0,"delta":{"role":"assistant",'
    b'"content":" tok"},"finish_reason":null,"native_finish_reason":null,"logprobs":null}]}\n\n'
)
_CHUNK = b"%x\r\n" % len(_EVENT) + _EVENT + b"\r\n"


def _last(events: int) -> bytes:
    finish = (
        b'data: {"id":"gen-1764650000-AbCdEfGhIjKlMnOpQrSt","provider":"Moonshot AI",'
        b'"model":"moonshotai/kimi-k2",'
        b'"object":"chat.completion.chunk","created":1764650000,"choices":[{"index":0,"delta":{"role":"assistant",'
        b'"content":""},"finish_reason":"stop","native_finish_reason":"stop","logprobs":null}],"usage":'
        + json.dumps({"prompt_tokens": 20, "completion_tokens": events, "total_tokens": 20 + events}).encode()
        + b"}\n\ndata: [DONE]\n\n"
    )
    return b"%x\r\n" % len(finish) + finish + b"\r\n0\r\n\r\n"


def _body(events: int) -> bytes:
    return json.dumps(
        {
            "id": "gen-1764650000-AbCdEfGhIjKlMnOpQrSt",
            "provider": "Moonshot AI",
            "model": "moonshotai/kimi-k2",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "native_finish_reason": "stop",
                    "message": {"role": "assistant", "content": " tok" * events},
                }
            ],
            "usage": {"prompt_tokens": 20, "completion_tokens": events, "total_tokens": 20 + events},
        }
    ).encode()


_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Server:
    def __init__(self, events: int, median_s: float, sigma: float):
        self.events, self.median_s, self.sigma = events, median_s, sigma
        self.last = _last(events)
        body = _body(events)
        self.plain = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(
            body
        )
        self.plain += body
        self.wheel: list[tuple[float, int, _Conn]] = []  # (due, sequence, connection)
        self.seq = 0
        self.sent = 0
        self.lag_sum = 0.0
        self.lag_max = 0.0

    def duration(self) -> float:
        return self.median_s * math.exp(random.gauss(0.0, self.sigma))

    def schedule(self, due: float, conn: _Conn) -> None:
        self.seq += 1
        heapq.heappush(self.wheel, (due, self.seq, conn))

    async def run(self) -> None:
        wheel, pop, push = self.wheel, heapq.heappop, heapq.heappush
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            while wheel and wheel[0][0] <= now:
                due, seq, conn = pop(wheel)
                lag = now - due
                self.lag_sum += lag
                if lag > self.lag_max:
                    self.lag_max = lag
                if conn.closed:
                    continue
                self.sent += 1
                if conn.left > 0:
                    conn.transport.write(_CHUNK)
                    conn.left -= 1
                    push(wheel, (due + conn.step, seq, conn))
                else:
                    conn.transport.write(self.last if conn.streamed else self.plain)


class _Conn(asyncio.Protocol):
    def __init__(self, server: _Server):
        self.server = server
        self.buf = b""
        self.closed = False
        self.left = 0
        self.step = 0.0
        self.streamed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].lower()
            length = (
                int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                if b"content-length:" in head
                else 0
            )
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
            self._answer(b'"stream":true' in body.replace(b" ", b""))

    def _answer(self, streamed: bool) -> None:
        s = self.server
        duration, now = s.duration(), time.monotonic()
        self.streamed = streamed
        if streamed:
            self.transport.write(_HEAD)
            self.left, self.step = s.events, duration / (s.events + 1)
            s.schedule(now + self.step, self)
        else:
            self.left = 0
            s.schedule(now + duration, self)


def _serve(events: int, median_s: float, sigma: float, pipe) -> None:
    import signal

    async def main() -> None:
        server = _Server(events, median_s, sigma)
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(lambda: _Conn(server), "127.0.0.1", 0, backlog=8192)
        pipe.send(srv.sockets[0].getsockname()[1])
        ticker = asyncio.ensure_future(server.run())
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGUSR1, stop.set)
        await stop.wait()
        ticker.cancel()
        pipe.send(
            {
                "sent": server.sent,
                "mean_lag_s": server.lag_sum / max(server.sent, 1),
                "max_lag_s": server.lag_max,
            }
        )

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())


class EventServer:
    """`with EventServer(events=256, median_s=8.0) as s:` a provider at `s.base_url`; `s.stats()` once
    done."""

    def __init__(self, events: int = 256, median_s: float = 8.0, sigma: float = 0.2):
        self.args = (events, median_s, sigma)
        self.proc: mp.Process | None = None
        self.port = 0
        self._pipe = None
        self.final: dict = {}

    def __enter__(self) -> EventServer:
        self._pipe, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_serve, args=(*self.args, child), daemon=True)
        self.proc.start()
        self.port = self._pipe.recv()
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stats(self) -> dict:
        """Events sent and how late they went out on average and at worst (stops the server)."""
        if not self.final and self.proc is not None and self.proc.is_alive():
            os.kill(self.proc.pid, __import__("signal").SIGUSR1)
            self.final = self._pipe.recv() if self._pipe.poll(10) else {}
        return self.final

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.stats()
            self.proc.terminate()
            self.proc.join(5)
