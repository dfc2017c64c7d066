"""The project installed the way the Kubernetes image installs it, without the dev extra, in a cached side
environment (resources/side_env.py, as vLLM's CPU build and the training frameworks are).

What goes in is read from the files that decide it, not listed here: the `pip install` commands of
deploy/k8s/Dockerfile (the project with the extras they name, and what they install `--no-deps`) and the
dependencies pyproject.toml declares for the project and those extras. torch is the project's CPU pin from
local disk (the image takes PyPI's CUDA build). The environment is keyed by that whole list, so a dependency
added or removed in pyproject.toml or the Dockerfile builds a new one; the checkout's code runs in it from
the repository (PYTHONPATH), the installed copy only proves that the package installs.
"""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

from resources.side_env import Prefetcher, SideEnv

from .projects import REPO

DOCKERFILE = REPO / "deploy" / "k8s" / "Dockerfile"


def image_pip_installs() -> list[list[str]]:
    """The arguments of every `pip install` the Dockerfile runs, in order."""
    installs = []
    for line in DOCKERFILE.read_text().splitlines():
        if not line.startswith("RUN "):
            continue
        for command in line.removeprefix("RUN ").split("&&"):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"]:
                installs.append(words[2:])
    return installs


def image_install() -> tuple[list[str], list[str]]:
    """(the extras the image installs the project with, what it installs `--no-deps`)."""
    extras: list[str] = []
    no_deps: list[str] = []
    for args in image_pip_installs():
        packages = [a for a in args if not a.startswith("-")]
        if "--no-deps" in args:
            no_deps += packages
        elif packages and packages[0].startswith("."):  # the project: ".[a,b]"
            extras += packages[0].partition("[")[2].rstrip("]").split(",") if "[" in packages[0] else []
        elif packages != ["torch"]:  # torch: the CPU pin here
            raise ValueError(f"the Dockerfile installs {packages}: teach tests/support/runtime_install.py")
    return [e for e in extras if e], no_deps


def runtime_env() -> SideEnv:
    """The side environment holding what the image installs."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras, no_deps = image_install()
    optional = project["optional-dependencies"]
    requirements = [*project["dependencies"], *[r for e in extras for r in optional[e]]]
    return SideEnv(
        "runtime",
        "eagle3-assets",
        project["version"],
        no_deps=(str(REPO), *no_deps),
        requirements=tuple(requirements),
        imports=("eagle3_assets.config",),
    )


_prefetcher = Prefetcher()


def prefetch() -> None:
    """Build the environment in a background thread (nice'd) while the rest of the suite runs."""
    _prefetcher.start([runtime_env()])


def python() -> Path:
    """The environment's interpreter, built first if needed (waits for a prefetch in progress)."""
    return _prefetcher.python(runtime_env())
