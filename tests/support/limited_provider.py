"""A loopback OpenAI-compatible provider that behaves like real ones under load: it enforces limits, answers
with heavy-tailed lengths, takes longer for longer answers, fails at random, and streams.

Limits (any combination, changeable while it runs through `POST /_limits` or `set_limits`):
- `rate`: a token bucket of `rate` requests/s holding at most `burst` (default: one second's worth); a request
  that finds it empty gets 429, with `Retry-After: <retry_after>` when that is set;
- `max_in_flight`: at most this many requests held at once; the next gets 429 (no Retry-After unless set).

Answers: a length drawn per prompt (log-normal with median `median_tokens` and shape `sigma`, capped at the
request's `max_tokens`, so a share ends with finish_reason "length"), deterministic per prompt text so every
client compared in a benchmark faces the same work. Service time is either `base_s + tokens / tokens_per_s`
(latency grows with length) or, with `latency_median_s`, an independent log-normal draw (heavy-tailed, median
as given).

Faults: `fault_mix` maps kinds to probabilities per attempt: "429" (no Retry-After), "500", "502", "reset",
"malformed", "stream_error" (an error event after the stream started).

`GET /_stats` returns what the provider saw: attempts, accepted, refused, billed completion tokens, the
largest number in flight, and the completion time of every answer (for goodput over any window).

It runs in a thread of the test process (`with LimitedProvider(...) as p`) or, for benchmarks where the
client's CPU must be measured alone, in its own process (`LimitedProvider(..., process=True)`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import multiprocessing as mp
import random
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ProviderSpec:
    rate: float | None = None
    burst: float | None = None
    retry_after: float | None = None
    max_in_flight: int | None = None
    in_flight_retry_after: float | None = None
    median_tokens: float = 40.0
    sigma: float = 0.8
    base_s: float = 0.05
    tokens_per_s: float | None = None  # latency = base_s + tokens / tokens_per_s
    latency_median_s: float | None = 1.0  # or an independent log-normal service time
    latency_sigma: float = 0.6
    fault_mix: dict[str, float] = field(default_factory=dict)
    stream_chunks: int = 8  # SSE chunks per answer (the last carries finish_reason and usage)
    cost_per_token: float = 1e-6
    seed: int = 0


def _draw(text: str, seed: int, salt: str) -> random.Random:
    h = hashlib.blake2b(f"{seed}:{salt}:{text}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(h, "little"))


class _State:
    def __init__(self, spec: ProviderSpec):
        self.spec = spec
        self.tokens = spec.burst if spec.burst is not None else (spec.rate or 0.0)
        self.refilled_at = time.monotonic()
        self.in_flight = 0
        self.max_seen = 0
        self.attempts = 0
        self.accepted = 0
        self.refused = 0
        self.faults = 0
        self.billed_tokens = 0
        self.answers = 0
        self.done_at: list[float] = []
        self.started_at: float | None = None
        self.service_s = (
            0.0  # Σ service time of the answers given: the work an ideal client keeps the cap busy with
        )
        self.service_times: list[float] = []  # each answer's service time, in the order they were given
        self.in_flight_area = 0.0  # ∫ in_flight dt since the first request
        self.last_accepted_at: float | None = None  # after it, only what is in flight remains
        self._area_at: float | None = None
        self.fault_rng = random.Random(spec.seed + 7)

    def set_limits(self, **limits: Any) -> None:
        for k, v in limits.items():
            setattr(self.spec, k, v)
        if "rate" in limits or "burst" in limits:
            spec = self.spec
            cap = spec.burst if spec.burst is not None else (spec.rate or 0.0)
            self.tokens = min(self.tokens, cap)

    def admit(self) -> tuple[bool, dict[str, str]]:
        spec, now = self.spec, time.monotonic()
        if spec.max_in_flight is not None and self.in_flight >= spec.max_in_flight:
            ra = spec.in_flight_retry_after
            return False, ({"Retry-After": f"{ra:g}"} if ra is not None else {})
        if spec.rate:
            cap = spec.burst if spec.burst is not None else spec.rate
            self.tokens = min(cap, self.tokens + (now - self.refilled_at) * spec.rate)
            self.refilled_at = now
            if self.tokens < 1.0:
                ra = spec.retry_after
                return False, ({"Retry-After": f"{ra:g}"} if ra is not None else {})
            self.tokens -= 1.0
        return True, {}

    def answer_plan(self, text: str, max_tokens: int) -> tuple[int, float, bool]:
        spec = self.spec
        rng = _draw(text, spec.seed, "len")
        tokens = max(1, round(spec.median_tokens * math.exp(spec.sigma * rng.gauss(0, 1))))
        finished = tokens < max_tokens
        tokens = min(tokens, max_tokens)
        if spec.tokens_per_s:
            latency = spec.base_s + tokens / spec.tokens_per_s
        else:
            lat_rng = _draw(text, spec.seed, "lat")
            latency = (spec.latency_median_s or 1.0) * math.exp(spec.latency_sigma * lat_rng.gauss(0, 1))
        return tokens, latency, finished

    def change_in_flight(self, delta: int) -> None:
        now = time.monotonic()
        if self._area_at is not None:
            self.in_flight_area += self.in_flight * (now - self._area_at)
        self._area_at = now
        self.in_flight += delta
        self.max_seen = max(self.max_seen, self.in_flight)

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        area = self.in_flight_area + (self.in_flight * (now - self._area_at) if self._area_at else 0.0)
        return {
            "service_s": self.service_s,
            "last_accepted_at": self.last_accepted_at,
            "in_flight_area": area,
            "attempts": self.attempts,
            "accepted": self.accepted,
            "refused": self.refused,
            "faults": self.faults,
            "billed_tokens": self.billed_tokens,
            "answers": self.answers,
            "max_in_flight": self.max_seen,
            "in_flight": self.in_flight,
            "started_at": self.started_at,
            "done_at": self.done_at,
            "service_times": self.service_times,
            "now": time.monotonic(),
        }


def _chunk(rid: str, delta: dict | None = None, **extra: Any) -> bytes:
    event = {"id": rid, "model": "sim/model", "provider": "Sim", "object": "chat.completion.chunk"}
    event["choices"] = [{"index": 0, "delta": delta or {}, **extra.pop("choice", {})}]
    event.update(extra)
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _app(state: _State):
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = body["messages"][-1]["content"]
        s = state
        s.attempts += 1
        if s.started_at is None:
            s.started_at = time.monotonic()
        ok, headers = s.admit()
        if not ok:
            s.refused += 1
            return web.json_response(
                {"error": {"code": 429, "message": "Rate limit exceeded"}}, status=429, headers=headers
            )
        s.accepted += 1
        s.last_accepted_at = time.monotonic()
        s.change_in_flight(+1)
        try:
            return await _serve(request, body, text)
        finally:
            s.change_in_flight(-1)

    async def _serve(request: web.Request, body: dict, text: str) -> web.StreamResponse:
        s, spec = state, state.spec
        fault = None
        if spec.fault_mix:
            x = s.fault_rng.random()
            for kind, p in spec.fault_mix.items():
                if x < p:
                    fault = kind
                    break
                x -= p
        tokens, latency, finished = s.answer_plan(text, int(body.get("max_tokens") or 10**9))
        if fault in ("429", "500", "502"):
            s.faults += 1
            await asyncio.sleep(min(latency, 0.05))
            return web.json_response(
                {"error": {"code": int(fault), "message": f"sim {fault}"}}, status=int(fault)
            )
        if fault == "reset":
            s.faults += 1
            await asyncio.sleep(min(latency, 0.05))
            request.transport.close()
            return web.Response(status=500)
        if fault == "malformed":
            s.faults += 1
            await asyncio.sleep(min(latency, 0.05))
            return web.Response(status=200, body=b'{"choices": [', content_type="application/json")
        rid = f"gen-{s.attempts}"
        content = "tok " * tokens
        usage = {
            "prompt_tokens": 12,
            "completion_tokens": tokens,
            "total_tokens": 12 + tokens,
            "cost": round(tokens * spec.cost_per_token, 12),
        }
        finish = "stop" if finished else "length"
        if not body.get("stream"):
            await asyncio.sleep(latency)
            s.service_s += latency
            s.service_times.append(latency)
            s.billed_tokens += tokens
            s.answers += 1
            s.done_at.append(time.monotonic())
            return web.json_response(
                {
                    "id": rid,
                    "model": "sim/model",
                    "provider": "Sim",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": finish,
                            "message": {"role": "assistant", "content": content},
                        }
                    ],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = max(1, min(spec.stream_chunks, tokens))
        per = tokens // n
        for i in range(n):
            await asyncio.sleep(latency / n)
            if fault == "stream_error" and i == n // 2:
                s.faults += 1
                await resp.write(
                    _chunk(
                        rid,
                        error={"code": 502, "message": "sim upstream error mid-stream"},
                        choice={"finish_reason": "error"},
                    )
                )
                await resp.write(b"data: [DONE]\n\n")
                return resp
            part = per if i < n - 1 else tokens - per * (n - 1)
            await resp.write(_chunk(rid, {"content": "tok " * part}))
        s.service_s += latency
        s.service_times.append(latency)
        s.billed_tokens += tokens
        s.answers += 1
        s.done_at.append(time.monotonic())
        await resp.write(_chunk(rid, {}, choice={"finish_reason": finish}, usage=usage))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "sim/model"}]})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(state.stats())

    async def limits(request: web.Request) -> web.Response:
        state.set_limits(**(await request.json()))
        return web.json_response(asdict(state.spec))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/_stats", stats)
    app.router.add_post("/_limits", limits)
    return app


async def _start_site(state: _State):
    from aiohttp import web

    runner = web.AppRunner(_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=8192)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def _process_main(spec: ProviderSpec, conn) -> None:
    import signal

    # A parent that ignores SIGTERM passes that on through exec: stop() must still end this process.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        _, port = await _start_site(_State(spec))
        conn.send(port)
        await asyncio.Event().wait()

    asyncio.run(main())


class LimitedProvider:
    def __init__(self, spec: ProviderSpec | None = None, process: bool = False, **kw: Any):
        self.spec = spec or ProviderSpec(**kw)
        self.process = process
        self.port = 0
        self._proc: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> LimitedProvider:
        if self.process:
            parent, child = mp.Pipe()
            self._proc = mp.get_context("spawn").Process(
                target=_process_main, args=(self.spec, child), daemon=True
            )
            self._proc.start()
            self.port = parent.recv()
            return self
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner, self.port = asyncio.run_coroutine_threadsafe(
            _start_site(_State(self.spec)), self._loop
        ).result(10)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.is_alive():  # never leave a server behind: interpreter exit would wait for it
                self._proc.kill()
                self._proc.join(5)
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> LimitedProvider:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- control over HTTP (works for both modes) ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/_stats", timeout=30) as r:
            return json.loads(r.read())

    def set_limits(self, **limits: Any) -> None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/_limits",
            data=json.dumps(limits).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30):
            pass

    def cpu_seconds(self) -> float:
        """CPU the provider process used so far (process mode only)."""
        import os
        from pathlib import Path

        fields = Path(f"/proc/{self._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def goodput(done_at: list[float], lo: float = 0.1, hi: float = 0.9) -> float:
    """Answers per second between the lo and hi quantiles of completion (ramp-up and drain left out)."""
    xs = sorted(done_at)
    if len(xs) < 10:
        return 0.0
    a, b = int(lo * (len(xs) - 1)), int(hi * (len(xs) - 1))
    return (b - a) / max(xs[b] - xs[a], 1e-9)
