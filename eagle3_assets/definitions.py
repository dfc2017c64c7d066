"""The one Definitions object: assets, checks, resources, jobs and automation, all built from eagle3.yaml."""

from __future__ import annotations

import warnings

import dagster as dg

from resources import (
    InferenceResource,
    LocalInference,
    OpenRouterInference,
    ProjectConfigResource,
    SGLangInference,
    StorageJsonIOManager,
    StorageResource,
    TargetTokenizerResource,
)

from .assets import (
    build_hidden_states_asset,
    build_prompts_asset,
    build_report_asset,
    build_responses_asset,
    build_tokens_asset,
)
from .automation import automation_sensor, follow_upstream, top_up_condition
from .checks import build_checks
from .config import ProjectConfig, get_config
from .partitions import dataset_partitions

# Per-partition asset checks are a 1.13 preview; the project relies on them knowingly.
warnings.filterwarnings("ignore", category=dg.PreviewWarning)
warnings.filterwarnings("ignore", category=dg.BetaWarning)

TRAINING_DATA_JOB = "training_data"
HIDDEN_STATES_JOB = "hidden_states_job"
OFFLINE_STAGES = ["prompts", "responses", "tokens", "validation_report"]


def build_inference(cfg: ProjectConfig) -> InferenceResource:
    """The configured backend's resource (EAGLE3_BACKEND overrides `backend`)."""
    b = cfg.backends
    if cfg.backend == "local":
        return LocalInference(
            model=cfg.target.model,
            device=b.local.device,
            batch_size=b.local.batch_size,
            trust_remote_code=cfg.target.trust_remote_code,
            base_dir=cfg.base_dir,
            max_concurrency=2 * b.local.batch_size,
            max_retries=b.local.max_retries,
        )
    if cfg.backend == "openrouter":
        o = b.openrouter
        return OpenRouterInference(
            base_url=o.base_url,
            api_key_env=o.api_key_env,
            model=o.model,
            provider=o.provider,
            reasoning=o.reasoning,
            extra_body=o.extra_body,
            request_timeout_s=o.request_timeout_s,
            max_concurrency=o.max_concurrency,
            max_retries=o.max_retries,
            app_url=o.app_url,
            app_title=o.app_title,
        )
    s = b.sglang
    return SGLangInference(
        base_url=s.base_url,
        request_timeout_s=s.request_timeout_s,
        max_concurrency=s.max_concurrency,
        max_retries=s.max_retries,
        extra_sampling_params=s.extra_sampling_params,
    )


def build_resources(cfg: ProjectConfig, config_path: str) -> dict[str, object]:
    t = cfg.target
    return {
        "project": ProjectConfigResource(path=config_path, backend=cfg.backend),
        "storage": StorageResource(root=str(cfg.storage_root)),
        "target": TargetTokenizerResource(
            tokenizer=t.tokenizer,
            trust_remote_code=t.trust_remote_code,
            revision=t.revision,
            chat_template_kwargs=t.chat_template_kwargs,
            end_of_turn_token=t.end_of_turn_token,
            end_of_turn_id=t.end_of_turn_id,
            think_open=t.think_open,
            think_close=t.think_close,
            base_dir=cfg.base_dir,
        ),
        "inference": build_inference(cfg),
        "hidden_states_io": StorageJsonIOManager(root=str(cfg.storage_root)),
    }


def build_executor(cfg: ProjectConfig) -> dg.ExecutorDefinition:
    ex = cfg.execution
    if ex.executor == "multiprocess":
        return dg.multiprocess_executor.configured({"max_concurrent": ex.max_concurrent_steps})
    if ex.executor == "k8s":
        from dagster_k8s import k8s_job_executor  # installed in the Kubernetes image (deploy/k8s)

        return k8s_job_executor.configured({"max_concurrent": ex.max_concurrent_steps})
    return dg.in_process_executor


def build_definitions(cfg: ProjectConfig, config_path: str) -> dg.Definitions:
    partitions = dataset_partitions(cfg)
    follow = follow_upstream()
    assets = [
        build_prompts_asset(
            partitions, top_up_condition(cfg.automation.top_up_cron, config_path, cfg.backend)
        ),
        build_responses_asset(partitions, follow),
        build_tokens_asset(partitions, follow),
        build_report_asset(partitions, follow),
        build_hidden_states_asset(partitions, follow if cfg.automation.hidden_states else None),
    ]
    training_data = dg.define_asset_job(
        TRAINING_DATA_JOB,
        selection=dg.AssetSelection.assets(*OFFLINE_STAGES),
        partitions_def=partitions,
        description="prompts → responses → tokens → validation_report for one dataset (the main job).",
    )
    hidden_states_job = dg.define_asset_job(
        HIDDEN_STATES_JOB,
        selection=dg.AssetSelection.assets("hidden_states"),
        partitions_def=partitions,
        description="hidden_states for one dataset (GPU; one step per shard).",
    )
    return dg.Definitions(
        assets=assets,
        asset_checks=build_checks(partitions),
        jobs=[training_data, hidden_states_job],
        sensors=[automation_sensor(cfg.automation.enabled)],
        resources=build_resources(cfg, config_path),
        executor=build_executor(cfg),
    )


def _load() -> dg.Definitions:
    from .config import config_path

    return build_definitions(get_config(), str(config_path()))


defs = _load()
