"""Cached virtual environments for packages that pin other versions than the project (vLLM's CPU build; the
training frameworks the tests run on the exports).

The package itself and whatever its own pins would pull in another torch build are installed with `--no-deps`;
what its imports need is pinned in the spec. torch is the project's CPU pin (`torch==2.13.0`, a CPU build from
local disk on these machines). An environment is keyed by its whole specification and the Python version,
built under a lock (parallel processes build it once), and used only once its stamp, written last, says the
install and the import check finished: a build killed halfway is rebuilt, never used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_assets.core.target_model.loading import cache_root

TORCH = "torch==2.13.0"
STAMP = "eagle3-side-env.json"


@dataclass(frozen=True)
class SideEnv:
    name: str
    package: str  # the distribution whose version is checked
    version: str
    no_deps: tuple[str, ...] = ()  # installed without their declared dependencies
    requirements: tuple[str, ...] = ()  # installed with theirs (what the imports need)
    remove: tuple[str, ...] = ()  # uninstalled afterwards (e.g. CUDA-linked extras that break every import)
    imports: tuple[str, ...] = ()  # modules that must import once installed
    torch: str = TORCH
    folder: str = "environments"  # under the cache root

    def key(self) -> str:
        spec = json.dumps({**asdict(self), "python": sys.version_info[:2]}, sort_keys=True)
        return hashlib.sha256(spec.encode()).hexdigest()[:12]

    def path(self) -> Path:
        return cache_root() / self.folder / f"{self.name}-{self.version}-{self.key()}"

    def ready(self) -> bool:
        return (self.path() / STAMP).exists()


class SideEnvError(RuntimeError):
    """An environment could not be built; the message carries the tail of the install log."""


def ensure(spec: SideEnv, nice: bool = False) -> Path:
    """The interpreter of `spec`'s environment, built first if it is not there (minutes; once per machine)."""
    env = spec.path()
    base = env.parent
    base.mkdir(parents=True, exist_ok=True)
    py = env / "bin" / "python"
    with open(base / f".{env.name}.lock", "w") as lock:  # one build per environment (versions build apart)
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if (env / STAMP).exists():
            return py
        shutil.rmtree(env, ignore_errors=True)
        log = base / f"{env.name}.install.log"
        prefix = ["nice", "-n", "10"] if nice and shutil.which("nice") else []

        def run(*args: str) -> None:
            with open(log, "a") as out:
                out.write(f"$ {' '.join(args)}\n")
                out.flush()
                done = subprocess.run([*prefix, *args], stdout=out, stderr=subprocess.STDOUT, env=clean_env())
            if done.returncode:
                tail = log.read_text()[-3000:]
                raise SideEnvError(f"building the {spec.name} environment failed ({log}):\n{tail}")

        log.write_text("")
        run(sys.executable, "-m", "venv", str(env))
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        run(*pip, spec.torch)
        if spec.no_deps:
            run(*pip, "--no-deps", *spec.no_deps)
        if spec.requirements:
            run(
                *pip, *spec.requirements, spec.torch
            )  # torch named again: nothing may replace the pinned build
        if spec.remove:
            run(str(py), "-m", "pip", "uninstall", "-y", "-q", *spec.remove)
        probe = (
            "import importlib, importlib.metadata as m, json\n"
            f"[importlib.import_module(x) for x in {list(spec.imports)!r}]\n"
            "def v(p):\n"
            "    try:\n        return m.version(p)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            f"print(json.dumps({{p: v(p) for p in ({spec.package!r}, 'transformers', 'torch')}}))"
        )
        found = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=clean_env())
        if found.returncode:
            raise SideEnvError(f"the {spec.name} environment does not import: {found.stderr[-3000:]}")
        got = json.loads(found.stdout.strip().splitlines()[-1])
        if got[spec.package] != spec.version:
            raise SideEnvError(f"{spec.package} {got[spec.package]} installed, {spec.version} pinned")
        (env / STAMP).write_text(json.dumps({"spec": asdict(spec), "versions": got}, indent=2) + "\n")
        log.unlink(missing_ok=True)
        return py


def versions(spec: SideEnv) -> dict[str, str]:
    """What the environment's stamp recorded: the installed versions of the package, transformers and
    torch."""
    return json.loads((ensure(spec).parent.parent / STAMP).read_text())["versions"]


class Prefetcher:
    """Builds environments one after another in a background thread (nice'd: the caller's work comes
    first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}

    def start(self, specs: list[SideEnv]) -> None:
        with self._lock:
            todo = [s for s in specs if self._id(s) not in self._futures]
            for s in todo:
                self._futures[self._id(s)] = Future()

        def build() -> None:
            for s in todo:
                try:
                    self._futures[self._id(s)].set_result(ensure(s, nice=True))
                except BaseException as exc:
                    self._futures[self._id(s)].set_exception(exc)

        if todo:
            threading.Thread(target=build, name="side-environments", daemon=True).start()

    def python(self, spec: SideEnv) -> Path:
        """The interpreter, waiting for a build in progress (or building it now)."""
        with self._lock:
            future = self._futures.get(self._id(spec))
        return future.result() if future is not None else ensure(spec)

    @staticmethod
    def _id(spec: SideEnv) -> str:
        return f"{spec.name}-{spec.version}"


def clean_env() -> dict[str, str]:
    """The environment without the project venv's own settings leaking into another interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_NO_INPUT"] = "1"
    return env
