"""One cached virtual environment per training framework, built from the package registries and checked.

The framework itself and the packages whose own pins would pull another torch build (SpecForge pins torch 2.11,
speculators declares torchvision) are installed with `--no-deps`; what their imports need is pinned here, at the
versions the drivers were proven with. torch is the project's CPU pin (`torch==2.13.0`), which every framework here
accepts for reading data and CPU training. An environment is keyed by its whole specification and the Python
version, built under a lock (parallel test processes build it once), and used only once its stamp, written last,
says the install and the version check finished: a build killed halfway is rebuilt, never used.

The builds take a few minutes on a cold machine, mostly unpacking torch three times: `prefetch()` starts them in a
background thread when the session collects a test that needs them, so they overlap with the rest of the suite.
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

TORCH = "torch==2.13.0"
STAMP = "eagle3-consumer.json"


@dataclass(frozen=True)
class Consumer:
    name: str
    package: str  # the distribution whose version is checked
    version: str
    no_deps: tuple[str, ...]  # installed without their declared dependencies
    requirements: tuple[str, ...]  # what their imports need
    imports: tuple[str, ...]  # modules that must import once installed

    def key(self) -> str:
        spec = json.dumps({**asdict(self), "torch": TORCH, "python": sys.version_info[:2]}, sort_keys=True)
        return hashlib.sha256(spec.encode()).hexdigest()[:12]


CONSUMERS = {
    "speculators": Consumer(
        "speculators",
        "speculators",
        "0.9.0",
        # speculators declares torchvision/torchaudio, which no module of it imports.
        no_deps=("speculators==0.9.0", "hs-connectors==0.9.0"),
        requirements=(
            "transformers==5.19.0",  # speculators: transformers<=5.19.0
            "datasets==5.1.0",  # speculators: datasets<=5.1.0
            "openai==3.57.0",
            "pydantic-settings==2.16.3",
            "httpx==0.28.1",
            "loguru==0.7.3",
        ),
        imports=("speculators.train.cli", "speculators.data_generation.offline", "hs_connectors"),
    ),
    "specforge": Consumer(
        "specforge",
        "specforge",
        "0.2.0",
        # specforge pins torch==2.11.0 and sglang; triton is imported at module level by its loss.
        no_deps=("specforge==0.2.0", "triton==3.9.0"),
        requirements=(
            "transformers==5.8.1",  # specforge: transformers==5.8.1
            "accelerate==1.15.0",
            "datasets==5.2.0",
            "numpy==2.4.6",
            "pydantic==2.14.4",
            "psutil==7.2.2",
            "PyYAML==6.0.4",
            "safetensors==0.8.0",
            "tqdm==4.70.1",
            "requests==2.34.2",
            "tokenizers==0.22.2",
        ),
        imports=("specforge.cli", "specforge.modeling.auto", "specforge.modeling.target.target_head"),
    ),
    "modelopt": Consumer(
        "modelopt",
        "nvidia-modelopt",
        "0.47.0",
        no_deps=("nvidia-modelopt==0.47.0",),
        requirements=(
            "transformers==5.8.1",  # Model-Optimizer: transformers<5.15
            "accelerate==1.15.0",
            "ninja==1.13.2",
            "numpy==2.4.6",
            "nvidia-ml-py==13.615.71",
            "omegaconf==2.4.0",
            "packaging==26.4",
            "PuLP==3.3.2",
            "pydantic==2.14.4",
            "PyYAML==6.0.4",
            "regex==2026.11.19",
            "requests==2.34.2",  # imported by modelopt, not declared
            "rich==15.0.0",
            "safetensors==0.8.0",
            "scipy==1.17.1",
            "tqdm==4.70.1",
        ),
        imports=("modelopt.torch.speculative", "modelopt.torch.speculative.eagle.utils", "modelopt.recipe"),
    ),
}


class ConsumerEnvironmentError(RuntimeError):
    """An environment could not be built; the message carries the tail of the install log."""


def root() -> Path:
    from eagle3_assets.core.target.loading import cache_root

    return cache_root() / "consumers"


def python(name: str) -> Path:
    """The interpreter of `name`'s environment, built first if needed (waits for a prefetch in progress)."""
    with _lock:
        future = _futures.get(name)
    if future is not None:
        return future.result()
    return _ensure(CONSUMERS[name])


def versions(name: str) -> dict[str, str]:
    """What the environment's stamp recorded: the installed versions of the framework, transformers and torch."""
    return json.loads((python(name).parent.parent / STAMP).read_text())["versions"]


def prefetch(names: list[str]) -> None:
    """Build the environments one after another in a background thread (nice'd: the tests come first)."""
    with _lock:
        todo = [n for n in names if n not in _futures]
        for n in todo:
            _futures[n] = Future()

    def build() -> None:
        for n in todo:
            try:
                _futures[n].set_result(_ensure(CONSUMERS[n], nice=True))
            except BaseException as exc:
                _futures[n].set_exception(exc)

    if todo:
        threading.Thread(target=build, name="consumer-environments", daemon=True).start()


_lock = threading.Lock()
_futures: dict[str, Future] = {}


def _ensure(c: Consumer, nice: bool = False) -> Path:
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    env = base / f"{c.name}-{c.version}-{c.key()}"
    py = env / "bin" / "python"
    with open(base / f".{c.name}.lock", "w") as lock:
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
                done = subprocess.run([*prefix, *args], stdout=out, stderr=subprocess.STDOUT, env=_pip_env())
            if done.returncode:
                tail = log.read_text()[-3000:]
                raise ConsumerEnvironmentError(f"building the {c.name} environment failed ({log}):\n{tail}")

        log.write_text("")
        run(sys.executable, "-m", "venv", str(env))
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        run(*pip, TORCH)
        run(*pip, "--no-deps", *c.no_deps)
        run(*pip, *c.requirements)
        probe = (
            "import importlib, importlib.metadata as m, json, sys\n"
            f"[importlib.import_module(x) for x in {list(c.imports)!r}]\n"
            f"print(json.dumps({{p: m.version(p) for p in ({c.package!r}, 'transformers', 'torch')}}))"
        )
        found = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=_pip_env())
        if found.returncode:
            raise ConsumerEnvironmentError(
                f"the {c.name} environment does not import: {found.stderr[-3000:]}"
            )
        got = json.loads(found.stdout.strip().splitlines()[-1])
        if got[c.package] != c.version:
            raise ConsumerEnvironmentError(f"{c.package} {got[c.package]} installed, {c.version} pinned")
        (env / STAMP).write_text(json.dumps({"consumer": asdict(c), "versions": got}, indent=2) + "\n")
        log.unlink(missing_ok=True)
        return py


def _pip_env() -> dict[str, str]:
    """The environment without the project venv's own settings leaking into the consumer's interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_NO_INPUT"] = "1"
    return env
