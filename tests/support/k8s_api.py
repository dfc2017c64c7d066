"""A recording Kubernetes API server on loopback: the one stand-in of the Kubernetes tests.

No control plane can run on this machine, so the kubernetes Python client that dagster-k8s drives talks to
this server instead, through an ordinary kubeconfig file (`kubeconfig()`). It serves the REST paths and JSON
shapes of the real API for the resources the deployment touches: core/v1 pods, configmaps, secrets,
persistentvolumeclaims, serviceaccounts and services, batch/v1 jobs and apps/v1 deployments. Per resource:
create (POST, 201 with the stored object: uid, resourceVersion, creationTimestamp, namespace; 409
AlreadyExists), read (GET, also the `/status` subresource; 404 NotFound), list (GET with an equality
`labelSelector`) and delete (DELETE, a Success Status). Errors are `Status` objects with the real reasons and
codes; a request without the kubeconfig's bearer token gets 401; a path it does not serve gets a 404 and is
recorded, so a test can assert that the launcher asked for nothing unexpected.

Writes are validated as the API server validates them (`pod_spec_problems`: a subset of its pod-spec
validation, the rules a deployment file can break: unique volume names, every mount naming a volume, unique
mount paths, quantities that parse, requests within limits, extended resources such as `nvidia.com/gpu` whole
and with requests equal to limits, a Job's restart policy and name length) and answered 422 Invalid when they
fail. What the API server admits but a pod would still fail on later (a volume's config map, claim or secret
that does not exist, a missing service account) is what `missing_references` lists. No controller runs: a
created Job has no pods and an empty status, as in the moment after a real API server accepted it.

Every request is kept (`requests`), and every object a client created (`created`), in order.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

TOKEN = "recording-api-server-token"


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    kind: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


RESOURCES = (
    Resource("", "v1", "Pod", "pods"),
    Resource("", "v1", "ConfigMap", "configmaps"),
    Resource("", "v1", "Secret", "secrets"),
    Resource("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
    Resource("", "v1", "ServiceAccount", "serviceaccounts"),
    Resource("", "v1", "Service", "services"),
    Resource("batch", "v1", "Job", "jobs"),
    Resource("apps", "v1", "Deployment", "deployments"),
)
BY_KIND = {r.kind: r for r in RESOURCES}
_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[a-z0-9.-]+)/(?P<version>v[0-9a-z]+))"
    r"/namespaces/(?P<ns>[a-z0-9-]+)/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>status))?)?$"
)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    status: int


@dataclass
class Store:
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # (kind, namespace, name)
    created: list[dict] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "details": details or {},
        "code": code,
    }


# -- the API server's validation (a subset of k8s.io/kubernetes/pkg/apis/core/validation) -------------------
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+)?$")
_SUFFIX = {
    "m": Decimal("0.001"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_VOLUME_SOURCES = (
    "configMap",
    "secret",
    "persistentVolumeClaim",
    "emptyDir",
    "hostPath",
    "projected",
    "downwardAPI",
    "nfs",
    "csi",
    "ephemeral",
)


def quantity(value: object) -> Decimal | None:
    """A resource quantity's value, or None where the API server would refuse it."""
    match = _QUANTITY.match(str(value))
    if not match:
        return None
    try:
        number = Decimal(match.group(1))
    except ArithmeticError:
        return None
    suffix = match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** int(suffix[1:])
    return number * _SUFFIX.get(suffix, Decimal(1))


def _is_extended(resource: str) -> bool:
    """Extended resources (`nvidia.com/gpu`) are the domain-qualified names outside kubernetes.io."""
    return "/" in resource and not resource.split("/", 1)[0].endswith("kubernetes.io")


def _resource_problems(where: str, resources: dict) -> list[str]:
    problems = []
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    for part, values in (("requests", requests), ("limits", limits)):
        for name, value in values.items():
            amount = quantity(value)
            if amount is None:
                problems.append(f"{where}.resources.{part}[{name}]: Invalid value: {value!r}")
            elif _is_extended(name) and amount != amount.to_integral_value():
                problems.append(f"{where}.resources.{part}[{name}]: must be an integer")
    for name, value in requests.items():
        if _is_extended(name):
            if name not in limits:
                problems.append(f"{where}.resources.limits: Required value: Limit must be set for {name}")
            elif quantity(value) != quantity(limits[name]):
                problems.append(f"{where}.resources.requests[{name}]: must be equal to {name} limit")
        elif name in limits and (quantity(value) or 0) > (quantity(limits[name]) or 0):
            problems.append(f"{where}.resources.requests[{name}]: must be less than or equal to {name} limit")
    return problems


def pod_spec_problems(spec: dict, where: str) -> list[str]:
    """What the API server refuses in a pod spec."""
    problems = []
    volumes = [v.get("name", "") for v in spec.get("volumes") or []]
    for i, volume in enumerate(spec.get("volumes") or []):
        name = volume.get("name", "")
        if not _DNS_LABEL.fullmatch(name) or len(name) > 63:
            problems.append(f"{where}.volumes[{i}].name: Invalid value: {name!r}")
        if volumes.count(name) > 1:
            problems.append(f"{where}.volumes[{i}].name: Duplicate value: {name!r}")
        sources = [k for k in volume if k in _VOLUME_SOURCES]
        if len(sources) != 1:
            problems.append(f"{where}.volumes[{i}]: must specify exactly 1 volume type, not {sources}")
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    if not spec.get("containers"):
        problems.append(f"{where}.containers: Required value")
    names = [c.get("name") for c in containers]
    for i, container in enumerate(containers):
        at = f"{where}.containers[{i}]"
        if names.count(container.get("name")) > 1:
            problems.append(f"{at}.name: Duplicate value: {container.get('name')!r}")
        if not container.get("image"):
            problems.append(f"{at}.image: Required value")
        paths = [m.get("mountPath") for m in container.get("volumeMounts") or []]
        for j, mount in enumerate(container.get("volumeMounts") or []):
            if mount.get("name") not in volumes:
                problems.append(f"{at}.volumeMounts[{j}].name: Not found: {mount.get('name')!r}")
            if paths.count(mount.get("mountPath")) > 1:
                problems.append(f"{at}.volumeMounts[{j}].mountPath: must be unique")
        for j, env in enumerate(container.get("env") or []):
            if not _ENV_NAME.fullmatch(env.get("name", "")):
                problems.append(f"{at}.env[{j}].name: Invalid value: {env.get('name')!r}")
        problems += _resource_problems(at, container.get("resources") or {})
    return problems


def object_problems(obj: dict) -> list[str]:
    """Validation of a created object by kind: names, and the pod template of Jobs and Deployments."""
    kind = obj.get("kind")
    name = (obj.get("metadata") or {}).get("name", "")
    problems = []
    if not _DNS_SUBDOMAIN.fullmatch(name) or len(name) > 253:
        problems.append(f"metadata.name: Invalid value: {name!r}")
    if kind == "Job":
        if len(name) > 63:  # the controller labels its pods job-name=<name>: a label value
            problems.append(f"metadata.name: Invalid value: {name!r}: must be no more than 63 characters")
        spec = (obj.get("spec") or {}).get("template", {}).get("spec") or {}
        if spec.get("restartPolicy") not in ("Never", "OnFailure"):
            problems.append(
                f"spec.template.spec.restartPolicy: Unsupported value: {spec.get('restartPolicy')!r}"
            )
        problems += pod_spec_problems(spec, "spec.template.spec")
    if kind == "Deployment":
        problems += pod_spec_problems(obj["spec"]["template"]["spec"], "spec.template.spec")
    if kind == "Pod":
        problems += pod_spec_problems(obj.get("spec") or {}, "spec")
    return problems


def pod_spec_of(obj: dict) -> dict | None:
    if obj.get("kind") in ("Job", "Deployment"):
        return obj["spec"]["template"]["spec"]
    if obj.get("kind") == "Pod":
        return obj["spec"]
    return None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reads `requests`
        return

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
        code, answer = self._answer(method, url.path, parse_qs(url.query), body)
        with self.server.store.lock:
            self.server.store.requests.append(Request(method, url.path, parse_qs(url.query), body, code))
        self._send(code, answer)

    def _answer(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, dict]:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, status(401, "Unauthorized", "Unauthorized")
        if method == "GET" and path == "/version":
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"}
        match = _PATH.match(path)
        resource = None
        if match:
            group, version = match["group"] or "", match["core"] or match["version"]
            resource = next(
                (r for r in RESOURCES if (r.group, r.version, r.plural) == (group, version, match["plural"])),
                None,
            )
        if match is None or resource is None:
            return 404, status(404, "NotFound", "the server could not find the requested resource")
        ns, name, store = match["ns"], match["name"], self.server.store
        if method == "POST" and name is None:
            return self.server.create(resource, ns, body)
        if method == "GET" and name is None:
            return 200, self.server.list(resource, ns, (query.get("labelSelector") or [""])[0])
        if name is not None and method in ("GET", "DELETE"):
            with store.lock:
                obj = store.objects.get((resource.kind, ns, name))
                if obj is not None and method == "DELETE":
                    del store.objects[(resource.kind, ns, name)]
            if obj is None:
                missing = (
                    f'{resource.plural}{"." + resource.group if resource.group else ""} "{name}" not found'
                )
                details = {"name": name, "group": resource.group, "kind": resource.plural}
                return 404, status(404, "NotFound", missing, details)
            if method == "DELETE":
                details = {"name": name, "group": resource.group, "kind": resource.plural}
                return 200, status(200, "", "", {**details, "uid": obj["metadata"]["uid"]})
            return 200, obj
        return 405, status(405, "MethodNotAllowed", f"{method} is not supported here")

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, store: Store):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.store = store

    def create(self, resource: Resource, ns: str, body: Any) -> tuple[int, dict]:
        if not isinstance(body, dict):
            return 400, status(400, "BadRequest", "the body of the request was in an unknown format")
        if body.get("kind") != resource.kind or body.get("apiVersion") != resource.api_version:
            message = f"the API version in the data ({body.get('apiVersion')}) does not match the expected "
            return 400, status(400, "BadRequest", message + f"API version ({resource.api_version})")
        meta = body.get("metadata") or {}
        if meta.get("namespace") not in (None, ns):
            message = "the namespace of the provided object does not match the namespace sent on the request"
            return 400, status(400, "BadRequest", message)
        problems = object_problems(body)
        if problems:
            causes = [{"message": p} for p in problems]
            message = f'{resource.kind} "{meta.get("name")}" is invalid: {"; ".join(problems)}'
            return 422, status(422, "Invalid", message, {"name": meta.get("name"), "causes": causes})
        store = self.store
        with store.lock:
            key = (resource.kind, ns, meta["name"])
            if key in store.objects:
                message = f'{resource.plural} "{meta["name"]}" already exists'
                return 409, status(409, "AlreadyExists", message, {"name": meta["name"]})
            store.version += 1
            obj = copy.deepcopy(body)
            obj["metadata"] = {
                **meta,
                "namespace": ns,
                "uid": str(uuid.uuid4()),
                "resourceVersion": str(store.version),
                "creationTimestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
            if resource.kind in ("Job", "Deployment", "PersistentVolumeClaim", "Pod", "Service"):
                obj.setdefault("status", {})
            store.objects[key] = obj
            store.created.append(copy.deepcopy(body))
        return 201, obj

    def list(self, resource: Resource, ns: str, selector: str) -> dict:
        wanted = dict(term.split("=", 1) for term in selector.split(",") if "=" in term)
        with self.store.lock:
            items = [
                obj
                for (kind, namespace, _), obj in self.store.objects.items()
                if kind == resource.kind
                and namespace == ns
                and all((obj["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())
            ]
            version = str(self.store.version)
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": version},
            "items": items,
        }


class RecordingApiServer:
    """The server in a thread of the test process; `with RecordingApiServer() as api:` starts and stops it."""

    def __init__(self) -> None:
        self.store = Store()
        self._server = _Server(self.store)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig whose current context is this server, as `kubectl config view --raw` writes one."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "recording", "cluster": {"server": self.url}}],
            "users": [{"name": "recording", "user": {"token": TOKEN}}],
            "contexts": [
                {
                    "name": "recording",
                    "context": {"cluster": "recording", "user": "recording", "namespace": namespace},
                }
            ],
            "current-context": "recording",
        }
        path.write_text(json.dumps(doc, indent=2))
        return path

    @property
    def requests(self) -> list[Request]:
        with self.store.lock:
            return list(self.store.requests)

    def created(self, kind: str | None = None) -> list[dict]:
        """The bodies clients posted (as sent), in order; only those of `kind` when given."""
        with self.store.lock:
            return [copy.deepcopy(o) for o in self.store.created if kind in (None, o.get("kind"))]

    def get(self, kind: str, name: str, namespace: str = "default") -> dict | None:
        with self.store.lock:
            return copy.deepcopy(self.store.objects.get((kind, namespace, name)))

    def missing_references(self, obj: dict, namespace: str = "default") -> list[str]:
        """What a pod of `obj` refers to that this cluster does not hold: the config maps, secrets and claims
        of its volumes, its envFrom sources and env keys (unless optional), its service account. The API
        server admits such a Job; its pod then never starts (ContainerCreating,
        CreateContainerConfigError)."""
        spec = pod_spec_of(obj)
        if spec is None:
            return []
        missing = []

        def need(kind: str, name: str, key: str | None = None, optional: bool = False) -> None:
            found = self.get(kind, name, namespace)
            if optional:
                return
            if found is None:
                missing.append(f"{kind} {name}")
            elif key is not None and key not in {**found.get("data", {}), **found.get("stringData", {})}:
                missing.append(f"{kind} {name} key {key}")

        for volume in spec.get("volumes") or []:
            if "configMap" in volume:
                need(
                    "ConfigMap",
                    volume["configMap"]["name"],
                    optional=volume["configMap"].get("optional", False),
                )
            if "secret" in volume:
                need(
                    "Secret", volume["secret"]["secretName"], optional=volume["secret"].get("optional", False)
                )
            if "persistentVolumeClaim" in volume:
                need("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            for source in container.get("envFrom") or []:
                for field_name, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                    if field_name in source:
                        ref = source[field_name]
                        need(kind, ref["name"], optional=ref.get("optional", False))
            for env in container.get("env") or []:
                for field_name, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                    ref = (env.get("valueFrom") or {}).get(field_name)
                    if ref:
                        need(kind, ref["name"], ref["key"], ref.get("optional", False))
        if spec.get("serviceAccountName"):
            need("ServiceAccount", spec["serviceAccountName"])
        return missing


def iter_pod_volumes(obj: dict) -> Iterator[dict]:
    yield from (pod_spec_of(obj) or {}).get("volumes") or []
