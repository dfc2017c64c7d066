"""The one Definitions object: assets, checks, resources, jobs and automation, all built from eagle3.yaml."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import dagster as dg

from resources import (
    Inference,
    Project,
    Storage,
    StorageJsonIOManager,
    Target,
    locked,
    locked_default_io_manager,
)

from .assets import (
    build_acceptance_asset,
    build_checks,
    build_data_value_asset,
    build_hidden_states_asset,
    build_overview_asset,
    build_prompts_asset,
    build_report_asset,
    build_responses_asset,
    build_tokens_asset,
)
from .automation import automation_sensor, follow_upstream, ingest_condition, top_up_condition
from .config import ProjectConfig, config_path, get_config
from .k8s import k8s_executor_config
from .launch_guard import RESOURCE_SECTIONS
from .partitions import dataset_partitions

# Notices of features the project relies on knowingly, each named: per-partition asset checks (preview), one
# run per backfill (`backfill_policy`, beta), data versions on outputs (beta), the automation sensor in the
# user code server (beta), and that a job backfill of training_data runs a run per partition (one run over
# many partitions is the responses asset's own policy). Any other notice shows; the tests add the same list to
# pytest's filters.
KNOWN_NOTICES: tuple[tuple[str, type[Warning]], ...] = (
    (r"Specifying a partitions_def on an AssetCheckSpec is currently in preview", dg.PreviewWarning),
    (r"Parameter `backfill_policy` of function `asset` is currently in beta", dg.BetaWarning),
    (r"Parameter `data_version` of initializer `Output.__init__` is currently in beta", dg.BetaWarning),
    (r"Parameter `use_user_code_server` of initializer `AutomationConditionSensorDefinition", dg.BetaWarning),
    (r"Asset job training_data materializes assets with varying BackfillPolicies", UserWarning),
)
for _message, _category in KNOWN_NOTICES:
    warnings.filterwarnings("ignore", message=_message, category=_category)


TRAINING_DATA_JOB = "training_data"
HIDDEN_STATES_JOB = "hidden_states_job"
ACCEPTANCE_JOB = "acceptance_job"
DATA_VALUE_JOB = "data_value_job"
OFFLINE_STAGES = ["prompts", "responses", "tokens", "validation_report"]


def build_runtime(cfg: ProjectConfig, config_path: str) -> dict[str, object]:
    """Resource key -> the adapter of one outside system, built from the one validated config (the CLI uses
    these objects directly)."""
    storage = Storage(cfg)
    return {
        "project": Project(cfg, Path(config_path)),
        "storage": storage,
        "target": Target(cfg),
        "inference": Inference(cfg),
        "hidden_states_io": StorageJsonIOManager(cfg.storage_root, storage.remote),
    }


def build_resources(cfg: ProjectConfig, config_path: str) -> dict[str, object]:
    """The runtime objects as resources that accept no run config: they come from the config file only. The
    default `io_manager` too, declared so that a launch cannot configure Dagster's own."""
    resources: dict[str, object] = {
        name: locked(obj, name, config_path, RESOURCE_SECTIONS[name])
        for name, obj in build_runtime(cfg, config_path).items()
    }
    resources["io_manager"] = locked_default_io_manager(config_path)
    return resources


def build_executor(
    cfg: ProjectConfig,
    nodes: Sequence[dg.AssetsDefinition | dg.AssetChecksDefinition] = (),
    config_path: str = "",
) -> dg.ExecutorDefinition:
    """The executor `execution.executor` names; `nodes` (the assets and checks it runs) size the pods of
    `k8s_job_executor` per kind of step (eagle3_assets.k8s) and place the GPU steps of the `ray` executor
    (eagle3_assets.ray_steps), which hands every step the config file at `config_path`."""
    ex = cfg.execution
    if ex.executor == "ray":
        from .ray_steps import ray_executor  # the `ray` extra: dagster-ray and Ray

        return ray_executor(cfg, config_path, nodes)
    if ex.executor == "multiprocess":
        return dg.multiprocess_executor.configured({"max_concurrent": ex.max_concurrent_steps})
    if ex.executor == "k8s":
        from dagster_k8s import k8s_job_executor  # installed in the Kubernetes image (deploy/k8s)

        return k8s_job_executor.configured(k8s_executor_config(cfg, nodes))
    return dg.in_process_executor


def build_definitions(cfg: ProjectConfig, config_path: str) -> dg.Definitions:
    partitions = dataset_partitions(cfg)
    follow = follow_upstream()
    cron = cfg.automation.top_up_cron
    assets = [
        build_prompts_asset(partitions, ingest_condition(cron, config_path, cfg.backend)),
        build_responses_asset(partitions, top_up_condition(cron, config_path, cfg.backend)),
        build_tokens_asset(partitions, follow),
        build_report_asset(partitions, follow),
        build_hidden_states_asset(
            partitions,
            follow if cfg.automation.hidden_states else None,
            cfg.hidden_states.engine,
            cfg.hidden_states.vllm.managed,
        ),
        build_acceptance_asset(partitions),
        build_overview_asset(),
        build_data_value_asset(),
    ]
    training_data = dg.define_asset_job(
        TRAINING_DATA_JOB,
        selection=dg.AssetSelection.assets(*OFFLINE_STAGES),
        description="prompts → responses → tokens → validation_report for one dataset (the main job).",
    )
    hidden_states_job = dg.define_asset_job(
        HIDDEN_STATES_JOB,
        selection=dg.AssetSelection.assets("hidden_states"),
        description="hidden_states for one dataset (GPU; one step per shard).",
    )
    acceptance_job = dg.define_asset_job(
        ACCEPTANCE_JOB,
        selection=dg.AssetSelection.assets("acceptance"),
        description="The acceptance gate for one dataset: a small EAGLE-3 draft trained on its hidden "
        "states, measured against the target (GPU pool; CPU for the embedded target).",
    )
    data_value_job = dg.define_asset_job(
        DATA_VALUE_JOB,
        selection=dg.AssetSelection.assets("data_value"),
        description="What each dataset buys: drafts per dataset, on all and (opt-in) on all but each, "
        "measured on a common held-out suite beside what each dataset cost (not partitioned).",
    )
    checks = build_checks(partitions, reference_ids=cfg.backend != "openrouter")
    return dg.Definitions(
        assets=assets,
        asset_checks=checks,
        jobs=[training_data, hidden_states_job, acceptance_job, data_value_job],
        sensors=[automation_sensor(cfg.automation.enabled)],
        resources=build_resources(cfg, config_path),
        executor=build_executor(cfg, [*assets, *checks], config_path),
    )


@dg.definitions
def defs() -> dg.Definitions:
    """Built when Dagster loads the code location, from the config this process was given (`EAGLE3_CONFIG`,
    else ./eagle3.yaml, else the checkout's): importing this module reads no config."""
    return build_definitions(get_config(), str(config_path()))
