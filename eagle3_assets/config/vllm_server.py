"""A vLLM server a step starts itself on the devices it was given (`acceptance.vllm`, and
`hidden_states.vllm` with `managed: true`): which build, which parallelism, how long it may take to start."""

from __future__ import annotations

from pydantic import Field

from .base import Strict


class VllmServerConfig(Strict):
    """How a step starts its own vLLM server and stops it whatever ends the step."""

    cpu: bool = Field(
        False,
        description="Use vLLM's CPU build (tests, laptops), installed once in a cached environment of its "
        "own; the server then runs without tensor parallelism.",
    )
    python: str | None = Field(
        None,
        description="The interpreter of the environment vLLM is installed in (an absolute path, such as "
        "`/home/me/venvs/vllm/bin/python`); null: the step's own Python, or with `cpu: true` the cached CPU "
        "build of the newest tested version. With `cpu: true` it names a CPU build installed elsewhere (such "
        "as another tested version's). The step checks that it exists and imports vLLM before anything else.",
    )
    tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="The server's `--tensor-parallel-size`; null: every GPU the step sees "
        "(`CUDA_VISIBLE_DEVICES`) divided by `pipeline_parallel_size`.",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="The server's `--pipeline-parallel-size`.",
    )
    dtype: str = Field(
        "auto",
        description="The server's `--dtype`; `auto` on the CPU build means `float32` (bf16 arithmetic is "
        "slow without AVX512-BF16).",
    )
    kv_cache_gib: int = Field(
        2,
        ge=1,
        description="KV-cache size of the CPU build in GiB (`VLLM_CPU_KVCACHE_SPACE`); unused on GPUs.",
    )
    start_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Seconds the server may take to load and become ready before the step fails (a "
        "1T-parameter target takes many minutes on 8 GPUs).",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Further arguments appended to the server's command line, e.g. "
        "`[--gpu-memory-utilization, '0.85']`.",
    )
