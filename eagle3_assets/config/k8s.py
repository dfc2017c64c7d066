"""`execution.k8s_steps`: what each kind of step's pod asks Kubernetes for under `execution.executor: k8s`.

Sizes live here, in the project config, because every launch-time route to them (run tags, run config) is
refused by the launch guard: a step's pod is sized by the code location's own executor, never by whoever
launches a run."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from .base import Strict

# A Kubernetes resource quantity as people write them: a decimal number with an optional SI or binary suffix
# (`500m`, `4`, `16Gi`, `1.5G`). The API server also takes exponents (`1e3`); nobody sizes a pod that way.
_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")


def _quantity(value: str, what: str) -> str:
    if not _QUANTITY.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a Kubernetes quantity (e.g. 500m, 4, 16Gi)")
    return value


class K8sPodSize(Strict):
    """Requests of one kind of step pod. Memory is also its limit (a pod that outgrows it is stopped there,
    not its neighbours on the node); CPU has no limit (a throttled step only runs slower)."""

    cpu: str = Field(description="CPU requested, a Kubernetes quantity (`500m`, `4`).")
    memory: str = Field(description="Memory requested and the pod's limit, a Kubernetes quantity (`16Gi`).")

    @field_validator("cpu")
    @classmethod
    def _cpu_quantity(cls, v: str) -> str:
        return _quantity(v, "cpu")

    @field_validator("memory")
    @classmethod
    def _memory_quantity(cls, v: str) -> str:
        return _quantity(v, "memory")


class K8sGpuPodSize(K8sPodSize):
    """Requests of a GPU step's pod: CPU and memory, its GPUs and the shared memory of its processes."""

    gpus: int = Field(
        1,
        ge=1,
        description="`nvidia.com/gpu` requested (and limited) by every GPU step, except the acceptance step "
        "with `acceptance.engine: vllm` and a `tensor_parallel_size`, which asks for tensor × pipeline "
        "parallel size: the server it starts spans that many GPUs.",
    )
    shm: str = Field(
        "16Gi",
        description="Size of the memory-backed `/dev/shm` mounted into GPU pods (NCCL and vLLM's workers "
        "exchange tensors there; a container's default is 64 MiB). It counts toward the pod's memory.",
    )

    @field_validator("shm")
    @classmethod
    def _shm_quantity(cls, v: str) -> str:
        return _quantity(v, "shm")


class K8sStepsConfig(Strict):
    """Pod sizes per kind of step. The kind comes from the step's pool: `gpu` (hidden-state shard steps,
    checks that run the target, the acceptance gate), `llm_api` (`responses`), and every other step."""

    cpu: K8sPodSize = Field(
        default_factory=lambda: K8sPodSize(cpu="1", memory="4Gi"),
        description="Steps in no pool: ingestion, tokens, the report, checks, the hidden-states plan and "
        "index, and the served extraction (vLLM holds the GPUs; the step holds one shard of `shard_bytes` "
        "while packing it).",
    )
    responses: K8sPodSize = Field(
        default_factory=lambda: K8sPodSize(cpu="4", memory="16Gi"),
        description="`responses` steps (pool `llm_api`): one process keeps up to `max_concurrency` streamed "
        "requests in flight, parses every event, journals and counts the answers' tokens.",
    )
    gpu: K8sGpuPodSize = Field(
        default_factory=lambda: K8sGpuPodSize(cpu="8", memory="64Gi"),
        description="Steps in pool `gpu`: the target (or its server) loads through this memory and runs "
        "on these GPUs.",
    )
