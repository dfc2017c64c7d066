"""Extraction of the target's hidden states (`hidden_states`), in process or through vLLM."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import StorageDtype, Strict
from .vllm_server import VllmServerConfig


class VllmExtractionConfig(VllmServerConfig):
    """vLLM servers that extract hidden states: started by each extraction step itself (`managed: true`), or
    running already at `base_urls` (`eagle3 vllm-serve` prints the command for the target)."""

    managed: bool = Field(
        False,
        description="Each extraction step starts vLLM itself on the devices it was given (the server "
        "settings below: `cpu`, `python`, parallelism), extracts its share of the partition's shards and "
        "stops the server whatever ends the step; no step relies on a server another stage or a person "
        "started. `base_urls` and `storage_path` are then unused.",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="With `managed: true`: the partition's planned shards are split over this many steps, "
        "each with a server of its own (on as many GPU slots or nodes as the executor gives them).",
    )
    base_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000/v1"],
        min_length=1,
        description="Without `managed`: the OpenAI-compatible roots (`http://host:port/v1`) of one or more "
        "data-parallel vLLM replicas someone runs, each started with the `extract_hidden_states` method and "
        "the hidden-states connector and each possibly spanning GPUs and nodes; a request goes to the "
        "replica with the fewest in flight.",
    )
    model: str | None = Field(
        None,
        description="The served model name; null: the one model the servers list at `GET /v1/models`.",
    )
    storage_path: str = Field(
        "/tmp/eagle3-hidden-states",
        description="Without `managed`: the folder the servers' connector writes to (its "
        "`shared_storage_path`): the extraction reads and removes each sample's file there, so this process "
        "must see it at the same path (a shared volume mounted alike). A managed server writes to a folder "
        "of its step's own.",
    )
    max_concurrency: int = Field(
        64,
        ge=1,
        description="Requests in flight over all replicas (the adaptive window's ceiling); as many again may "
        "wait for their files.",
    )
    request_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Seconds one extraction request may take; a request with no progress this long is a "
        "fault.",
    )
    file_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds a sample's connector file may stay incomplete after its answer arrived before "
        "that is a fault.",
    )
    max_retries: int = Field(
        4,
        ge=0,
        description="Retries per sample after faults, with exponential backoff (at most 30 s apart).",
    )


class HiddenStatesConfig(Strict):
    """Extraction of the target's hidden states (the `hidden_states` asset)."""

    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="`transformers`: the target runs in this process (one GPU, or its layers spread over the "
        "visible GPUs); `vllm`: running vLLM servers extract the states (`hidden_states.vllm`), for targets "
        "beyond one process.",
    )
    vllm: VllmExtractionConfig = Field(
        default_factory=VllmExtractionConfig,
        description="The vLLM servers that extract hidden states when `engine` is `vllm` (`eagle3 "
        "vllm-serve` prints the command that starts one for the target).",
    )
    aux_layers: list[int] | None = Field(
        None,
        description="The decoder layers whose outputs are stored as `aux_hidden_states`, 0-based (vLLM and "
        "speculators number them one higher); null: `[1, L//2-1, L-4]` for a target of L layers. Changing it "
        "recomputes the shards.",
    )
    shard_bytes: int = Field(
        2 * 1024**3,
        ge=1024,
        description="Target size of one safetensors shard in bytes (2147483648 is 2 GiB). Each shard is one "
        "step, so smaller shards spread a partition over more GPU steps.",
    )
    max_tokens_per_batch: int = Field(
        16384,
        ge=16,
        description="Tokens packed into one forward pass of the `transformers` engine; without "
        "flash-attention it is capped at 4096 on CUDA and 1024 on CPU (the dense attention mask grows with "
        "its square). Lower it when a GPU runs out of memory.",
    )
    max_seq_len: int = Field(
        32768,
        ge=16,
        description="Samples longer than this many tokens are not extracted (the extraction plan lists them "
        "as skipped); `eagle3 vllm-serve` starts the servers with this plus one as `--max-model-len`.",
    )
    device: str = Field(
        "auto",
        description="Where the `transformers` engine runs the target: `auto` (`cuda` when a GPU is visible, "
        "else `cpu`), `cpu`, `cuda` (several GPUs: the layers spread over all) or `cuda:N`. The spot check "
        "and the in-process acceptance gate load the target there too.",
    )
    storage_dtype: StorageDtype = Field(
        "bfloat16",
        description="What the shards store (compute runs in the device's own dtype): `bfloat16`, which the "
        "training frameworks read; `float16` or `float32`; or `float8_e4m3fn`, half the bytes, with a "
        "float32 scale per token and layer. Changing it recomputes the shards; `dtype` is accepted as its "
        "earlier name.",
    )

    @model_validator(mode="before")
    @classmethod
    def _dtype_was_renamed(cls, data: Any) -> Any:
        """`dtype` (auto | bfloat16 | float16 | float32) was this key's earlier name; `auto` stored bf16."""
        if not isinstance(data, dict) or "dtype" not in data:
            return data
        data = dict(data)
        old = data.pop("dtype")
        old = "bfloat16" if old == "auto" else old
        if "storage_dtype" in data and data["storage_dtype"] != old:
            raise ValueError(
                f"hidden_states.dtype ({old}) and hidden_states.storage_dtype ({data['storage_dtype']}) "
                "disagree: dtype is storage_dtype's earlier name, keep storage_dtype only"
            )
        data["storage_dtype"] = old
        return data
