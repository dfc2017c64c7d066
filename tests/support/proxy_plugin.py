"""A plugin of proxy.py (the real forward proxy the proxy tests run), loaded in the proxy's own process.

- Names under `.test` resolve to 127.0.0.1 inside the proxy only: the test process cannot resolve them, so an
  answer from such a name proves the request went through the proxy.
- Every request the proxy accepts (a CONNECT, or an absolute-form request it forwards) is appended as one JSON
  line to the file `$EAGLE3_PROXY_RECORD`, before the proxy answers it: once a client has its answer, the line
  is there. Recorded: the scheme of its `Proxy-Authorization` (never the value), and whether any header the
  proxy received holds the string `$EAGLE3_PROXY_WATCH` (an API key that must not reach the proxy).
- Hosts listed (comma-separated) in `$EAGLE3_PROXY_FORBID` are refused with 403, as a proxy's policy refuses
  them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from proxy.http.exception import HttpRequestRejected
from proxy.http.parser import HttpParser
from proxy.http.proxy import HttpProxyBasePlugin


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value or "")


class RecordingPlugin(HttpProxyBasePlugin):
    def resolve_dns(self, host: str, port: int) -> tuple[str | None, Any]:
        if host.endswith(".test"):
            return "127.0.0.1", None
        return None, None

    def before_upstream_connection(self, request: HttpParser) -> HttpParser | None:
        forbidden = {h.strip() for h in os.environ.get("EAGLE3_PROXY_FORBID", "").split(",") if h.strip()}
        if _text(request.host) in forbidden:
            raise HttpRequestRejected(status_code=403, reason=b"Forbidden")
        return request

    def handle_client_request(self, request: HttpParser) -> HttpParser | None:
        watch = os.environ.get("EAGLE3_PROXY_WATCH", "")
        values = [_text(value) for _, value in (request.headers or {}).values()]
        auth = (
            _text(request.header(b"proxy-authorization"))
            if request.has_header(b"proxy-authorization")
            else ""
        )
        record = {
            "method": _text(request.method),
            "host": _text(request.host),
            "port": request.port,
            "path": _text(request.path),
            "auth_scheme": auth.split(" ", 1)[0] or None,
            "watched_seen": bool(watch) and any(watch in v for v in values),
        }
        with open(os.environ["EAGLE3_PROXY_RECORD"], "a") as f:
            f.write(json.dumps(record) + "\n")
        return request
