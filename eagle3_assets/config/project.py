"""The whole file (`ProjectConfig`) with its operational tables: automation, execution and pools."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..core.storage.schemes import cache_folder, is_remote
from .acceptance import AcceptanceConfig
from .backends import BackendsConfig, SamplingConfig
from .base import (
    DATASET_KEY_MAX,
    RESERVED_DATASET_KEYS,
    BackendName,
    ConfigError,
    Strict,
    dataset_key_problem,
)
from .data_value import DataValueConfig, reserved_draft_name
from .datasets import ChecksConfig, DatasetConfig, TokensConfig
from .hidden_states import HiddenStatesConfig
from .k8s import K8sStepsConfig
from .storage_target import StorageConfig, TargetConfig


def _key_problem(key: str, keys: dict[str, DatasetConfig]) -> str | None:
    """Why dataset `key` is refused, naming the key and the rule: it names the partition and its folder under
    storage.root, so it must be one plain path segment (`dataset_key_problem`), not a folder the root holds
    for something else, and not the same folder as another key on a case-insensitive file system (macOS,
    Windows)."""
    problem = dataset_key_problem(key)
    if problem is None and key.lower() in RESERVED_DATASET_KEYS:
        problem = "is reserved: storage.root holds a folder of that name that is not a dataset's"
    twins = [k for k in keys if k != key and k.lower() == key.lower()]
    if problem is None and twins:
        problem = f"differs from {twins[0]!r} only in case: both would be one folder on some file systems"
    if problem is None:
        return None
    return f"dataset key {key!r} {problem} (it is a partition key and a folder name under storage.root)"


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


class RayExecutionConfig(Strict):
    """With `executor: ray`: the Ray cluster the steps run on, and what a GPU step asks it for."""

    address: str | None = Field(
        None,
        description="The cluster's job API (its dashboard address), e.g. `http://127.0.0.1:8265` or a "
        "KubeRay head service's; null: `RAY_ADDRESS` of the process that runs the run.",
    )
    gpu_step_resources: dict[str, float] = Field(
        default_factory=lambda: {"GPU": 1.0},
        description="What each GPU step (pool `gpu`: an extraction step, the acceptance gate) asks Ray for, "
        "so that Ray places it on a node that has it: `{GPU: 1}` (Ray's own GPU count; `GPU: 8` for a whole "
        "8-GPU node), or custom resources a node was started with (`ray start --resources "
        "'{\"accel\": 1}'`). Other steps ask for nothing and run on the head node.",
    )


class ExecutionConfig(Strict):
    """How Dagster executes a run's steps."""

    executor: Literal["in_process", "multiprocess", "k8s", "ray"] = Field(
        "in_process",
        description="`in_process`: one process runs a run's steps in turn, sharing the loaded model and "
        "tokenizer (laptops, the demo); `multiprocess`: a process per step; `k8s`: a pod per step "
        "(`k8s_job_executor`, needs dagster-k8s); `ray`: a Ray job per step on the cluster `ray.address` "
        "names (dagster-ray), GPU steps placed by `ray.gpu_step_resources` (the `ray` extra).",
    )
    ray: RayExecutionConfig = Field(
        default_factory=RayExecutionConfig,
        description="With `executor: ray`: the cluster and what a GPU step asks it for.",
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
    k8s_steps: K8sStepsConfig = Field(
        default_factory=K8sStepsConfig,
        description="With `executor: k8s`: what each kind of step's pod requests (CPU, memory, GPUs). The "
        "run pod's own size is the deployment's (`deploy/k8s/values.yaml`); no step inherits it.",
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
        description="The datasets by key, at least one. Each key is a partition key of every asset and the "
        f"name of its folder under `storage.root`: 1 to {DATASET_KEY_MAX} letters, digits, `_`, `-` or `.`, "
        "starting with a letter or digit, with no `..` (so `.`, `..`, paths and hidden names are refused); "
        "`data_value` is reserved, and two keys may not differ only in case.",
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
    data_value: DataValueConfig | None = Field(
        None,
        description="What the data buys (the `data_value` asset): drafts per dataset measured on a common "
        "held-out suite, beside what each dataset cost; null: the asset reports that it is not configured.",
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
        problems = [p for key in v if (p := _key_problem(key, v))]
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _data_value_fits_the_datasets(self) -> ProjectConfig:
        suite = self.data_value.suite if self.data_value else None
        if suite is not None and suite.dataset is not None and suite.dataset not in self.datasets:
            raise ValueError(
                f"data_value.suite.dataset {suite.dataset!r} is not a configured dataset "
                f"({', '.join(self.datasets)})"
            )
        clash = [k for k in self.datasets if reserved_draft_name(k)] if self.data_value else []
        if clash:
            raise ValueError(
                f"dataset key(s) {', '.join(repr(k) for k in clash)} are reserved while data_value is "
                "configured: its report names drafts `all`, `untrained` and `all-but-<key>` beside the "
                "datasets' own; rename the dataset"
            )
        return self

    # -- derived values -------------------------------------------------------------------------------------
    def resolve_path(self, p: str) -> Path:
        path = Path(os.path.expanduser(p))
        return path if path.is_absolute() else Path(self.base_dir) / path

    @property
    def storage_is_remote(self) -> bool:
        return is_remote(self.storage.root)

    @property
    def storage_root(self) -> Path:
        """The local folder of every partition: the root itself, or the working copies of an object-store
        root."""
        if self.storage_is_remote:
            return cache_folder(self.storage.root, Path(os.path.expanduser(self.storage.cache_dir)))
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
