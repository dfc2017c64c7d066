"""Operations wiring: pools applied from the config, pools and GPU tags on the steps, executors from the
config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dagster as dg

from eagle3_assets.assets.hidden_states import GPU_STEP_TAGS
from eagle3_assets.config import load_config
from eagle3_assets.definitions import build_definitions

from .support.projects import REPO, make_project, user_rows


def test_pool_limits_from_the_config_are_applied_to_the_instance(tmp_path):
    config = make_project(tmp_path, {"B1": {"rows": user_rows(["x"])}}, pools={"llm_api": 3, "gpu": 5})
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "--config", str(config), "instance"],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.event_log_storage.get_concurrency_info("llm_api").slot_count == 3
        assert instance.event_log_storage.get_concurrency_info("gpu").slot_count == 5
        # One run per dataset: the per-partition run-tag limit the queued run coordinator enforces, here the
        # launch guard (eagle3 instance named it where the file named none).
        assert type(instance.run_coordinator).__name__ == "LaunchGuardRunCoordinator"
        limits = instance.get_concurrency_config().run_queue_config.tag_concurrency_limits
        assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1} in limits


def test_steps_carry_their_pools_and_gpu_requests(tmp_path):
    config = make_project(
        tmp_path,
        {"B1": {"rows": user_rows(["x"])}},
        execution={"executor": "multiprocess", "max_concurrent_steps": 3},
    )
    defs = build_definitions(load_config(config), str(config))
    assert defs.resolve_asset_graph().get(dg.AssetKey("responses")).pools == {"llm_api"}
    ops = {n.name: n.definition for n in defs.resolve_assets_def("hidden_states").node_def.nodes}
    shard_op = ops["extract_hidden_state_shard"]
    assert shard_op.pool == "gpu"
    k8s = json.loads(shard_op.tags["dagster-k8s/config"])  # read by k8s_job_executor: one GPU per shard step
    assert k8s == GPU_STEP_TAGS["dagster-k8s/config"]
    assert k8s["container_config"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert defs.resolve_job_def("training_data").executor_def.name == "multiprocess"
    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}
    stages = [
        "prompts",
        "responses",
        "tokens",
        "validation_report",
        "hidden_states",
        "acceptance",
        "overview",
        "data_value",
    ]
    assert {k: s.group_name for k, s in specs.items()} == dict.fromkeys(stages, "eagle3")
    gate = defs.resolve_assets_def("acceptance").op  # the gate trains and runs the target: a GPU step
    assert gate.pool == "gpu" and json.loads(gate.tags["dagster-k8s/config"]) == k8s
    value = defs.resolve_assets_def("data_value").op  # trains and measures drafts too: sized as the gate
    assert value.pool == "gpu" and json.loads(value.tags["dagster-k8s/config"]) == k8s
    assert all(s.description for s in specs.values()) and all(s.kinds for s in specs.values())


def _k8s_executor_config(config) -> tuple[dict, dg.Definitions]:
    from eagle3_assets.k8s import k8s_executor_config

    cfg = load_config(config)
    defs = build_definitions(cfg, str(config))
    return k8s_executor_config(cfg, [*defs.assets, *defs.asset_checks]), defs


def test_under_kubernetes_the_key_reaches_only_the_responses_pods(tmp_path):
    import yaml

    config = make_project(
        tmp_path,
        {"B1": {"rows": user_rows(["x"])}},
        execution={"executor": "k8s", "k8s_api_key_secret": "my-key"},
    )
    executor, defs = _k8s_executor_config(config)
    assert defs.resolve_job_def("training_data").executor_def.name == "k8s"
    holders = [op for op, c in executor["per_step_k8s_config"].items() if "my-key" in json.dumps(c)]
    assert holders == ["responses"]
    assert executor["per_step_k8s_config"]["responses"]["container_config"]["env_from"] == [
        {"secret_ref": {"name": "my-key"}}
    ]
    assert "my-key" not in json.dumps(executor["step_k8s_config"])  # every other step: never
    assert "dagster-k8s/config" not in defs.resolve_assets_def("responses").op.tags  # nor on an op's tag
    values = yaml.safe_load((REPO / "deploy" / "k8s" / "values.yaml").read_text())
    assert "envSecrets" not in values["runLauncher"]["config"]["k8sRunLauncher"]
    assert all("envSecrets" not in d for d in values["dagster-user-deployments"]["deployments"])
    k8s_cfg = yaml.safe_load((REPO / "deploy" / "k8s" / "eagle3.k8s.yaml").read_text())
    assert k8s_cfg["execution"]["executor"] == "k8s" and k8s_cfg["execution"]["k8s_api_key_secret"]


def test_under_kubernetes_steps_are_sized_per_kind_from_the_config(tmp_path):
    """Every step gets the `cpu` kind's requests (none keeps the run pod's), pool `gpu` its GPUs; the
    acceptance step serving the target in vLLM asks for the GPUs its server spans."""
    sizes = {
        "cpu": {"cpu": "3", "memory": "5Gi"},
        "responses": {"cpu": "6", "memory": "7Gi"},
        "gpu": {"cpu": "9", "memory": "11Gi", "gpus": 2, "shm": "1Gi"},
    }
    config = make_project(
        tmp_path,
        {"B1": {"rows": user_rows(["x"])}},
        execution={"executor": "k8s", "k8s_steps": sizes},
        acceptance={"engine": "vllm", "vllm": {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}},
    )
    executor, defs = _k8s_executor_config(config)
    assert executor["step_k8s_config"]["container_config"]["resources"] == {
        "requests": {"cpu": "3", "memory": "5Gi"},
        "limits": {"memory": "5Gi"},
    }
    per_step = executor["per_step_k8s_config"]
    gpu_ops = {
        n.name
        for a in defs.assets
        for n in (a.node_def.nodes if isinstance(a.node_def, dg.GraphDefinition) else [a.node_def])
        if getattr(n, "definition", n).pool == "gpu"
    }
    assert {"extract_hidden_state_shard", "acceptance"} <= gpu_ops
    for op in gpu_ops:
        resources = per_step[op]["container_config"]["resources"]
        want = "8" if op == "acceptance" else "2"  # tensor x pipeline parallel size; else gpu.gpus
        assert resources["requests"] == {"cpu": "9", "memory": "11Gi", "nvidia.com/gpu": want}, op
        assert resources["limits"] == {"memory": "11Gi", "nvidia.com/gpu": want}, op
        assert per_step[op]["pod_spec_config"]["volumes"][0]["empty_dir"]["size_limit"] == "1Gi"
    assert per_step["responses"]["container_config"]["resources"]["requests"] == {"cpu": "6", "memory": "7Gi"}
    assert set(per_step) == gpu_ops | {"hidden_states_hidden_states_spot_check", "responses"}


def test_pod_sizes_must_be_kubernetes_quantities(tmp_path):
    import pytest

    from eagle3_assets.config import ConfigError

    for bad in ({"cpu": {"cpu": "two", "memory": "4Gi"}}, {"gpu": {"cpu": "1", "memory": "4Gi", "gpus": 0}}):
        config = make_project(
            tmp_path, {"B1": {"rows": user_rows(["x"])}}, execution={"executor": "k8s", "k8s_steps": bad}
        )
        with pytest.raises(ConfigError, match="k8s_steps"):
            load_config(config)


def test_every_shipped_instance_carries_the_one_run_per_dataset_limit():
    """The instance files under deploy/ are YAML the platform cannot import: each is held to the one owner."""
    import yaml

    from eagle3_assets.instance import ONE_RUN_PER_DATASET

    for name in ("local", "postgres"):
        doc = yaml.safe_load((REPO / "deploy" / name / "dagster.yaml").read_text())
        assert ONE_RUN_PER_DATASET in doc["concurrency"]["runs"]["tag_concurrency_limits"], name
    values = yaml.safe_load((REPO / "deploy" / "k8s" / "values.yaml").read_text())
    guard = values["dagsterDaemon"]["runCoordinator"]["config"]["customRunCoordinator"]  # the launch guard
    assert ONE_RUN_PER_DATASET in guard["config"]["tag_concurrency_limits"]
