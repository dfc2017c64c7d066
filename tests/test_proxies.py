"""Every HTTP path of the platform behind a real forward proxy: proxy.py on loopback
(tests/support/http_proxy.py), which records each CONNECT and each request it forwards, and resolves names
under `.test` that the test process cannot resolve itself, so an answer from `upstream.test` can only have
come through it.

Paths: the stream client (OpenRouter's default), the aiohttp session (non-streamed answers, preflight), the
urllib calls (vLLM readiness, pairing probes, acceptance) and the object-store client. Rules
(core/storage/proxy.py): HTTPS_PROXY / HTTP_PROXY / ALL_PROXY / NO_PROXY in any case, https through a CONNECT
tunnel, http in absolute form, loopback always direct, a refusing proxy named in a fatal error, its
credentials nowhere.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import ssl
import urllib.request
from types import SimpleNamespace

import aiohttp
import pytest

from eagle3_assets.config import OpenRouterConfig
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.protocol import Completion, CompletionRequest, ErrorKind, InferenceError
from eagle3_assets.core.generation.run import PreflightError, generate_responses
from eagle3_assets.core.storage import proxy as proxies
from eagle3_assets.core.storage.proxy import Proxies, ProxyConfigError, bypassed, is_loopback, proxy_for
from eagle3_assets.core.storage.remote_writes import make_store
from resources.inference.http import HttpSession, get_json, post_json
from resources.inference.openrouter import OpenRouterBackend
from resources.vllm.server import free_port

from .support.engine_runs import dataset, make_plan, shipped_target_tokenizer
from .support.fake_servers import FakeOpenRouter
from .support.http_proxy import PASSWORD, USER, RecordingProxy
from .support.object_store import BUCKET

KEY_ENV, KEY = "EAGLE3_PROXY_TEST_KEY", "sk-proxy-test-key-0123456789"
TOKEN = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()  # what Proxy-Authorization carries


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No proxy variable of the machine's; each test sets its own."""
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("REQUEST_METHOD", raising=False)
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
def hosts(monkeypatch):
    """Names this process resolves to 127.0.0.1, as a hosts file would (the proxy's process does not see
    them)."""
    names: set[str] = set()
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return real("127.0.0.1" if host in names else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return names


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("upstream.test", "forbidden.test").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    ca_file = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return SimpleNamespace(server=server, client=client, ca_file=str(ca_file))


@pytest.fixture(scope="module")
def https_origin(tls):
    server = FakeOpenRouter(key=KEY)
    server.ssl_context = tls.server
    with server:
        yield server


@pytest.fixture(scope="module")
def http_origin():
    with FakeOpenRouter(key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def module_proxy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("proxy")
    with RecordingProxy(folder, f"{USER}:{PASSWORD}", forbid=("forbidden.test",), watch=KEY) as p:
        yield p


@pytest.fixture
def proxy(module_proxy):
    module_proxy.reset()
    return module_proxy


def _loop_runners() -> list:
    """asyncio's loop, and uvloop's, which runs the engine where it is installed."""
    runners = [pytest.param(asyncio.run, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return runners
    return [*runners, pytest.param(uvloop.run, id="uvloop")]


def backend(base_url: str, stream: bool) -> OpenRouterBackend:
    cfg = OpenRouterConfig(
        base_url=base_url, api_key_env=KEY_ENV, stream=stream, reasoning=None, allow_insecure_http=True
    )
    return OpenRouterBackend(cfg, shipped_target_tokenizer())


async def ask(b: OpenRouterBackend, *prompts: str) -> list[Completion]:
    await b.start()
    try:
        return [
            await b.complete(
                CompletionRequest(id=p, messages=[{"role": "user", "content": p}], max_tokens=32)
            )
            for p in prompts
        ]
    finally:
        await b.close()


def answered(completions: list[Completion], *prompts: str) -> bool:
    return [c.content for c in completions] == [f"Answer to: {p}" for p in prompts]


def models_status(url: str) -> int:
    """GET through the urllib path (vLLM's readiness wait, the pairing probe, the acceptance step)."""
    with proxies.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"}), 10) as r:
        return r.status


# -- the rules
# ---------------------------------------------------------------------------------------------------
def test_variables_are_read_in_any_case_the_lower_case_winning_all_proxy_the_fallback(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://upper.corp:3128")
    assert proxy_for("https://api.example.com/v1").host == "upper.corp"
    monkeypatch.setenv("https_proxy", "http://lower.corp:3128")
    assert proxy_for("https://api.example.com/v1").host == "lower.corp"
    assert proxy_for("http://api.example.com/v1") is None  # HTTPS_PROXY is for https targets only
    monkeypatch.setenv("ALL_PROXY", "all.corp:8080")  # no scheme: http, as curl reads it
    p = proxy_for("http://api.example.com/v1")
    assert (p.host, p.port, p.source) == ("all.corp", 8080, "ALL_PROXY")
    monkeypatch.setenv("REQUEST_METHOD", "GET")  # a CGI request: HTTP_PROXY may come from a client's header
    monkeypatch.setenv("HTTP_PROXY", "http://evil.example:80")
    assert proxy_for("http://api.example.com/v1").host == "all.corp"


def test_loopback_is_always_reached_directly(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    for url in (
        "http://127.0.0.1:8000/v1",
        "http://localhost:30000",
        "https://LOCALHOST./x",
        "http://127.8.9.10/",
        "http://[::1]:8000/v1",
        "http://[::ffff:127.0.0.1]:80/",
    ):
        assert proxy_for(url) is None, url
    assert proxy_for("http://10.1.2.3:8000/v1") is not None
    assert proxy_for("https://openrouter.ai/api/v1").url == "http://proxy.corp:3128"
    assert not is_loopback("localhost.example.com") and not is_loopback("128.0.0.1")


NO_PROXY_CASES = [
    # (host, port, NO_PROXY, bypassed)
    ("api.example.com", 443, "example.com", True),
    ("api.example.com", 443, ".example.com", True),
    ("example.com", 443, ".example.com", True),
    ("api.example.com", 443, "*.example.com", True),
    ("notexample.com", 443, "example.com", False),
    ("API.Example.COM", 443, " other.org , EXAMPLE.com ", True),
    ("api.example.com", 8443, "api.example.com:8443", True),
    ("api.example.com", 443, "api.example.com:8443", False),
    ("anything.org", 80, "*", True),
    ("anything.org", 80, "", False),
    ("10.1.2.3", 80, "10.0.0.0/8", True),
    ("11.1.2.3", 80, "10.0.0.0/8", False),
    ("10.1.2.3", 80, "10.1.2.3", True),
    ("fd00::1", 80, "fd00::/8", True),
    ("fd00::1", 80, "[fd00::1]", True),
    ("fd00::1", 80, "[fd00::1]:80", True),
    ("fd00::1", 81, "[fd00::1]:80", False),
    ("api.example.com", 443, "10.0.0.0/8,example.org", False),
]


@pytest.mark.parametrize(("host", "port", "no_proxy", "expected"), NO_PROXY_CASES)
def test_no_proxy_matches_hosts_domains_ports_and_networks(host, port, no_proxy, expected):
    assert bypassed(host, port, no_proxy) is expected
    if not no_proxy:
        return
    # Whatever the standard library bypasses, this module bypasses too (it only adds networks and IP
    # spellings).
    if urllib.request.proxy_bypass_environment(f"{host}:{port}", {"no": no_proxy}):
        assert bypassed(host, port, no_proxy)
    if urllib.request.proxy_bypass_environment(host, {"no": no_proxy}):
        assert bypassed(host, port, no_proxy)


def test_proxy_urls_that_cannot_be_used_are_refused_with_the_fix_and_without_credentials(monkeypatch):
    monkeypatch.setenv("ALL_PROXY", f"socks5://{USER}:{PASSWORD}@127.0.0.1:1080")
    with pytest.raises(ProxyConfigError) as e:
        proxy_for("https://api.example.com")
    assert "ALL_PROXY" in str(e.value) and "http://host:port" in str(e.value) and PASSWORD not in str(e.value)
    monkeypatch.setenv("HTTPS_PROXY", f"https://{USER}:{PASSWORD}@proxy.corp:443")
    with pytest.raises(ProxyConfigError, match="HTTPS_PROXY") as e:
        proxy_for("https://api.example.com")
    assert PASSWORD not in str(e.value)
    # The backend's preflight says so before anything is sent.
    problems = asyncio.run(backend("https://api.example.com/api/v1", True).preflight())
    assert len(problems) == 1 and "HTTPS_PROXY (https://…) is not an http:// proxy URL" in problems[0]
    assert PASSWORD not in problems[0]
    monkeypatch.setenv("HTTPS_PROXY", "http://us%40er:p%3Ass@proxy.corp")
    p = proxy_for("https://api.example.com")
    assert (p.username, p.password, p.port) == ("us@er", "p:ss", 80)
    assert p.authorization() == "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert "p:ss" not in repr(p) and "p:ss" not in str(p) and "p%3Ass" not in repr(p)


def test_the_object_store_client_is_given_the_same_routes(monkeypatch):
    assert proxies.object_store_options("https://s3.example.com") == {}  # no variable: nothing to decide
    monkeypatch.setenv("HTTPS_PROXY", f"http://{USER}:{PASSWORD}@proxy.corp:3128")
    monkeypatch.setenv("no_proxy", "169.254.169.254,.internal")
    opts = proxies.object_store_options(None)
    assert opts["proxy_url"] == f"http://{USER}:{PASSWORD}@proxy.corp:3128"
    assert opts["proxy_excludes"] == "169.254.169.254,.internal,localhost,127.0.0.0/8,::1"
    assert proxies.object_store_options("http://minio.internal:9000") == {}  # HTTP_PROXY is unset
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.corp:3128")
    opts = proxies.object_store_options("http://minio.internal:9000")
    assert opts["proxy_url"] == "http://proxy.corp:3128"
    assert opts["proxy_excludes"].endswith(
        ",minio.internal"
    )  # NO_PROXY sends the endpoint around: said as is


# -- through the real proxy
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("run", _loop_runners())
def test_streamed_answers_reach_an_https_origin_through_one_connect_tunnel(
    proxy, https_origin, tls, run, monkeypatch
):
    """OpenRouter's default path: the stream client, https, HTTPS_PROXY with credentials."""
    monkeypatch.setenv("HTTPS_PROXY", proxy.url_with(USER, PASSWORD))
    # The default context the client makes trusts the test CA.
    monkeypatch.setenv("SSL_CERT_FILE", tls.ca_file)
    port = https_origin.port
    completions = run(ask(backend(f"https://upstream.test:{port}/api/v1", True), "one", "two"))
    assert answered(completions, "one", "two")
    assert completions[1].completion_tokens > 0 and completions[1].cost_usd is not None  # usage came through
    assert proxy.connects() == [f"upstream.test:{port}"]  # one tunnel, kept alive for the second answer
    assert proxy.forwarded() == []
    # The proxy got its own credentials and never the API key, which only the origin sees, inside the tunnel.
    assert all(r["auth_scheme"] == "Basic" and not r["watched_seen"] for r in proxy.records())
    assert {h.headers.get("Authorization") for h in https_origin.hits_for("two")} == {f"Bearer {KEY}"}


def test_aiohttp_reaches_an_https_origin_through_a_connect_tunnel(proxy, https_origin, tls, monkeypatch):
    """The aiohttp path (non-streamed answers, preflight), with credentials on the CONNECT."""
    monkeypatch.setenv("https_proxy", proxy.url_with(USER, PASSWORD))
    base = f"https://upstream.test:{https_origin.port}/api/v1"

    async def main():
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls.client))
        async with HttpSession(client, Proxies(), {"Authorization": f"Bearer {KEY}"}) as session:
            status, models = await get_json(session, f"{base}/models")
            body = await post_json(
                session,
                f"{base}/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "three"}], "max_tokens": 8},
            )
        return status, models, body

    status, models, body = asyncio.run(main())
    assert status == 200 and models["data"]
    assert body["choices"][0]["message"]["content"] == "Answer to: three"
    assert proxy.connects() and set(proxy.connects()) == {f"upstream.test:{https_origin.port}"}
    assert all(r["auth_scheme"] == "Basic" and not r["watched_seen"] for r in proxy.records())


@pytest.mark.parametrize("run", _loop_runners())
@pytest.mark.parametrize("stream", [True, False], ids=["stream-client", "aiohttp"])
def test_http_origins_get_absolute_form_requests_through_http_proxy(
    proxy, http_origin, stream, run, monkeypatch
):
    monkeypatch.setenv("http_proxy", proxy.url_with(USER, PASSWORD))  # lower case, as many shells set it
    port = http_origin.port
    completions = run(ask(backend(f"http://upstream.test:{port}/api/v1", stream), "four", "five"))
    assert answered(completions, "four", "five")
    assert proxy.connects() == []
    assert proxy.forwarded() == [f"POST http://upstream.test:{port}/api/v1/chat/completions"] * 2
    assert all(r["auth_scheme"] == "Basic" for r in proxy.records())


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("NO_PROXY", "direct.test"),
        ("no_proxy", ".test"),
        ("NO_PROXY", "other.org, *"),
        ("no_proxy", "{host}:{port}"),
    ],
)
def test_no_proxy_sends_a_host_around_the_proxy(proxy, http_origin, hosts, variable, value, monkeypatch):
    hosts.add("direct.test")
    port = http_origin.port
    monkeypatch.setenv("HTTP_PROXY", proxy.url_with(USER, PASSWORD))
    monkeypatch.setenv("https_proxy", proxy.url_with(USER, PASSWORD))
    monkeypatch.setenv(variable, value.format(host="direct.test", port=port))
    base = f"http://direct.test:{port}/api/v1"
    assert answered(asyncio.run(ask(backend(base, True), "six")), "six")
    assert answered(asyncio.run(ask(backend(base, False), "seven")), "seven")
    assert models_status(f"{base}/models") == 200
    assert proxy.records() == []  # the proxy saw nothing
    monkeypatch.delenv(variable)  # the same requests without NO_PROXY: all three through the proxy
    assert answered(asyncio.run(ask(backend(base, True), "eight")), "eight")
    assert answered(asyncio.run(ask(backend(base, False), "nine")), "nine")
    assert models_status(f"{base}/models") == 200
    assert proxy.forwarded() == [
        f"POST {base}/chat/completions",
        f"POST {base}/chat/completions",
        f"GET {base}/models",
    ]


def test_urllib_paths_go_through_the_proxy_and_loopback_around_it(proxy, http_origin, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", proxy.url_with(USER, PASSWORD))
    for host in ("upstream.test", "127.0.0.1"):  # the second: a server the platform started itself
        assert models_status(f"http://{host}:{http_origin.port}/api/v1/models") == 200
    assert proxy.forwarded() == [f"GET http://upstream.test:{http_origin.port}/api/v1/models"]


def test_object_store_requests_go_through_the_proxy_and_loopback_around_it(
    proxy, s3_server, aws_env, monkeypatch
):
    import obstore as obs

    monkeypatch.setenv("HTTP_PROXY", proxy.url_with(USER, PASSWORD))
    moto_port = s3_server.rsplit(":", 1)[1]
    # moto reads a dotted host as a virtual-hosted bucket: name the bucket in it
    proxied = f"http://{BUCKET}.test:{moto_port}"
    for endpoint in (proxied, s3_server):
        store = make_store(f"s3://{BUCKET}/proxied", {"endpoint": endpoint, "region": "us-east-1"})
        obs.put(store, "k.txt", b"through")
        assert bytes(obs.get(store, "k.txt").bytes()) == b"through"
    seen = proxy.forwarded()
    assert seen and all(line.split()[1].startswith(f"{proxied}/") for line in seen)
    assert {line.split()[0] for line in seen} >= {"PUT", "GET"}
    assert all(r["auth_scheme"] == "Basic" for r in proxy.records())


# -- refusals and credentials
# ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("scheme", "stream", "host", "password", "status"),
    [
        ("https", True, "upstream.test", "wrong-password", 407),
        ("https", False, "upstream.test", "wrong-password", 407),
        ("http", True, "upstream.test", "wrong-password", 407),
        ("http", False, "upstream.test", "wrong-password", 407),
        ("https", True, "forbidden.test", PASSWORD, 403),
        ("https", False, "forbidden.test", PASSWORD, 403),
    ],
    ids=[
        "407-https-stream",
        "407-https-aiohttp",
        "407-http-stream",
        "407-http-aiohttp",
        "403-stream",
        "403-aiohttp",
    ],
)
def test_a_refusing_proxy_is_named_and_stops_the_run(
    proxy, https_origin, http_origin, scheme, stream, host, password, status, monkeypatch, caplog
):
    caplog.set_level(logging.DEBUG)
    variable = f"{scheme.upper()}_PROXY"
    monkeypatch.setenv(variable, proxy.url_with(USER, password))
    port = (https_origin if scheme == "https" else http_origin).port
    with pytest.raises(InferenceError) as e:
        asyncio.run(ask(backend(f"{scheme}://{host}:{port}/api/v1", stream), "ten"))
    error = e.value
    assert error.kind is ErrorKind.PROXY and error.kind.fatal and error.status == status
    message = str(error)
    assert f"the proxy {proxy.url} ({variable}) refused {host}:{port}: {status}" in message
    assert ("user and password" in message) == (status == 407)
    secret_forms = (password, base64.b64encode(f"{USER}:{password}".encode()).decode())
    assert not any(s in message or s in caplog.text for s in secret_forms)
    assert proxy.records() == []  # nothing went past the proxy


def test_a_run_behind_a_refusing_proxy_fails_at_preflight_naming_it(
    proxy, https_origin, chat, tmp_path, monkeypatch
):
    monkeypatch.setenv("HTTPS_PROXY", proxy.url_with(USER, "wrong-password"))
    layout = dataset(tmp_path, ["fourteen", "fifteen"])
    b = backend(f"https://upstream.test:{https_origin.port}/api/v1", True)
    settings = EngineSettings(max_concurrency=2)
    with pytest.raises(PreflightError) as e:
        generate_responses(layout, make_plan("B1", 32, 10_000), b, chat, settings, log=lambda m: None)
    message = str(e.value)
    assert f"the proxy {proxy.url} (HTTPS_PROXY) refused upstream.test:{https_origin.port}: 407" in message
    assert "wrong-password" not in message
    assert https_origin.hits_for("fourteen") == []


def test_an_unreachable_proxy_is_a_retried_connection_fault_that_names_it(monkeypatch):
    port = free_port()
    monkeypatch.setenv("HTTPS_PROXY", f"http://{USER}:{PASSWORD}@127.0.0.1:{port}")
    for stream in (True, False):
        with pytest.raises(InferenceError) as e:
            asyncio.run(ask(backend("https://upstream.test/api/v1", stream), "eleven"))
        assert e.value.kind is ErrorKind.CONNECTION and e.value.kind.retryable
        assert f"http://127.0.0.1:{port}" in str(e.value) and PASSWORD not in str(e.value)


def test_credentials_never_reach_logs_errors_or_output(proxy, https_origin, tls, monkeypatch, caplog, capsys):
    """One answer through the proxy and one refusal, everything logged at DEBUG: the password and its Basic
    token appear nowhere but on the wire to the proxy."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("PYTHONASYNCIODEBUG", "1")
    monkeypatch.setenv("SSL_CERT_FILE", tls.ca_file)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url_with(USER, PASSWORD))
    base = f"https://upstream.test:{https_origin.port}/api/v1"
    assert answered(asyncio.run(ask(backend(base, True), "twelve")), "twelve")
    with pytest.raises(InferenceError) as e:
        asyncio.run(ask(backend(base.replace("upstream", "forbidden"), True), "thirteen"))
    configured = Proxies().configured("https")
    shown = [
        caplog.text,
        str(e.value),
        repr(e.value),
        repr(configured),
        str(configured),
        *capsys.readouterr(),
    ]
    assert proxy.url in str(e.value)
    for text in shown:
        assert PASSWORD not in text and TOKEN not in text
