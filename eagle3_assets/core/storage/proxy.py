"""HTTP proxies from the environment: one decision, here, for every outbound HTTP path of the platform.

The inference clients (aiohttp, and the stream client of `resources/inference/streaming.py`), the urllib calls
(vLLM readiness, pairing probes, acceptance) and the object-store clients all ask this module, so that behind
a corporate proxy they behave alike and as users' other clients do (curl, requests, httpx):

- the variables are read as `urllib.request.getproxies_environment` reads them: `HTTPS_PROXY`, `HTTP_PROXY`,
  `ALL_PROXY` (the fallback for both) and `NO_PROXY`, in any case, the lower-case spelling winning;
- `NO_PROXY` matches as `urllib.request.proxy_bypass_environment` does (a host, or a domain and its
  subdomains, leading dots ignored, `host:port` for one port only, `*` for every host), and also IP addresses
  and CIDR blocks (`10.0.0.0/8`), as requests, curl and Go read them;
- loopback targets (`localhost`, 127.0.0.0/8, ::1) are always reached directly, as Go's net/http decides: a
  proxy elsewhere cannot reach this machine's loopback, and the servers the platform starts for itself (its
  vLLM) or that a user runs beside it (SGLang, vLLM replicas) listen there;
- a proxy is an `http://` proxy (a bare `host:port` too): https targets go through a CONNECT tunnel, http
  targets as absolute-form requests, with `Proxy-Authorization: Basic` when its URL holds `user:password`.

Credentials in a proxy URL never appear in a message: a `Proxy` prints as its address and the variable it came
from. The module lives in the lowest stage of the core so that every layer may ask it.
"""

from __future__ import annotations

import base64
import ipaddress
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit

LOOPBACK_EXCLUDES = ("localhost", "127.0.0.0/8", "::1")  # the same rule, in the form `NO_PROXY` lists take
_DEFAULT_PORTS = {"http": 80, "https": 443}


class ProxyConfigError(ValueError):
    """A proxy variable this platform cannot use (a SOCKS or https:// proxy, an unreadable URL)."""


@dataclass(frozen=True)
class Proxy:
    """An HTTP proxy: its address, the variable that named it and, kept out of every repr, its credentials."""

    host: str
    port: int
    source: str  # the variable it came from, e.g. HTTPS_PROXY
    username: str = field(default="", repr=False)
    password: str = field(default="", repr=False)

    @property
    def url(self) -> str:
        """`http://host:port`, never with credentials."""
        return f"http://{_authority(self.host, self.port)}"

    def __str__(self) -> str:
        return self.url

    def authorization(self) -> str | None:
        """The `Proxy-Authorization` value (Basic), or None without credentials."""
        if not self.username and not self.password:
            return None
        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode("ascii")
        return f"Basic {token}"

    def url_with_credentials(self) -> str:
        """The URL as clients that take credentials in it want it (urllib, the object-store client)."""
        if not self.username and not self.password:
            return self.url
        userinfo = f"{quote(self.username, safe='')}:{quote(self.password, safe='')}"
        return f"http://{userinfo}@{_authority(self.host, self.port)}"


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def target_of(url: str) -> str:
    """`host:port` of `url` (the default port filled in), as a CONNECT names it."""
    parts = urlsplit(url)
    return _authority(parts.hostname or "", parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 80))


def _variable(scheme: str) -> str:
    return f"{scheme.upper()}_PROXY"


def parse_proxy(value: str, source: str) -> Proxy:
    """A proxy variable's value as a `Proxy`; a scheme other than http is refused with the fix."""
    raw = value.strip()
    if "://" not in raw:
        raw = "http://" + raw  # `proxy.corp:3128`, as curl and requests read it
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError:
        raise ProxyConfigError(
            f"{source} is not a proxy URL the platform can read (http://host:port)"
        ) from None
    scheme = parts.scheme.lower()
    if scheme != "http":
        raise ProxyConfigError(
            f"{source} ({scheme}://…) is not an http:// proxy URL; this platform speaks to HTTP proxies only "
            f"(https targets go through them in a CONNECT tunnel): set {source} to the proxy's "
            "http://host:port"
        )
    if not parts.hostname:
        raise ProxyConfigError(f"{source} names no proxy host; set it to http://host:port")
    return Proxy(
        host=parts.hostname,
        port=port or 80,
        source=source,
        username=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
    )


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (IPv4-mapped ones included), as Go's net/http tells them; other names
    are not resolved to find out."""
    name = host.lower().strip("[]").rstrip(".")
    if name == "localhost":
        return True
    ip = _ip(name)
    return ip is not None and ip.is_loopback


def _split_entry(entry: str) -> tuple[str, int | None]:
    """A `NO_PROXY` entry as (host or domain, port or None): `example.com:8080`, `[::1]:80`, `::1`."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        if port.isdigit():
            return host, int(port)
    return entry, None


def bypassed(host: str, port: int | None, no_proxy: str) -> bool:
    """Whether `NO_PROXY` sends `host` (on `port`) around the proxy. Everything
    `urllib.request.proxy_bypass_environment` bypasses is bypassed here too; CIDR blocks and IP addresses in
    any spelling are matched as well."""
    if not no_proxy.strip():
        return False
    host = host.lower().strip("[]").rstrip(".")
    ip = _ip(host)
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        if "/" in entry:
            try:
                network = ipaddress.ip_network(entry.strip("[]"), strict=False)
            except ValueError:
                continue
            if ip is not None and ip.version == network.version and ip in network:
                return True
            continue
        name, entry_port = _split_entry(entry)
        if entry_port is not None and entry_port != port:
            continue
        name = name.lstrip("*").lstrip(".").rstrip(".")
        if not name:
            continue
        if host == name or host.endswith("." + name):
            return True
        entry_ip = _ip(name)
        if ip is not None and entry_ip is not None and ip == entry_ip:
            return True
    return False


class Proxies:
    """The environment's proxy settings, read once (a client reads them when it is made and keeps them, so its
    connection pool never mixes routes), and the route each URL takes."""

    def __init__(self) -> None:
        self._table = urllib.request.getproxies_environment()
        self.no_proxy = self._table.get("no", "")
        self._routes: dict[tuple[str, str, int], Proxy | None] = {}

    def configured(self, scheme: str) -> Proxy | None:
        """The proxy the environment names for `scheme` (http or https), whatever the target."""
        for key in (scheme, "all"):
            value = self._table.get(key)
            if value:
                return parse_proxy(value, _variable(key))
        return None

    def for_url(self, url: str) -> Proxy | None:
        """The proxy a request to `url` goes through, or None for a direct connection."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        host = (parts.hostname or "").lower()
        port = parts.port or _DEFAULT_PORTS.get(scheme, 0)
        key = (scheme, host, port)
        if key in self._routes:
            return self._routes[key]
        proxy = None
        if (
            scheme in _DEFAULT_PORTS
            and host
            and not is_loopback(host)
            and not bypassed(host, port, self.no_proxy)
        ):
            proxy = self.configured(scheme)
        self._routes[key] = proxy
        return proxy


def proxy_for(url: str) -> Proxy | None:
    """The proxy a request to `url` goes through under the current environment, or None."""
    return Proxies().for_url(url)


def urlopen(request: str | urllib.request.Request, timeout: float) -> Any:
    """`urllib.request.urlopen` with the route this module decides (urllib's own would proxy loopback)."""
    url = request if isinstance(request, str) else request.full_url
    proxy = proxy_for(url)
    table = {} if proxy is None else dict.fromkeys(("http", "https"), proxy.url_with_credentials())
    return urllib.request.build_opener(urllib.request.ProxyHandler(table)).open(request, timeout=timeout)


def object_store_options(endpoint: str | None) -> dict[str, str]:
    """`proxy_url` and `proxy_excludes` for an object-store client whose endpoint is `endpoint` (None: the
    provider's own https endpoint), or nothing when the environment names no proxy for its scheme.

    The client (Rust `object_store` over reqwest) would otherwise read the variables itself, without the
    loopback rule; given a proxy it reads none, and `proxy_excludes` carries `NO_PROXY`, the loopback rule
    and, when this module sends the endpoint around the proxy, the endpoint's host, so the store's own
    requests and its credential look-ups (instance metadata, often listed in `NO_PROXY`) route as everything
    else does."""
    scheme = (urlsplit(endpoint).scheme.lower() if endpoint else "") or "https"
    proxies = Proxies()
    proxy = proxies.configured(scheme if scheme in _DEFAULT_PORTS else "https")
    if proxy is None:
        return {}
    excludes = [e.strip() for e in proxies.no_proxy.split(",") if e.strip()]
    excludes += LOOPBACK_EXCLUDES
    if endpoint and proxies.for_url(endpoint) is None:
        host = urlsplit(endpoint).hostname
        if host:
            excludes.append(host)
    return {"proxy_url": proxy.url_with_credentials(), "proxy_excludes": ",".join(dict.fromkeys(excludes))}


def refusal(proxy: Proxy, target: str, status: int, reason: str) -> str:
    """What to tell a user whose proxy answered `status` instead of connecting to `target` (host:port)."""
    if status == 407:
        fix = f"check the user and password in {proxy.source}"
    elif status >= 500:
        fix = "the proxy could not reach it"
    else:
        fix = f"ask for {target} to be allowed, or list it in NO_PROXY if it is reachable directly"
    return f"the proxy {proxy.url} ({proxy.source}) refused {target}: {status} {reason}".rstrip() + f"; {fix}"
