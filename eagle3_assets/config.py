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
# Where users read more, named in error messages (pages of the documentation site, paths in the repository).
DOCS_CONFIG = "docs/configuration.md"
DOCS_CONFIG_REFERENCE = "docs/reference/configuration.md"
DOCS_BACKENDS = "docs/backends.md"


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
    """Where every output lands."""

    root: str = Field(
        "data",
        description="Where every output lands, one folder per dataset: a local folder (a relative path is "
        "relative to the config file's folder) or an object store, `s3://bucket/prefix` (also `gs://`, "
        "`az://`, `abfs://`, `abfss://`, `memory://`). Point it at a shared volume or a bucket when steps "
        "run on more than one machine.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the object-store client for a URL `root` (obstore's: `endpoint`, `region`, "
        "`allow_http`, ...), and `retry` with the keys `max_retries`, `init_backoff_s`, `max_backoff_s`, "
        "`base`, `retry_timeout_s`; unused for a local root. Credentials come from the environment "
        "(`AWS_ACCESS_KEY_ID`, ...): a key that looks like one (secret, password, token, access_key) is "
        "refused.",
    )
    cache_dir: str = Field(
        "~/.cache/eagle3-assets/storage",
        description="Where each step keeps its working copy of a partition when `root` is an object store "
        "(unused for a local root). `~` is expanded; a relative path is taken from the process's working "
        "directory, not from the config file's folder.",
    )

    @field_validator("options")
    @classmethod
    def _no_secrets(cls, v: dict[str, Any]) -> dict[str, Any]:
        secret = [k for k in v if any(w in k.lower() for w in ("secret", "password", "token", "access_key"))]
        if secret:
            raise ValueError(
                f"storage.options {secret} look like credentials: set them in the environment "
                f"(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...), never in this file (see {DOCS_CONFIG})"
            )
        return v


class TargetConfig(Strict):
    """The target model: its tokenizer and chat template, its weights, and how they are loaded."""

    tokenizer: str = Field(
        BUILTIN_SMOLLM2,
        description="The target's tokenizer and chat template: a Hugging Face repo id, a local folder "
        "(relative to the config file's folder) or `builtin:smollm2` (the embedded SmolLM2-135M-Instruct). "
        "It renders every prompt and rebuilds every answer's token ids, so it must be the tokenizer of "
        "`model`; preflight checks that the two belong together.",
    )
    model: str = Field(
        BUILTIN_SMOLLM2,
        description="The target's weights, in the same forms as `tokenizer`. The embedded backend generates "
        "with them, the in-process engines extract hidden states and run the acceptance gate with them, and "
        "with the vLLM engines this is the checkpoint served, of which pieces (embedding, head, final norm, "
        "first layers) are read here for the checks.",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run the code a hub repository ships for its tokenizer and model (Kimi K2 and K2.5 need "
        "it). With a tokenizer or model from the hub, preflight then requires `revision`.",
    )
    revision: str | None = Field(
        None,
        description="The commit of the hub repositories of `tokenizer` and `model` to load (one pin for "
        "both, their remote code included); null: the repository's default branch as it is now. Set it to "
        "the commit whose code you reviewed: preflight refuses a placeholder such as "
        "`REPLACE-WITH-A-COMMIT-SHA`.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables passed to the chat template wherever it renders (tokenization, and the "
        "hidden-states servers' `/tokenize` check), e.g. `{thinking: true}` for Kimi K2.5. They change the "
        "rendered tokens, so set them to the mode the answers are generated in.",
    )
    end_of_turn_token: str | None = Field(
        None,
        description="The token that ends an assistant turn, trained as each finished answer's last token. "
        "Null: the control token the chat template writes after an answer (Kimi K2.5: `<|im_end|>`, not its "
        "eos), or the tokenizer's eos token when the template writes none. Set it only when preflight asks "
        "for it.",
    )
    end_of_turn_id: int | None = Field(
        None,
        description="Optional id of the end-of-turn token as a serving stack knows it (its stop id). It is "
        "only checked: preflight fails unless it is the tokenizer's id of the end-of-turn token.",
    )
    think_open: str = Field(
        "<think>",
        description="Opening marker of reasoning, for chat templates without a `reasoning_content` field: an "
        "answer's reasoning is rendered between `think_open` and `think_close` before its content, and "
        "SGLang's raw output is split on them.",
    )
    think_close: str = Field(
        "</think>",
        description="Closing marker of reasoning; see `think_open`.",
    )


class SamplingConfig(Strict):
    """How the target samples its answers."""

    temperature: float = Field(
        0.0,
        ge=0.0,
        description="Sampling temperature sent to the backend; 0 is greedy decoding. Use the target's "
        "recommended value for the mode it answers in (Kimi K2.5 thinking: 1.0).",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus-sampling threshold sent to the backend (1.0: no cut); the embedded backend "
        "applies it only when `temperature` is above 0.",
    )
    top_k: int | None = Field(
        None,
        ge=1,
        description="Sample only among the k most likely tokens; null sends none, so the server's default "
        "applies. The embedded backend applies it only when `temperature` is above 0.",
    )
    seed: int | None = Field(
        None,
        description="Random seed sent with each request (OpenRouter `seed`, SGLang `sampling_seed`; the "
        "embedded backend seeds torch before each sampled batch); null sends none. Providers may ignore it.",
    )


class OpenRouterConfig(Strict):
    """The `openrouter` backend: OpenRouter, or any OpenAI-compatible chat-completions server."""

    base_url: str = Field(
        "https://openrouter.ai/api/v1",
        description="Root of an OpenAI-compatible API; requests go to `<base_url>/chat/completions`. Any "
        "such server works (vLLM, SGLang's OpenAI API, `transformers serve`); plain `http://` is accepted "
        "only on a loopback host unless `allow_insecure_http` is true.",
    )
    api_key_env: str = Field(
        "OPENROUTER_API_KEY",
        description="Name of the environment variable that holds the API key, sent as a Bearer token; the "
        "key itself never appears in the config, logs or outputs. Preflight fails when it is unset for "
        "openrouter.ai.",
    )
    model: str = Field(
        "moonshotai/kimi-k2.5",
        description="The model id sent with every request, in the endpoint's naming (OpenRouter: "
        "`moonshotai/kimi-k2.5`); preflight checks that the endpoint lists it.",
    )
    provider: dict[str, Any] = Field(
        default_factory=dict,
        description="OpenRouter's provider-routing object (`order`, `allow_fallbacks`, `require_parameters`, "
        "`data_collection`, ...), sent as is when not empty. Pin one provider to get every answer from the "
        "same serving stack.",
    )
    max_concurrency: int = Field(
        2000,
        ge=1,
        description="Ceiling of requests in flight: the engine's adaptive window finds what the provider "
        "sustains below it. Lower it to cap the load on a provider; a launch may lower it further, never "
        "raise it.",
    )
    reasoning: dict[str, Any] | None = Field(
        default_factory=lambda: {"enabled": True},
        description="OpenRouter's `reasoning` request object (e.g. `{enabled: true}` or `{effort: high}`), "
        "sent as is; null sends none. The reasoning that comes back is stored in each row's `reasoning`.",
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="Further fields merged into every request body last, overriding those set from the other "
        "keys (e.g. a parameter only one provider knows).",
    )
    request_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Seconds one request may take from sending to its last byte, streamed or not. Raise it "
        "for long reasoning answers (32k thinking tokens can take many minutes).",
    )
    stream: bool = Field(
        True,
        description="Stream answers (server-sent events, usage in the last one): long reasoning answers "
        "survive proxies that cut idle connections, and the budget sees each answer's tokens as they arrive. "
        "Turn it off only for a server that cannot stream.",
    )
    stream_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds a stream may stay silent before it is cut and retried as a fault.",
    )
    max_retries: int = Field(
        8,
        ge=0,
        description="Retries per prompt after faults (5xx, timeouts, resets, malformed bodies), with "
        "jittered exponential backoff; then the prompt gets a retryable `failures` row. Backpressure (429, "
        "or 503 and 402 with `Retry-After`) is waited out without using these.",
    )
    app_url: str = Field(
        "https://github.com/eagle3-assets",
        description="Sent as the `HTTP-Referer` header: OpenRouter's attribution of requests to an app.",
    )
    app_title: str = Field(
        "eagle3-assets",
        description="Sent as the `X-OpenRouter-Title` and `X-Title` headers: the app's name in OpenRouter's "
        "attribution.",
    )
    allow_insecure_http: bool = Field(
        False,
        description="Accept a plain `http://` `base_url` on a host other than loopback. The key then crosses "
        "the network unencrypted: set it only on a network you trust.",
    )

    @model_validator(mode="after")
    def _key_only_over_tls(self) -> OpenRouterConfig:
        url = self.base_url
        if url.startswith("http://") and not is_loopback(url) and not self.allow_insecure_http:
            raise ValueError(
                f"base_url {url!r} is plain http to another host: the API key would cross the network "
                "unencrypted. Use https, or set backends.openrouter.allow_insecure_http: true for a trusted "
                f"network (see {DOCS_BACKENDS})"
            )
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {url!r} must start with https:// (or http:// on loopback)")
        return self


class SGLangConfig(Strict):
    """The `sglang` backend: an SGLang server's native API, which returns the generated token ids."""

    base_url: str = Field(
        "http://127.0.0.1:30000",
        description="Root of the SGLang server: prompts go to `<base_url>/generate` as token ids rendered "
        "with the target's chat template, after `/health` and `/model_info` answered.",
    )
    max_concurrency: int = Field(
        512,
        ge=1,
        description="Ceiling of requests in flight: the adaptive window finds what the server sustains below "
        "it. A launch may lower it, never raise it.",
    )
    request_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Seconds one request may take from sending to its answer.",
    )
    max_retries: int = Field(
        8,
        ge=0,
        description="Retries per prompt after faults, with jittered exponential backoff; then the prompt "
        "gets a retryable `failures` row.",
    )
    extra_sampling_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Further entries merged into every request's `sampling_params` last, overriding those "
        "set from `sampling` (e.g. `{repetition_penalty: 1.05}`).",
    )


class LocalConfig(Strict):
    """The `local` backend: `target.model` generating in this process with transformers."""

    batch_size: int = Field(
        16,
        ge=1,
        description="Prompts generated together in one batched `generate` call (those with the same "
        "`max_tokens` and sampling); twice as many requests wait their turn. Lower it when memory runs "
        "short.",
    )
    device: str = Field(
        "auto",
        description="Where the target generates: `auto` (`cuda` when a GPU is visible, else `cpu`), `cpu`, "
        "`cuda` or `cuda:N`.",
    )
    max_retries: int = Field(
        1,
        ge=0,
        description="Retries per prompt after a fault; then the prompt gets a retryable `failures` row.",
    )


class BackendsConfig(Strict):
    """Settings of each backend, by name; only the one `backend` names is used."""

    openrouter: OpenRouterConfig = Field(
        default_factory=OpenRouterConfig,
        description="The `openrouter` backend: OpenRouter, or any OpenAI-compatible chat-completions server.",
    )
    sglang: SGLangConfig = Field(
        default_factory=SGLangConfig,
        description="The `sglang` backend: an SGLang server's native API, which returns the generated token "
        "ids (ground truth for the tokens stage).",
    )
    local: LocalConfig = Field(
        default_factory=LocalConfig,
        description="The `local` backend: `target.model` generating in this process with transformers (the "
        "embedded demo model by default).",
    )


class InstructionFields(Strict):
    """Field names of `format: instruction` rows."""

    instruction: str = Field(
        "instruction",
        description="The field holding the instruction; a row without it is quarantined.",
    )
    input: str = Field(
        "input",
        description="The field holding optional further input, appended to the instruction after a blank "
        "line.",
    )
    system: str | None = Field(
        None,
        description="The field holding a row's system prompt; null: rows have none (`system_prompt` can "
        "still add one).",
    )
    response: str | None = Field(
        None,
        description="The field holding the source's own answer, kept as the prompt's `source_answer` for the "
        "acceptance gate's comparison; null: the first of `response` (Magicoder) or `output` (Alpaca) that "
        "the row has.",
    )


class DatasetConfig(Strict):
    """One dataset: a partition of every asset."""

    source: str = Field(
        description="The dataset's prompt file: JSON Lines, JSON or Parquet (a relative path is relative to "
        "the config file's folder). An `id` field, where rows have one, is kept as the prompt's stable id.",
    )
    format: Literal["messages", "sharegpt", "instruction"] = Field(
        description="How rows are written: `messages` (OpenAI `{messages: [{role, content}]}`), `sharegpt` "
        "(`{conversations: [{from, value}]}`) or `instruction` (`{instruction, input}`, names set in "
        "`fields`). A trailing assistant turn is dropped: the target answers that turn afresh.",
    )
    budget_tokens: int = Field(
        10_000_000,
        ge=0,
        description="Hard budget of completion tokens (reasoning included) for this dataset, over all "
        "backends and runs together: dispatch stops before it would be exceeded, counting what is in flight. "
        "Raise it to buy more answers.",
    )
    budget_usd: float | None = Field(
        None,
        ge=0,
        description="Hard budget in US dollars for this dataset, over all backends and runs, from the cost "
        "each answer reports (OpenRouter's `usage.cost`); null: none. Where answers report no cost (SGLang, "
        "local, most vLLM servers) only `budget_tokens` applies.",
    )
    max_tokens: int = Field(
        4096,
        ge=1,
        description="Most completion tokens per request, reasoning included (OpenAI's `max_tokens`, SGLang's "
        "`max_new_tokens`); an answer cut there has finish reason `length`. Reasoning models need room "
        "(32768 for Kimi K2.5 thinking).",
    )
    turns: Literal["last", "all"] = Field(
        "last",
        description="`last`: the target answers the final user turn, earlier assistant turns stay the "
        "source's. `all`: the target answers every assistant turn in order, each request carrying its own "
        "earlier answers (a row per turn, id `<id>#t<k>`).",
    )
    fields: InstructionFields = Field(
        default_factory=InstructionFields,
        description="Field names of `format: instruction` rows (Alpaca, Magicoder and similar); ignored for "
        "the other formats.",
    )
    system_prompt: str | None = Field(
        None,
        description="A system prompt put first in every conversation of this dataset that has none (imported "
        "answers are matched with it too); null adds none. Changing it changes the prompts, and so their "
        "answers.",
    )
    sampling: SamplingConfig | None = Field(
        None,
        description="Sampling for this dataset, replacing the top-level `sampling` as a whole (keys left out "
        "take their defaults, not the top-level values); null: the top-level `sampling`.",
    )
    description: str = Field(
        "",
        description="Free text for people reading the config (what the dataset holds); nothing reads it.",
    )


class TokensConfig(Strict):
    """The tokens stage: how each answer becomes `input_ids` and `loss_mask`."""

    train_all_assistant_turns: bool = Field(
        False,
        description="Set the loss mask on every assistant turn of a multi-turn row, the source's earlier "
        "turns included, not only on the answer the target generated. Rows of a `turns: all` dataset train "
        "every turn whatever this says.",
    )
    prefer_reference_ids: bool = Field(
        True,
        description="Where the backend returned the token ids it generated (SGLang, the embedded backend), "
        "store those rather than the ids rebuilt from the text; both are still compared for the "
        "`tokens_reference_match` check.",
    )
    batch_size: int = Field(
        512,
        ge=1,
        description="Conversations per tokenization chunk; two chunks per worker thread are in flight, so "
        "this bounds the stage's memory (512 stays under 1 GB with 10 KB answers).",
    )


class ChecksConfig(Strict):
    """Thresholds of the asset checks."""

    min_reference_match_rate: float = Field(
        0.99,
        ge=0,
        le=1,
        description="Blocking check `tokens_reference_match`: the share of rows whose rebuilt ids equal the "
        "ids the model produced (truncation tails excepted) must reach this; it fails when the rate's 95% "
        "interval lies below it. With a text-only backend there is nothing to compare and it passes, marked "
        "UNVERIFIED.",
    )
    max_token_error_share: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Blocking check `tokens_coverage`: the share of answered prompts whose conversation "
        "cannot be tokenized exactly (rows of `tokens_errors.parquet`) may be at most this.",
    )
    hidden_states_spot_samples: int = Field(
        3,
        ge=0,
        description="Samples the blocking check `hidden_states_spot_check` recomputes with an independent "
        "forward and compares with what is stored: the shortest, the median and the longest, so at most 3 "
        "count; 0 recomputes none.",
    )
    max_truncated_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Warning check `report_answer_quality`: the share of answers cut at `max_tokens` (finish "
        "reason `length`) may be at most this. Raise it where `max_tokens` is deliberately small.",
    )
    max_failure_share: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Blocking check `responses_failure_share`: the share of prompts whose last attempt "
        "failed may be at most this.",
    )
    max_degenerate_share: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Warning check `report_answer_quality`: the share of degenerate answers (400 characters "
        "or more that compress to under 17% of their size: loops of the same phrase) may be at most this.",
    )


class VllmExtractionConfig(Strict):
    """Running vLLM servers that extract hidden states (`eagle3 vllm-serve` prints the command for the
    target)."""

    base_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000/v1"],
        min_length=1,
        description="The OpenAI-compatible roots (`http://host:port/v1`) of one or more data-parallel vLLM "
        "replicas, each started with the `extract_hidden_states` method and the hidden-states connector and "
        "each possibly spanning GPUs and nodes; a request goes to the replica with the fewest in flight.",
    )
    model: str | None = Field(
        None,
        description="The served model name; null: the one model the servers list at `GET /v1/models`.",
    )
    storage_path: str = Field(
        "/tmp/eagle3-hidden-states",
        description="The folder the servers' connector writes to (its `shared_storage_path`): the extraction "
        "reads and removes each sample's file there, so this process must see it at the same path (a shared "
        "volume mounted alike).",
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


class AcceptanceVllmConfig(Strict):
    """The vLLM server the acceptance step starts itself: the target with the trained draft as EAGLE-3."""

    cpu: bool = Field(
        False,
        description="Use vLLM's CPU build (tests, laptops), installed once in a cached environment of its "
        "own; the server then runs without tensor parallelism.",
    )
    python: str | None = Field(
        None,
        description="The interpreter that runs vLLM's GPU build; null: the step's own Python. Ignored with "
        "`cpu: true`.",
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
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="The server's `--max-model-len`; null: the longest measured prompt plus "
        "`max_new_tokens`, `draft_tokens` and 8.",
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
    request_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Seconds one measured request may take.",
    )
    max_concurrency: int = Field(
        8,
        ge=1,
        description="Measured prompts in flight at once.",
    )
    greedy_check_prompts: int = Field(
        4,
        ge=0,
        description="Heldout prompts also decoded greedily by the target alone and compared token for token "
        "with the drafted outputs: speculative decoding must not change a greedy answer. Both engines read "
        "it.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Further arguments appended to the server's command line, e.g. "
        "`[--gpu-memory-utilization, '0.85']`.",
    )


class AcceptanceConfig(Strict):
    """The acceptance gate (asset `acceptance`): a small EAGLE-3 draft trained on the partition, measured
    against the target with greedy speculative decoding."""

    draft_tokens: int = Field(
        4,
        ge=1,
        le=16,
        description="k: draft tokens proposed per target forward, in measurement (and by default the "
        "training-time-test depth).",
    )
    train_prompts: int = Field(
        24,
        ge=1,
        description="Samples the draft trains on, taken after the heldout ones in an order fixed by a hash "
        "of their ids (the same on every run and machine).",
    )
    heldout_prompts: int = Field(
        8,
        ge=1,
        description="Samples kept out of training and measured (at most a quarter of the partition); as many "
        "training prompts are measured beside them.",
    )
    train_steps: int = Field(
        150,
        ge=1,
        description="Optimizer steps of the draft's training, the gate's fixed training budget (AdamW, a "
        "short warm-up, then cosine decay).",
    )
    ttt_steps: int | None = Field(
        None,
        ge=1,
        description="Training-time-test depth: how many steps the draft is trained to draft in a row on its "
        "own outputs; null: `draft_tokens`.",
    )
    learning_rate: float = Field(
        3e-3,
        gt=0,
        description="Peak learning rate of the draft's training.",
    )
    batch_tokens: int = Field(
        512,
        ge=16,
        description="Tokens per optimizer step (samples packed up to this many).",
    )
    draft_vocab_size: int = Field(
        4096,
        ge=16,
        description="Size of the draft's vocabulary: the target tokens seen most often in the training "
        "answers (at most the target's vocabulary).",
    )
    max_new_tokens: int = Field(
        64,
        ge=2,
        description="Tokens generated per measured prompt; the draft trains on the same opening window of "
        "each answer.",
    )
    min_train_share: float = Field(
        0.8,
        gt=0,
        le=1,
        description="The gate's threshold: the acceptance length on training prompts must reach this share "
        "of its maximum, k + 1 (the heldout prompts must also beat an untrained draft).",
    )
    compare_source_answers: bool = Field(
        True,
        description="Also train the same draft on the dataset's own answers, where at least half the "
        "training prompts have one, and measure it on the heldout prompts: the difference is what "
        "regenerating the answers buys.",
    )
    device: str = Field(
        "auto",
        description="Where the `transformers` engine runs its decoding loop: `auto`, `cpu`, `cuda` or "
        "`cuda:N`. The target itself is loaded on `hidden_states.device`, so keep the two alike; unused with "
        "`engine: vllm`.",
    )
    seed: int = Field(
        0,
        description="Seed of the draft's initialisation and of the training order, so a partition's gate is "
        "reproducible.",
    )
    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="`transformers`: this process measures the draft with its own speculative decoding loop "
        "(the target must fit the step); `vllm`: the step starts vLLM serving the target with the draft as "
        "EAGLE-3 and reads the engine's own counters (the target never enters this process).",
    )
    vllm: AcceptanceVllmConfig = Field(
        default_factory=AcceptanceVllmConfig,
        description="The vLLM server the step starts when `engine` is `vllm`.",
    )


class AutomationConfig(Strict):
    """Scheduled top-ups and the automation sensor."""

    top_up_cron: str = Field(
        "0 */6 * * *",
        description="Cron schedule (UTC) of the top-ups: at each tick, datasets under budget with prompts "
        "left get one backfill and sources changed since their ingestion are ingested again; later stages "
        "follow when their inputs change.",
    )
    enabled: bool = Field(
        False,
        description="Whether the automation sensor starts running; false leaves it stopped until it is "
        "started in the UI (top-ups buy answers).",
    )
    hidden_states: bool = Field(
        False,
        description="Let `hidden_states` follow new tokens automatically (it needs GPUs where its steps "
        "run); false leaves extraction to explicit materialisations.",
    )


class ExecutionConfig(Strict):
    """How Dagster executes a run's steps."""

    executor: Literal["in_process", "multiprocess", "k8s"] = Field(
        "in_process",
        description="`in_process`: one process runs a run's steps in turn, sharing the loaded model and "
        "tokenizer (laptops, the demo); `multiprocess`: a process per step; `k8s`: a pod per step "
        "(`k8s_job_executor`, needs dagster-k8s).",
    )
    max_concurrent_steps: int = Field(
        4,
        ge=1,
        description="Steps of one run that execute at once with `multiprocess` or `k8s`; `in_process` runs "
        "one at a time.",
    )
    k8s_api_key_secret: str = Field(
        "eagle3-openrouter",
        description="With `executor: k8s`: the Kubernetes secret holding the API key, mounted as environment "
        "variables into the pods of `responses` steps only.",
    )


class PoolsConfig(Strict):
    """Concurrency limits of the Dagster pools; `eagle3 instance` (run by `make dev` and `make demo`) writes
    them to the instance."""

    llm_api: int = Field(
        1,
        ge=1,
        description="Steps at once in the pool `llm_api`, which the `responses` steps use: 1 keeps one "
        "generating step at a time (it may serve every dataset).",
    )
    gpu: int = Field(
        1,
        ge=1,
        description="Steps at once in the pool `gpu`, which the `hidden_states` shard steps and the "
        "`acceptance` steps use: raise it to as many GPU steps as the machines can run at once (an "
        "acceptance server with vLLM takes a whole node).",
    )


class ProjectConfig(Strict):
    """The whole config file."""

    storage: StorageConfig = Field(
        default_factory=StorageConfig,
        description="Where every output lands: a local folder or an object store.",
    )
    target: TargetConfig = Field(
        default_factory=TargetConfig,
        description="The target model: its tokenizer and chat template, its weights, and how they are "
        "loaded.",
    )
    backend: BackendName = Field(
        "local",
        description="Which backend answers the prompts: `local` (the target in this process), `openrouter` "
        "(OpenRouter or any OpenAI-compatible server) or `sglang` (an SGLang server). The environment "
        "variable `EAGLE3_BACKEND` overrides it; answers from every backend count toward the same budgets.",
    )
    backends: BackendsConfig = Field(
        default_factory=BackendsConfig,
        description="Settings of each backend, by name; only the one `backend` names is used.",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="How the target samples its answers, for every dataset that sets no `sampling` of its "
        "own.",
    )
    datasets: dict[str, DatasetConfig] = Field(
        description="The datasets by key, at least one. Each key is a partition key of every asset (letters, "
        "digits, `_`, `.` and `-`, at most 64 characters).",
    )
    tokens: TokensConfig = Field(
        default_factory=TokensConfig,
        description="The tokens stage: how each answer becomes `input_ids` and `loss_mask`.",
    )
    checks: ChecksConfig = Field(
        default_factory=ChecksConfig,
        description="Thresholds of the asset checks.",
    )
    hidden_states: HiddenStatesConfig = Field(
        default_factory=HiddenStatesConfig,
        description="Extraction of the target's hidden states (the `hidden_states` asset).",
    )
    acceptance: AcceptanceConfig = Field(
        default_factory=AcceptanceConfig,
        description="The acceptance gate (the `acceptance` asset): a small EAGLE-3 draft trained on the "
        "partition and measured against the target with greedy speculative decoding.",
    )
    automation: AutomationConfig = Field(
        default_factory=AutomationConfig,
        description="Scheduled top-ups and the automation sensor.",
    )
    pools: PoolsConfig = Field(
        default_factory=PoolsConfig,
        description="Concurrency limits of the Dagster pools; `eagle3 instance` (run by `make dev` and `make "
        "demo`) writes them to the instance.",
    )
    execution: ExecutionConfig = Field(
        default_factory=ExecutionConfig,
        description="How Dagster executes a run's steps.",
    )
    base_dir: str = Field(
        "",
        exclude=True,
        description="Folder of the config file, set by the loader (not a key of the file): relative paths "
        "resolve against it.",
    )

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
                f"{path}: unknown key '{loc}' (check the spelling; every key is listed in "
                f"{DOCS_CONFIG_REFERENCE})"
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
