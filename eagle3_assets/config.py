"""The project config (`eagle3.yaml`): one validated object, loaded once per process.

Unknown keys are errors that name the key, so a typo (`budget_tokns`) fails before any paid request instead of
silently running with a default. Relative paths are resolved against the config file's folder.
"""

from __future__ import annotations

import ipaddress
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CONFIG_ENV = "EAGLE3_CONFIG"
BACKEND_ENV = "EAGLE3_BACKEND"
DEFAULT_CONFIG_NAME = "eagle3.yaml"
BUILTIN_SMOLLM2 = "builtin:smollm2"
BackendName = Literal["local", "openrouter", "sglang"]
StorageDtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn"]
_PARTITION_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
README_CONFIG = "README, section 'Configuration: eagle3.yaml'"
README_BACKENDS = "README, section 'Backends: OpenRouter, SGLang, any OpenAI-compatible server'"


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StorageConfig(Strict):
    # A local folder (or a mounted shared volume), or an object store: s3://bucket/prefix (gs://, az:// too).
    root: str = "data"
    # For object stores: endpoint, region, allow_http, ... (obstore's options); credentials come from the
    # environment (AWS_ACCESS_KEY_ID, ...), never from this file.
    options: dict[str, Any] = Field(default_factory=dict)
    # Where each step keeps its working copy of a partition when the root is an object store.
    cache_dir: str = "~/.cache/eagle3-assets/storage"

    @field_validator("options")
    @classmethod
    def _no_secrets(cls, v: dict[str, Any]) -> dict[str, Any]:
        secret = [k for k in v if any(w in k.lower() for w in ("secret", "password", "token", "access_key"))]
        if secret:
            raise ValueError(
                f"storage.options {secret} look like credentials: set them in the environment "
                f"(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...), never in this file ({README_CONFIG})"
            )
        return v


class TargetConfig(Strict):
    tokenizer: str = BUILTIN_SMOLLM2
    model: str = BUILTIN_SMOLLM2
    trust_remote_code: bool = False
    revision: str | None = None
    # Passed to the chat template, e.g. {"thinking": true} for Kimi K2.5.
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # The end-of-turn token the template emits after an answer. Default: the tokenizer's eos token.
    end_of_turn_token: str | None = None
    # Optional hard-coded id (e.g. a serving stack's stop id); preflight checks it decodes to
    # end_of_turn_token.
    end_of_turn_id: int | None = None
    # Used when the template has no reasoning field of its own: reasoning is rendered between these strings.
    think_open: str = "<think>"
    think_close: str = "</think>"


class SamplingConfig(Strict):
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = None


class OpenRouterConfig(Strict):
    base_url: str = "https://openrouter.ai/api/v1"
    api_key_env: str = "OPENROUTER_API_KEY"
    model: str = "moonshotai/kimi-k2.5"
    provider: dict[str, Any] = Field(default_factory=dict)
    # The ceiling: the engine finds the concurrency the provider sustains below it (adaptive window).
    max_concurrency: int = Field(2000, ge=1)
    # OpenRouter's reasoning request object; null sends none.
    reasoning: dict[str, Any] | None = Field(default_factory=lambda: {"enabled": True})
    extra_body: dict[str, Any] = Field(default_factory=dict)
    request_timeout_s: float = Field(900.0, gt=0)
    # Stream answers (server-sent events with usage): long reasoning answers survive proxies that cut idle
    # connections, and the budget sees the tokens of each answer as they arrive.
    stream: bool = True
    stream_idle_timeout_s: float = Field(300.0, gt=0)
    max_retries: int = Field(8, ge=0)
    app_url: str = "https://github.com/eagle3-assets"
    app_title: str = "eagle3-assets"
    # The key is sent as a Bearer token: over plain http it is readable on the way, so a non-loopback http
    # endpoint must be allowed explicitly.
    allow_insecure_http: bool = False

    @model_validator(mode="after")
    def _key_only_over_tls(self) -> OpenRouterConfig:
        url = self.base_url
        if url.startswith("http://") and not is_loopback(url) and not self.allow_insecure_http:
            raise ValueError(
                f"base_url {url!r} is plain http to another host: the API key would cross the network "
                "unencrypted. Use https, or set backends.openrouter.allow_insecure_http: true for a trusted "
                f"network ({README_BACKENDS})"
            )
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {url!r} must start with https:// (or http:// on loopback)")
        return self


class SGLangConfig(Strict):
    base_url: str = "http://127.0.0.1:30000"
    max_concurrency: int = Field(512, ge=1)  # the ceiling of the adaptive window
    request_timeout_s: float = Field(900.0, gt=0)
    max_retries: int = Field(8, ge=0)
    extra_sampling_params: dict[str, Any] = Field(default_factory=dict)


class LocalConfig(Strict):
    batch_size: int = Field(16, ge=1)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_retries: int = Field(1, ge=0)


class BackendsConfig(Strict):
    openrouter: OpenRouterConfig = Field(default_factory=OpenRouterConfig)
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    local: LocalConfig = Field(default_factory=LocalConfig)


class InstructionFields(Strict):
    instruction: str = "instruction"
    input: str = "input"
    system: str | None = None
    # The source's own answer (kept as prompts.source_answer for the acceptance gate's comparison); default:
    # the first of `response` (Magicoder) or `output` (Alpaca) that the row has.
    response: str | None = None


class DatasetConfig(Strict):
    source: str
    format: Literal["messages", "sharegpt", "instruction"]
    budget_tokens: int = Field(10_000_000, ge=0)
    budget_usd: float | None = Field(None, ge=0)
    max_tokens: int = Field(4096, ge=1)
    # last: the target answers the final turn (earlier assistant turns stay the source's); all: every
    # assistant turn, in order, each request carrying the target's own earlier answers (a row per turn,
    # `<id>#t<k>`).
    turns: Literal["last", "all"] = "last"
    fields: InstructionFields = Field(default_factory=InstructionFields)
    system_prompt: str | None = None
    sampling: SamplingConfig | None = None
    description: str = ""


class TokensConfig(Strict):
    # Train on every assistant turn of multi-turn prompts, not only the generated one.
    train_all_assistant_turns: bool = False
    # Where the backend returned the ids it generated, store those (ground truth) rather than the
    # reconstruction.
    prefer_reference_ids: bool = True
    # Conversations per chunk; 2 x cores chunks are in flight, so this bounds memory (512: < 1 GB at 10 KB
    # answers).
    batch_size: int = Field(512, ge=1)


class ChecksConfig(Strict):
    min_reference_match_rate: float = Field(0.99, ge=0, le=1)
    # Answered prompts whose conversation cannot be tokenized exactly (tokens_errors), as a share: blocking
    # above.
    max_token_error_share: float = Field(0.05, ge=0, le=1)
    # hidden_states: samples recomputed by an independent forward and compared with what is stored.
    hidden_states_spot_samples: int = Field(3, ge=0)
    max_truncated_share: float = Field(0.5, ge=0, le=1)
    max_failure_share: float = Field(0.05, ge=0, le=1)
    max_degenerate_share: float = Field(0.2, ge=0, le=1)


class VllmExtractionConfig(Strict):
    """Running vLLM servers that extract hidden states (`eagle3 vllm-serve` prints the command for the
    target)."""

    # One or more data-parallel replicas (each may span GPUs and nodes with tensor/pipeline parallelism).
    base_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000/v1"], min_length=1)
    model: str | None = None  # the served model name; null: the server's only model (GET /v1/models)
    # Where the servers' connector writes (shared_storage_path): the extraction reads and removes the files
    # there, so this process must see them at the path the server returns (a shared volume mounted at the same
    # path).
    storage_path: str = "/tmp/eagle3-hidden-states"
    max_concurrency: int = Field(
        64, ge=1
    )  # requests in flight over all replicas (the adaptive window's ceiling)
    request_timeout_s: float = Field(1800.0, gt=0)
    file_timeout_s: float = Field(
        300.0, gt=0
    )  # a connector file not complete this long after its answer: a fault
    max_retries: int = Field(4, ge=0)


class HiddenStatesConfig(Strict):
    # transformers: the target in this process (the default; one GPU or device_map); vllm: running vLLM
    # servers.
    engine: Literal["transformers", "vllm"] = "transformers"
    vllm: VllmExtractionConfig = Field(default_factory=VllmExtractionConfig)
    aux_layers: list[int] | None = None  # default: [1, L//2-1, L-4]
    shard_bytes: int = Field(2 * 1024**3, ge=1024)
    max_tokens_per_batch: int = Field(16384, ge=16)
    max_seq_len: int = Field(32768, ge=16)
    device: str = "auto"
    # What the shards store (compute runs in the device's own dtype): bf16, what the training frameworks read;
    # or float8_e4m3fn, half the bytes, with a float32 scale per token and layer. Changing it recomputes the
    # shards.
    storage_dtype: StorageDtype = "bfloat16"

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


class AcceptanceVllmConfig(Strict):
    """The vLLM server the acceptance step starts itself: the target with the trained draft as EAGLE-3."""

    cpu: bool = False  # vLLM's CPU build (tests, laptops), installed in a cached environment of its own
    # Interpreter that runs vLLM (GPU builds): default the step's own Python. Ignored with cpu: true.
    python: str | None = None
    # GPUs: default every GPU the step sees (CUDA_VISIBLE_DEVICES) as tensor parallel.
    tensor_parallel_size: int | None = Field(None, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    dtype: str = "auto"  # the server's --dtype; CPU: float32 (bf16 arithmetic is slow without AVX512-BF16)
    max_model_len: int | None = Field(None, ge=16)  # default: the longest measured prompt plus max_new_tokens
    kv_cache_gib: int = Field(2, ge=1)  # CPU only: VLLM_CPU_KVCACHE_SPACE
    start_timeout_s: float = Field(1800.0, gt=0)  # a 1T target takes many minutes to load on 8 GPUs
    request_timeout_s: float = Field(900.0, gt=0)
    max_concurrency: int = Field(8, ge=1)  # measured prompts in flight at once
    # Prompts decoded greedily by the target alone (no draft) and compared token for token with the drafted
    # outputs: speculative decoding must not change a greedy answer.
    greedy_check_prompts: int = Field(4, ge=0)
    extra_args: list[str] = Field(default_factory=list)  # appended to the server command


class AcceptanceConfig(Strict):
    """The acceptance gate (asset `acceptance`): a small EAGLE-3 draft trained on the partition, measured
    against the target with greedy speculative decoding."""

    draft_tokens: int = Field(4, ge=1, le=16)  # k: draft tokens proposed per target forward
    train_prompts: int = Field(24, ge=1)  # samples the draft trains on (a stable hash picks them)
    heldout_prompts: int = Field(8, ge=1)  # kept out of training (at most a quarter of the partition)
    train_steps: int = Field(150, ge=1)  # the fixed training budget, in optimizer steps
    ttt_steps: int | None = Field(None, ge=1)  # training-time-test depth; default: draft_tokens
    learning_rate: float = Field(3e-3, gt=0)
    batch_tokens: int = Field(512, ge=16)  # tokens per optimizer step (packed samples)
    draft_vocab_size: int = Field(4096, ge=16)
    max_new_tokens: int = Field(64, ge=2)  # tokens generated per measured prompt
    min_train_share: float = Field(0.8, gt=0, le=1)  # gate: train acceptance length >= share x (k + 1)
    compare_source_answers: bool = True  # also train on the dataset's own answers, where the source has them
    device: str = "auto"
    seed: int = 0
    # transformers: the target in this process measures the draft with a speculative loop of this project's
    # (the target must fit the step); vllm: the step starts vLLM serving the target with the draft as EAGLE-3
    # and reads the engine's own counters (the target never enters this process).
    engine: Literal["transformers", "vllm"] = "transformers"
    vllm: AcceptanceVllmConfig = Field(default_factory=AcceptanceVllmConfig)


class AutomationConfig(Strict):
    # Every cron tick, datasets under budget with work left are topped up (one backfill); later stages follow.
    top_up_cron: str = "0 */6 * * *"
    enabled: bool = False  # the automation sensor's default state (it can always be started in the UI)
    hidden_states: bool = False  # let hidden_states follow tokens automatically (needs GPUs in production)


class ExecutionConfig(Strict):
    # in_process: one process runs a partition's steps in turn, sharing the loaded model and tokenizer
    # (laptops, the demo); multiprocess: a process per step; k8s: a pod per step (k8s_job_executor, needs
    # dagster-k8s).
    executor: Literal["in_process", "multiprocess", "k8s"] = "in_process"
    max_concurrent_steps: int = Field(4, ge=1)
    # With executor k8s: the Kubernetes secret holding the API key, mounted only into the pods of responses
    # steps.
    k8s_api_key_secret: str = "eagle3-openrouter"


class PoolsConfig(Strict):
    llm_api: int = Field(1, ge=1)
    gpu: int = Field(1, ge=1)


class ProjectConfig(Strict):
    storage: StorageConfig = Field(default_factory=StorageConfig)
    target: TargetConfig = Field(default_factory=TargetConfig)
    backend: BackendName = "local"
    backends: BackendsConfig = Field(default_factory=BackendsConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    datasets: dict[str, DatasetConfig]
    tokens: TokensConfig = Field(default_factory=TokensConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    hidden_states: HiddenStatesConfig = Field(default_factory=HiddenStatesConfig)
    acceptance: AcceptanceConfig = Field(default_factory=AcceptanceConfig)
    automation: AutomationConfig = Field(default_factory=AutomationConfig)
    pools: PoolsConfig = Field(default_factory=PoolsConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    # Folder of the config file; relative paths resolve against it. Set by the loader.
    base_dir: str = Field("", exclude=True)

    @field_validator("datasets")
    @classmethod
    def _keys_are_partition_keys(cls, v: dict[str, DatasetConfig]) -> dict[str, DatasetConfig]:
        if not v:
            raise ValueError("at least one dataset is required")
        for key in v:
            if not _PARTITION_KEY.match(key):
                raise ValueError(
                    f"dataset key {key!r} must match {_PARTITION_KEY.pattern} (it is a partition key)"
                )
        return v

    # -- derived values -------------------------------------------------------------------------------------
    def resolve_path(self, p: str) -> Path:
        path = Path(os.path.expanduser(p))
        return path if path.is_absolute() else Path(self.base_dir) / path

    @property
    def storage_is_remote(self) -> bool:
        return self.storage.root.startswith(("s3://", "gs://", "az://", "abfs://", "abfss://", "memory://"))

    @property
    def storage_root(self) -> Path:
        """The local folder of every partition: the root itself, or the working copies of an object-store
        root."""
        if self.storage_is_remote:
            from .core.storage.remote import RemoteRoot

            return RemoteRoot.cache_folder(
                self.storage.root, Path(os.path.expanduser(self.storage.cache_dir))
            )
        return self.resolve_path(self.storage.root)

    def dataset(self, key: str) -> DatasetConfig:
        try:
            return self.datasets[key]
        except KeyError:
            raise ConfigError(
                f"unknown dataset {key!r}; the config defines {', '.join(self.datasets)}"
            ) from None

    def sampling_for(self, key: str) -> SamplingConfig:
        return self.dataset(key).sampling or self.sampling


def _format_error(err: ValidationError, path: Path) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(
                f"{path}: unknown key '{loc}' (check the spelling; the keys are listed in the "
                f"{README_CONFIG})"
            )
        elif e["type"] == "missing":
            lines.append(f"{path}: missing required key '{loc}'")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{path}: key '{loc}': {msg}")
    return "\n".join(lines)


def config_path() -> Path:
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    here = Path.cwd() / DEFAULT_CONFIG_NAME
    if here.exists():
        return here.resolve()
    # The checkout's own config, so `dagster dev` works from any folder.
    return (Path(__file__).resolve().parent.parent / DEFAULT_CONFIG_NAME).resolve()


def load_config(path: str | Path | None = None, backend_override: str | None = None) -> ProjectConfig:
    """Read, validate and resolve a config file. `EAGLE3_BACKEND` overrides `backend`."""
    path = Path(path).expanduser().resolve() if path else config_path()
    if not path.exists():
        raise ConfigError(f"config file {path} not found; create it or set {CONFIG_ENV} to its path")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    backend = backend_override or os.environ.get(BACKEND_ENV)
    if backend:
        raw["backend"] = backend
    if "base_dir" in raw:
        raise ConfigError(f"{path}: unknown key 'base_dir'")
    raw["base_dir"] = str(path.parent)
    try:
        cfg = ProjectConfig.model_validate(raw)
    except ValidationError as e:
        msg = _format_error(e, path)
        if backend and "backend" in msg:
            msg += f"\n(the backend came from {BACKEND_ENV}={backend!r}; allowed: local, openrouter, sglang)"
        raise ConfigError(msg) from None
    return cfg


@lru_cache(maxsize=8)
def _cached(path: str, backend: str | None, mtime: float) -> ProjectConfig:
    return load_config(path, backend)


def get_config() -> ProjectConfig:
    """The process-wide config (re-read when the file or the environment changes)."""
    path = config_path()
    mtime = path.stat().st_mtime if path.exists() else 0.0
    return _cached(str(path), os.environ.get(BACKEND_ENV), mtime)
