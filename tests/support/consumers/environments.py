"""One cached virtual environment per training framework, built from the package registries and checked.

The framework itself and the packages whose own pins would pull another torch build (SpecForge pins torch
2.11, speculators declares torchvision) are installed with `--no-deps`; what their imports need is pinned
here, at the versions the drivers were proven with. torch is the project's CPU pin (`torch==2.13.0`), which
every framework here accepts for reading data and CPU training. Built and cached by `resources.side_env` (as
vLLM's CPU build is).

The builds take a few minutes on a cold machine, mostly unpacking torch three times: `prefetch()` starts them
in a background thread when the session collects a test that needs them, so they overlap with the rest of the
suite.
"""

from __future__ import annotations

from pathlib import Path

from resources.side_env import Prefetcher, SideEnv
from resources.side_env import versions as _versions


def _consumer(name: str, package: str, version: str, no_deps, requirements, imports) -> SideEnv:
    return SideEnv(
        name, package, version, tuple(no_deps), tuple(requirements), (), tuple(imports), folder="consumers"
    )


CONSUMERS = {
    "speculators": _consumer(
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
    "specforge": _consumer(
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
    "modelopt": _consumer(
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


_prefetcher = Prefetcher()


def python(name: str) -> Path:
    """The interpreter of `name`'s environment, built first if needed (waits for a prefetch in progress)."""
    return _prefetcher.python(CONSUMERS[name])


def versions(name: str) -> dict[str, str]:
    """What the environment's stamp recorded: the installed versions of the framework, transformers and
    torch."""
    python(name)
    return _versions(CONSUMERS[name])


def prefetch(names: list[str]) -> None:
    """Build the environments one after another in a background thread (nice'd: the tests come first)."""
    _prefetcher.start([CONSUMERS[n] for n in names])
