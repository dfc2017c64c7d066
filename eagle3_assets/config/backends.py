"""How answers are sampled (`sampling`) and the backends that produce them (`backends`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from .base import DOCS_BACKENDS, Strict, is_loopback


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
        "`moonshotai/kimi-k2.5`); preflight checks that the endpoint lists it. Every answer must come back "
        "served as this model (or one `accepted_models` names): an answer from another model is never "
        "stored as an answer.",
    )
    accepted_models: list[str] = Field(
        default_factory=list,
        description="Other names under which the endpoint may report serving `model` (compared without case; "
        "`*` and `?` globs allowed), such as a dated snapshot you have checked is the target: "
        "`[moonshotai/kimi-k2.5-20260115]`. An answer served under any other name is a `foreign_model` "
        "failure, set aside and asked again, never trained. Keep it empty unless a provider reports another "
        "name for the very same weights.",
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
    accepted_models: list[str] = Field(
        default_factory=list,
        description="Model paths the server's `/model_info` may report besides `target.model` (a path whose "
        "last component is the target's name, such as `/models/Kimi-K2.5`, is accepted anyway; `*` and `?` "
        "globs allowed). Answers of a server serving anything else are never stored as answers.",
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
