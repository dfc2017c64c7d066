"""One streamed HTTP answer, parsed: the response head (status, headers) and its server-sent `data:`
events, taken in batches (one orjson call per batch of events, not one per event: `streaming` says why that
matters)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from eagle3_assets.core.generation.protocol import ErrorKind, InferenceError, describe

from .http import loads, redact

# One event's most bytes: a stream whose event runs past this is cut (memory stays bounded whatever a server
# sends; real events are a token or a few, and a whole long answer in one event is far below it).
MAX_EVENT_BYTES = 32 * 1024 * 1024

# Called with each batch of a stream's events, in order (it may raise a classified error to end the stream).
OnEvents = Callable[[list[dict], Mapping[str, str]], None]


class Headers(dict):
    """Response headers, looked up without regard to case (`Retry-After`, `X-RateLimit-Reset`)."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)

    def __getitem__(self, key: str) -> Any:
        return super().__getitem__(key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(key.lower())


class Response:
    """The parser's view of one response: its head, its payload so far (the framing already undone), its
    end."""

    __slots__ = (
        "close_delimited",
        "complete",
        "error",
        "headers",
        "keep_alive",
        "on_body",
        "on_headers_complete",
        "parts",
    )

    def __init__(self, on_head: Callable[[], None]) -> None:
        self.on_headers_complete = on_head  # httptools looks its callbacks up once, when the parser is made
        self.headers = Headers()
        self.parts: list[bytes] = []
        # The C parser appends each piece of payload: no Python frame per chunk.
        self.on_body = self.parts.append
        self.complete = False  # the body ended: its last chunk, its Content-Length, or the close that ends it
        self.close_delimited = False  # neither chunked nor sized: the body ends when the connection does
        self.keep_alive = False
        self.error: BaseException | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_message_complete(self) -> None:
        self.complete = True

    def take(self) -> bytes:
        parts = self.parts
        if not parts:
            return b""
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return out


class EventBatches:
    """The `data:` events of one streamed body: decoded in batches, handed on in order, `[DONE]` noticed."""

    __slots__ = ("collect", "done", "error", "finished", "headers", "on_events", "pending", "secrets")

    def __init__(self, headers: Headers, on_events: OnEvents, secrets: tuple[bytes, ...]):
        self.headers = headers
        self.on_events = on_events
        self.secrets = secrets
        self.pending = b""  # payload after the last complete line
        self.done = False  # saw `data: [DONE]`
        self.finished: asyncio.Future | None = None
        self.error: BaseException | None = None
        self.collect: bytearray | None = (
            None  # an error status: the body is kept whole, not decoded as events
        )

    def feed(self, payload: bytes, final: bool = False) -> None:
        """Decode the complete lines of what has arrived (all of it when `final`) and hand their events on."""
        buf = self.pending + payload if self.pending else payload
        if final:
            cut = len(buf)
        else:
            cut = buf.rfind(b"\n\n") + 2  # whole events, so the common case below applies
            if cut == 1:
                cut = buf.rfind(b"\n") + 1  # no blank line yet (or `\r\n` line ends): complete lines
                if cut == 0:
                    if len(buf) > MAX_EVENT_BYTES:
                        raise InferenceError(
                            ErrorKind.MALFORMED,
                            f"an event passed {MAX_EVENT_BYTES:,} bytes without ending; not read on",
                            status=200,
                        )
                    self.pending = buf
                    return
        text, self.pending = buf[:cut], buf[cut:]
        if self.secrets:
            text = redact(text, self.secrets)
        events = self._common(text)
        if events is None:
            events = self._lines(text)
        if events:
            self.on_events(events, self.headers)

    def _common(self, text: bytes) -> list[dict] | None:
        """Events as providers send them, `data: <json>` and a blank line each (the last may be `[DONE]`): one
        orjson call for the batch. A JSON text holds no raw newline, so a separator cannot occur inside an
        event, and anything else between events (a comment, another field, a `data:` line on its own) leaves
        the batch unparsable: None, and it is read line by line, which names what is wrong. Stray whitespace
        (`\r`) is whitespace to JSON as it is to `strip`, so both paths read the same events."""
        if not (text.startswith(b"data: ") and text.endswith(b"\n\n")):
            return None
        body, done = text[6:-2], False
        if body.endswith(b"[DONE]"):
            if body == b"[DONE]":
                self.done = True
                return []
            if not body.endswith(b"\n\ndata: [DONE]"):
                return None
            body, done = body[:-14], True
        try:
            events = loads(b"[%b]" % body.replace(b"\n\ndata: ", b","))
        except ValueError:
            return None
        self.done = self.done or done
        return [e for e in events if type(e) is dict]

    def _lines(self, text: bytes) -> list[dict]:
        """Line by line: blank separators, `: keep-alive` comments, `event:`/`id:` fields, `[DONE]`."""
        events = []
        for line in text.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                break
            if not data:
                continue
            try:
                event = loads(data)
            except ValueError:
                raise InferenceError(
                    ErrorKind.MALFORMED,
                    f"unparsable stream event: {describe(data.decode('utf-8', 'replace'))}",
                    status=200,
                ) from None
            if isinstance(event, dict):
                events.append(event)
        return events
