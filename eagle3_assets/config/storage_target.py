"""Where outputs land (`storage`) and which target model answers and is read (`target`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from .base import BUILTIN_SMOLLM2, DOCS_CONFIG, Strict


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
    context_length: int | None = Field(
        None,
        ge=1,
        description="The most tokens one request to the target may hold, prompt and answer together. The "
        "prompts stage quarantines a prompt that leaves no room for an answer in it, before it is sent (the "
        "reason names its token count and this limit). Null: `max_position_embeddings` from the config.json "
        "of `model` (then of `tokenizer`): the embedded model's, a local folder's, or the hub repository's "
        "at `revision`. Set it where the serving side allows less than the model (vLLM's `--max-model-len`, "
        "a provider's context length) or where no config.json can be read.",
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
