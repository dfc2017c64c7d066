"""A loopback chat-completions server with a fixed latency, in its own process (so client CPU is measured
alone).

A request with `"stream": true` is answered as server-sent events: `EVENTS` content events spread over the
latency (one per chunk, as providers send tokens), then the finish event with usage and `[DONE]`."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
from pathlib import Path

BODY = json.dumps(
    {
        "id": "gen-bench",
        "model": "bench/model",
        "provider": "Loopback",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "native_finish_reason": "stop",
                "message": {
                    "role": "assistant",
                    "content": "A short benchmark answer of a few words.",
                    "reasoning": "Some brief reasoning.",
                },
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32, "cost": 0.000012},
    }
).encode()


EVENTS = 16
_DELTA = (
    b'data: {"id":"gen-bench","model":"bench/model","choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
)
_LAST = (
    b'data: {"id":"gen-bench","model":"bench/model",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":20,"completion_tokens":16,"total_tokens":36}}\n\ndata: [DONE]\n\n'
)


def _serve(latency: float, conn) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not body.get("stream"):
            await asyncio.sleep(latency)
            return web.Response(body=BODY, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(EVENTS):
            await asyncio.sleep(latency / EVENTS)
            await resp.write(_DELTA)
        await resp.write(_LAST)
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "bench/model"}]})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=8192)
        await site.start()
        conn.send(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())


class LoopbackServer:
    def __init__(self, latency: float = 1.0):
        self.latency = latency
        self.proc: mp.Process | None = None
        self.port = 0

    def __enter__(self) -> LoopbackServer:
        parent, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_serve, args=(self.latency, child), daemon=True)
        self.proc.start()
        self.port = parent.recv()
        return self

    def cpu_seconds(self) -> float:
        """CPU time the server process has used so far (to tell a server-bound run from a client-bound
        one)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.join(5)
