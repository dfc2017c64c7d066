"""Real HTTP servers on loopback for the engine tests: an OpenRouter-like API that injects faults on command,
and an SGLang-like native `/generate` server. Each runs its own event loop in a thread of the test process, so
it outlives a client subprocess that a test kills with SIGKILL.

Faults are scripted per prompt: the last user message may contain `[[fault1,fault2,...]]`; attempt n of that
prompt gets fault n (then plain answers). Fault words: 429, 429ra=<s>, 503, 503ra=<s>, 500, 502, 408, 400, ctx
(400 context length), 401, 402, 402ra=<s>, body429 / body502 (error object in a 200 body), reset (connection
dropped), malformed, empty (empty 200 body), finisherror, nochoices, slow=<s>, echokey (400 echoing the
headers), and for streamed requests midstream429 / midstream502 (an error event after the stream started),
429window=<s> (a key-wide window closed for <s> seconds), cutstream (the connection closes mid-answer),
nousage (no usage in the answer). `global_faults` applies a list to the first requests of any prompt (a
storm). Requests with `stream: true` are answered as server-sent events, a word per chunk.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import ssl
import threading
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from aiohttp import web

FAULTS = re.compile(r"\[\[([^\]]*)\]\]")


@dataclass
class Hit:
    prompt: str
    at: float
    attempt: int
    fault: str | None
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)


class _ThreadedApp:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.ssl_context: ssl.SSLContext | None = None  # set before start to serve https

    def _app(self) -> web.Application:
        raise NotImplementedError

    def start(self) -> str:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self.base_url

    async def _start(self) -> None:
        self.runner = web.AppRunner(self._app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, backlog=4096, ssl_context=self.ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


class FakeOpenRouter(_ThreadedApp):
    def __init__(
        self,
        key: str | None = None,
        latency: float = 0.0,
        model: str = "moonshotai/kimi-k2.5",
        global_faults: list[str] | None = None,
        completion_tokens: Any = None,
        cost_per_token: float = 1e-6,
        list_models: bool = True,
        fail_after: tuple[int, str] | None = None,
        answer_text: Any = None,
        answer_message: Any = None,
    ):
        super().__init__()
        self.key = key
        # callable(prompt, body) -> the answer's message ({content, tool_calls}) and finish reason, or None
        # for the usual text answer: an agentic provider's answers (calls streamed as OpenAI streams them)
        self.answer_message = answer_message
        # callable(prompt) -> the answer's text (None: "Answer to: <prompt>"); a lying provider's answers
        self.answer_text = answer_text
        self.stream_bytes = 0  # bytes of streamed answers written to clients that read them
        self.latency = latency
        self.model = model
        self.global_faults = list(global_faults or [])
        self.completion_tokens = (
            completion_tokens  # None: words of the answer; int; or callable(prompt) -> int
        )
        self.cost_per_token = cost_per_token
        self.list_models = list_models
        self.fail_after = (
            fail_after  # (n, fault): every request after the n-th gets this fault (a routing change)
        )
        self.hits: list[Hit] = []
        self.attempts: dict[str, int] = defaultdict(int)
        self._global = 0
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1"

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/api/v1/chat/completions", self.chat)
        app.router.add_get("/api/v1/models", self.models)
        app.router.add_get("/api/v1/key", self.key_info)
        return app

    # -- introspection for tests
    # -------------------------------------------------------------------------------
    def prompts_sent(self) -> list[str]:
        with self.lock:
            return [h.prompt for h in self.hits]

    def hits_for(self, prompt_part: str) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if prompt_part in h.prompt]

    # -- endpoints
    # ----------------------------------------------------------------------------------------------
    def _authorised(self, request: web.Request) -> bool:
        return self.key is None or request.headers.get("Authorization") == f"Bearer {self.key}"

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response(
                {"error": {"code": 401, "message": "No auth credentials found"}}, status=401
            )
        data = [{"id": self.model}, {"id": "openai/gpt-4o"}] if self.list_models else []
        return web.json_response({"data": data})

    async def key_info(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": {"code": 401, "message": "bad key"}}, status=401)
        return web.json_response({"data": {"limit": 100, "limit_remaining": 50, "usage": 50}})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        with self.lock:
            self.attempts[prompt] += 1
            attempt = self.attempts[prompt]
            scripted = FAULTS.search(prompt)
            faults = scripted.group(1).split(",") if scripted else []
            fault = faults[attempt - 1].strip() if attempt <= len(faults) else None
            if self.fail_after is not None and len(self.hits) >= self.fail_after[0]:
                fault = self.fail_after[1]
            if fault is None and self._global < len(self.global_faults):
                fault = self.global_faults[self._global]
                self._global += 1
            self.hits.append(Hit(prompt, time.monotonic(), attempt, fault, dict(request.headers), body))
        if self.latency:
            await asyncio.sleep(self.latency)
        if not self._authorised(request):
            return web.json_response({"error": {"code": 401, "message": "User not found."}}, status=401)
        if fault:
            response = await self._fault(request, fault)
            if response is not None:
                return response
        answer = self._answer(prompt, body)
        if fault == "nousage":
            answer.pop("usage")
        if body.get("stream"):
            return await self._stream(request, answer, fault)
        return web.json_response(answer)

    async def _stream(self, request: web.Request, answer: dict, fault: str | None) -> web.StreamResponse:
        """The answer as OpenRouter streams it: deltas of reasoning then content, usage in the last chunk."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        choice = answer["choices"][0]
        head = {"id": answer["id"], "model": answer["model"], "provider": answer["provider"]}

        async def send(delta: dict, **extra: Any) -> None:
            event = {**head, "choices": [{"index": 0, "delta": delta, **extra.pop("choice", {})}], **extra}
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            await resp.write(data)
            with self.lock:
                self.stream_bytes += len(data)

        await resp.write(b": OPENROUTER PROCESSING\n\n")
        await send({"role": "assistant", "content": ""})
        words: list[tuple[str, str]] = []
        if choice["message"].get("reasoning"):
            words += [("reasoning", w) for w in re.findall(r"\S+\s*", choice["message"]["reasoning"])]
        words += [("content", w) for w in re.findall(r"\S+\s*", choice["message"]["content"] or "")]
        for i, (field_name, word) in enumerate(words):
            if i == len(words) // 2 and fault in ("midstream429", "midstream502", "cutstream"):
                if fault == "cutstream":
                    request.transport.close()
                    return resp
                code = int(fault[-3:])
                await send(
                    {},
                    error={"code": code, "message": "Provider error mid-stream"},
                    choice={"finish_reason": "error"},
                )
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await send({field_name: word})
        for j, call in enumerate(choice["message"].get("tool_calls") or []):
            # As OpenAI streams a call: its id and name first, then its arguments' text in small pieces.
            fn = call["function"]
            head_delta = {"index": j, "id": call["id"], "type": "function", "function": {"name": fn["name"]}}
            await send(
                {"tool_calls": [{**head_delta, "function": {**head_delta["function"], "arguments": ""}}]}
            )
            args = fn["arguments"]
            for at in range(0, len(args), 5):
                await send({"tool_calls": [{"index": j, "function": {"arguments": args[at : at + 5]}}]})
        extra = {"usage": answer["usage"]} if "usage" in answer else {}
        await send(
            {}, choice={"finish_reason": choice["finish_reason"], "native_finish_reason": "stop"}, **extra
        )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _answer(self, prompt: str, body: dict) -> dict:
        clean = FAULTS.sub("", prompt).strip()
        scripted = self.answer_message(clean, body) if self.answer_message is not None else None
        if scripted is not None:
            message, finish = scripted
            answer = self._answer_with(prompt, clean, body, message.get("content"))
            answer["choices"][0]["message"].update(message)
            answer["choices"][0]["finish_reason"] = finish
            return answer
        return self._answer_with(prompt, clean, body, None)

    def _answer_with(self, prompt: str, clean: str, body: dict, scripted: str | None) -> dict:
        if scripted is not None or self.answer_message is not None:
            content = scripted or ""
        else:
            content = self.answer_text(clean) if self.answer_text is not None else f"Answer to: {clean}"
        if callable(self.completion_tokens):
            tokens = int(self.completion_tokens(clean))
        elif self.completion_tokens is not None:
            tokens = int(self.completion_tokens)
        else:
            tokens = len(content.split()) + 3
        return {
            "id": f"gen-{zlib.crc32(prompt.encode()) % 10**9}",  # the same for a prompt in every run
            "model": self.model,
            "provider": "FakeProvider",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "native_finish_reason": "stop",
                    "message": {
                        "role": "assistant",
                        "content": content,
                        "reasoning": f"Thinking about {clean}" if body.get("reasoning") else None,
                    },
                }
            ],
            "usage": {
                "prompt_tokens": 11,
                "completion_tokens": tokens,
                "total_tokens": 11 + tokens,
                "cost": round(tokens * self.cost_per_token, 10),
                "completion_tokens_details": {"reasoning_tokens": 3},
            },
        }

    async def _fault(self, request: web.Request, fault: str) -> web.StreamResponse | None:
        name, _, arg = fault.partition("=")
        ra = {"Retry-After": arg} if arg else {}
        err = lambda code, msg, status=None, headers=None, **extra: web.json_response(  # noqa: E731
            {"error": {"code": code, "message": msg, **extra}}, status=status or code, headers=headers
        )
        if name in ("429", "429ra"):
            return err(429, "Rate limit exceeded", headers=ra)
        if name == "429window":  # the key's window is closed for everyone until the reset (epoch ms)
            reset = int((time.time() + float(arg)) * 1000)
            headers = {
                "X-RateLimit-Limit": "100",
                "X-RateLimit-Remaining": "0",
                "X-RateLimit-Reset": str(reset),
            }
            return err(429, "Rate limit exceeded: limit_rpm/key", headers=headers)
        if name in ("503", "503ra"):
            return err(503, "No instances available", headers=ra)
        if name in ("500", "502", "408"):
            return err(int(name), f"upstream error {name}")
        if name == "400":
            return err(400, "invalid parameter: temperature")
        if name == "ctx":
            return err(
                400,
                "This endpoint's maximum context length is 8192 tokens",
                metadata={"error_type": "context_length_exceeded"},
            )
        if name == "echokey":  # a careless server that echoes the request headers in its error
            return err(400, f"bad request with headers {dict(request.headers)}")
        if (
            name == "echokeyforms"
        ):  # ... and echoes it URL-encoded and as JSON unicode escapes (valid JSON for it)
            key = request.headers.get("Authorization", "").removeprefix("Bearer ")
            escaped = "".join(f"\\u{ord(c):04x}" for c in key)
            raw = '{{"error": {{"code": 400, "message": "bad request from ?key={} or {}"}}}}'.format(
                quote(key, safe=""),
                escaped,
            )
            return web.Response(status=400, body=raw.encode(), content_type="application/json")
        if name == "404":
            return err(404, "No endpoints found for moonshotai/kimi-k2.5 matching your routing")
        if name == "401":
            return err(401, "User not found.")
        if name in ("402", "402ra"):
            return err(402, "Insufficient credits", headers=ra)
        if name.startswith("body"):
            code = int(name[4:])
            return err(code, "Provider returned error", status=200)
        if name == "reset":
            request.transport.close()
            return web.Response(status=500)
        if name == "malformed":
            return web.Response(status=200, body=b'{"choices": [', content_type="application/json")
        if name == "empty":
            return web.Response(status=200, body=b"", content_type="application/json")
        if name == "finisherror":
            return web.json_response(
                {
                    "id": "gen-x",
                    "model": self.model,
                    "choices": [{"finish_reason": "error", "message": {"role": "assistant", "content": ""}}],
                    "usage": {},
                }
            )
        if name == "nochoices":
            return web.json_response({"id": "gen-x", "model": self.model, "choices": []})
        if name == "slow":
            await asyncio.sleep(float(arg))
            return None
        if name in ("midstream429", "midstream502", "cutstream", "nousage"):
            return None  # handled while answering
        raise ValueError(f"unknown fault {fault!r}")


class FakeSGLang(_ThreadedApp):
    """Native SGLang API over a real tokenizer: answers "Echo <n tokens>" and returns its output ids."""

    def __init__(
        self,
        tokenizer: Any,
        eot_id: int,
        fail_first: int = 0,
        model_path: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    ):
        super().__init__()
        self.tok = tokenizer
        self.eot_id = eot_id
        self.fail_first = fail_first
        self.model_path = model_path
        self.generate_bodies: list[dict] = []
        self.calls: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_post("/generate", self.generate)
        return app

    async def health(self, request: web.Request) -> web.Response:
        self.calls.append("health")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        self.calls.append("model_info")
        return web.json_response(
            {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True}
        )

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append("generate")
        self.generate_bodies.append(body)
        if len(self.generate_bodies) <= self.fail_first:
            return web.json_response({"error": {"message": "scheduler overloaded"}}, status=503)
        params = body["sampling_params"]
        if "max_new_tokens" not in params:
            return web.json_response({"error": {"message": "max_new_tokens missing"}}, status=400)
        n_in = len(body["input_ids"])
        text = f"Echo of {n_in} tokens: the answer is 42.\n\n1. first\n2. second"
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        limit = params["max_new_tokens"]
        if len(ids) + 1 <= limit:
            out, finish = [*ids, self.eot_id], {"type": "stop", "matched": self.eot_id}
        else:
            out, finish = ids[:limit], {"type": "length", "length": limit}
        return web.json_response(
            {
                "text": self.tok.decode(out, skip_special_tokens=True),
                "output_ids": out,
                "meta_info": {
                    "id": f"req-{len(self.generate_bodies)}",
                    "finish_reason": finish,
                    "prompt_tokens": n_in,
                    "completion_tokens": len(out),
                    "cached_tokens": 0,
                    "e2e_latency": 0.01,
                },
            }
        )


def dump_hits(server: FakeOpenRouter) -> str:
    return json.dumps([(h.prompt[:40], h.attempt, h.fault) for h in server.hits], indent=1)


# Faults a busy provider sends whatever the load (the words of `[[...]]` above), in the mix a bad day brings.
FIRST_ATTEMPT_FAULTS = (
    "429",
    "429",
    "429ra=0.5",
    "429ra=1",
    "500",
    "502",
    "503",
    "reset",
    "body429",
    "body502",
    "malformed",
)


def scripted_fault_prompts(n: int, share: float, seed: int, prefix: str = "q") -> list[str]:
    """`n` prompt texts; a `share` of them carry one to three of FIRST_ATTEMPT_FAULTS on their first
    attempts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < share:
            faults = ",".join(rng.choice(FIRST_ATTEMPT_FAULTS) for _ in range(rng.randint(1, 3)))
            out.append(f"{prefix} {i} [[{faults}]]")
        else:
            out.append(f"{prefix} {i}")
    return out
