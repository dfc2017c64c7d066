"""The launch guard's decisions, the run coordinator on a real instance built from the shipped instance file,
the same check inside a run that skipped the coordinator, and every shipped instance config carrying it. The
launches through a running `dagster dev` (GraphQL, backfill, sensor, schedule) are in
test_e2e_launch_safety.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.instance.config import dagster_instance_config
from dagster._core.run_coordinator import RunCoordinator
from dagster._core.storage import tags as dagster_tags
from dagster._core.test_utils import create_run_for_test, in_process_test_workspace
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._serdes import ConfigurableClassData

from eagle3_assets.config import load_config
from eagle3_assets.definitions import build_definitions
from eagle3_assets.instance import LAUNCH_GUARD, ONE_RUN_PER_DATASET, ensure_launch_guard, ensure_run_limit
from eagle3_assets.launch_guard import (
    LAUNCHER_TAGS,
    REFUSED_TAG,
    RESOURCE_SECTIONS,
    LaunchGuardRunCoordinator,
    refusal_message,
    refusals,
)

from .support.guard_probe import HOSTILE_K8S_CONFIG, HOSTILE_TAGS
from .support.projects import REPO, make_project, user_rows

IMAGE = "registry.example.com/eagle3-assets:0.1.0"


def _dagster_system_tags() -> list[str]:
    """Every run tag Dagster itself defines (backfills, partitions, schedules, sensors, retries, ...): the
    constants of dagster._core.storage.tags, a prefix given a suffix."""
    keys = []
    for name, value in vars(dagster_tags).items():
        if name.isupper() and isinstance(value, str) and value.startswith(("dagster/", ".dagster/")):
            keys.append(value + "x" if value.endswith("/") else value)
    assert len(keys) > 30 and "dagster/backfill" in keys and "dagster/schedule_name" in keys
    return keys


def test_dagsters_own_tags_and_plain_tags_pass_except_the_image():
    passing = [k for k in _dagster_system_tags() if k != dagster_tags.DOCKER_IMAGE_TAG]
    passing += ["owner", "note", "user", "kind", "dagster/partition/dataset", "eagle3/source"]
    assert refusals(dict.fromkeys(passing, "v"), {}) == []
    assert [r.what for r in refusals({dagster_tags.DOCKER_IMAGE_TAG: IMAGE}, {})] == ["run tag dagster/image"]


@pytest.mark.parametrize(
    "key",
    [
        *LAUNCHER_TAGS,
        # Namespaces of integrations, with keys nobody listed: refused all the same (allowlist).
        "dagster-k8s/any_future_key",
        "dagster-docker/container_kwargs",
        "dagster-ray/runtime_env",
        "ecs/new_override",
        "team/owner",
    ],
)
def test_a_tag_a_launcher_or_executor_reads_is_refused(key):
    found = refusals({key: "{}", "owner": "me", "dagster/partition": "B1"}, {})
    assert [r.what for r in found] == [f"run tag {key}"] and found[0].tag


@pytest.mark.parametrize(
    ("run_config", "refused"),
    [
        ({"ops": {"responses": {"config": {"limit": 3}}}}, []),
        ({"loggers": {"console": {"config": {"log_level": "DEBUG"}}}}, []),
        ({"resources": {}, "execution": {}}, []),
        (
            {"resources": {"io_manager": {"config": {"base_dir": "/tmp/x"}}}},
            ["resources.io_manager (base_dir)"],
        ),
        (
            {"resources": {"inference": {}, "storage": {"config": {"root": "/"}}}},
            ["resources.inference", "resources.storage (root)"],
        ),
        ({"execution": {"config": {"multiprocess": {"max_concurrent": 99}}}}, ["execution"]),
    ],
)
def test_run_config_may_set_ops_and_loggers_only(run_config, refused):
    assert [r.what for r in refusals({}, run_config)] == refused


def test_the_message_names_the_tag_and_the_file_to_edit_never_a_value(tmp_path):
    message = refusal_message(refusals({**HOSTILE_TAGS, "owner": "me"}, {}))
    assert "run tag dagster-k8s/config" in message and "deploy/k8s/values.yaml" in message
    assert "attacker" not in message and HOSTILE_K8S_CONFIG not in message and "owner" not in message
    config = str(tmp_path / "eagle3.yaml")
    message = refusal_message(
        refusals({}, {"resources": {"inference": {"config": {"base_url": "x"}}}}), config
    )
    assert "may not set resources.inference (base_url)" in message and "backend / backends" in message
    assert config in message and "deploy/k8s" not in message


def test_every_resource_of_the_definitions_is_locked_and_every_step_needs_one(tmp_path):
    """The check inside a run lives in the resources: every step of every job must start one."""
    config = make_project(tmp_path, {"B1": {"rows": user_rows(["x"])}})
    defs = build_definitions(load_config(config), str(config))
    locked = set(defs.resources)
    assert locked == {*RESOURCE_SECTIONS, "io_manager"}
    jobs = [*defs.resolve_all_job_defs()]
    assert {"training_data", "hidden_states_job", "acceptance_job"} <= {j.name for j in jobs}
    for job in jobs:
        assert refusals(job.tags, dict(job.run_config or {})) == [], job.name  # code-set tags pass too
        for op in job.all_node_defs:
            if isinstance(op, dg.OpDefinition):
                needs = set(op.required_resource_keys) | {o.io_manager_key for o in op.output_defs}
                assert needs & locked, f"{job.name}: step {op.name} starts no locked resource"


# ---------------------------------------------------------------- the run coordinator on a real instance


@pytest.fixture
def guarded(tmp_path):
    """An instance from the shipped deploy/local/dagster.yaml and a workspace holding the probe location."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "local" / "dagster.yaml", home / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        origin = LoadableTargetOrigin(module_name="tests.support.guard_probe", working_directory=str(REPO))
        with in_process_test_workspace(instance, origin) as workspace:
            (location,) = workspace.code_locations
            job = location.get_repository("__repository__").get_full_job("probe_job")

            def submit(tags, run_config=None, parent=None):
                run = create_run_for_test(
                    instance,
                    job_name="probe_job",
                    tags={**tags, **({"dagster/parent_run_id": parent.run_id} if parent else {})},
                    run_config=run_config,
                    parent_run_id=parent.run_id if parent else None,
                    root_run_id=parent.run_id if parent else None,
                    remote_job_origin=job.get_remote_origin(),
                    job_code_origin=job.get_python_origin(),
                    job_snapshot=job.job_snapshot,
                )
                instance.submit_run(run.run_id, workspace)  # as every launch path calls it
                return instance.get_run_by_id(run.run_id)

            yield instance, submit


def test_the_shipped_local_instance_refuses_a_launcher_tag_and_queues_the_rest(guarded):
    instance, submit = guarded
    assert isinstance(instance.run_coordinator, LaunchGuardRunCoordinator)
    refused = submit({**HOSTILE_TAGS, "dagster/partition": "B1"})
    assert (
        refused.status == dg.DagsterRunStatus.FAILURE
        and refused.tags[REFUSED_TAG] == "run tag dagster-k8s/config"
    )
    events = [e.dagster_event.event_type_value for e in instance.all_logs(refused.run_id) if e.dagster_event]
    assert events == ["PIPELINE_FAILURE"]  # never enqueued: no launcher ever sees it
    (failure,) = [e.message for e in instance.all_logs(refused.run_id)]
    assert "run tag dagster-k8s/config" in failure and "deploy/k8s/values.yaml" in failure
    assert "attacker" not in failure
    io = submit({}, {"resources": {"io_manager": {"config": {"base_dir": "/tmp/elsewhere"}}}})
    assert io.status == dg.DagsterRunStatus.FAILURE and "resources.io_manager" in io.tags[REFUSED_TAG]
    plain = submit({"dagster/partition": "B1", "dagster/backfill": "abc", "owner": "me"}, {"ops": {}})
    assert plain.status == dg.DagsterRunStatus.QUEUED and REFUSED_TAG not in plain.tags


def test_a_reexecution_keeps_the_image_its_launcher_wrote_and_nothing_else(guarded):
    """The UI re-executes with its parent's tags: under K8sRunLauncher, the image the launcher wrote."""
    instance, submit = guarded
    parent = submit({"dagster/partition": "B1"})
    assert parent.status == dg.DagsterRunStatus.QUEUED
    instance.add_run_tags(parent.run_id, {"dagster/image": IMAGE})  # what K8sRunLauncher writes at launch
    parent = instance.get_run_by_id(parent.run_id)
    assert submit(dict(parent.tags), parent=parent).status == dg.DagsterRunStatus.QUEUED
    other = submit({**parent.tags, "dagster/image": "attacker.example/x"}, parent=parent)
    assert other.status == dg.DagsterRunStatus.FAILURE and other.tags[REFUSED_TAG] == "run tag dagster/image"
    # A run refused for the image it was given cannot pass it on by being re-executed.
    chosen = submit({"dagster/image": "attacker.example/x"})
    assert chosen.status == dg.DagsterRunStatus.FAILURE
    assert submit(dict(chosen.tags), parent=chosen).status == dg.DagsterRunStatus.FAILURE
    # Nor can a launcher tag other than one a launcher writes ride along with a re-execution.
    assert submit({**parent.tags, **HOSTILE_TAGS}, parent=parent).status == dg.DagsterRunStatus.FAILURE


# ---------------------------------------------------------------- inside a run that skipped the coordinator


def test_a_run_that_skipped_the_coordinator_fails_before_any_step_does_work(tmp_path):
    """`dagster asset materialize --tags ...`, or an instance without the guard: the same message from every
    resource, and no step writes anything. The tags a launcher writes itself pass."""
    config = make_project(tmp_path, {"B1": {"rows": user_rows(["x", "y"])}})
    defs = build_definitions(load_config(config), str(config))
    job = defs.resolve_implicit_global_asset_job_def().get_subset(asset_selection={dg.AssetKey("prompts")})
    prompts = tmp_path / "data" / "B1" / "prompts.parquet"
    with dg.instance_for_test() as instance:
        for tags, run_config, what in [
            (HOSTILE_TAGS, {}, "run tag dagster-k8s/config"),
            (
                {},
                {"resources": {"io_manager": {"config": {"base_dir": str(tmp_path)}}}},
                "resources.io_manager",
            ),
        ]:
            result = job.execute_in_process(
                partition_key="B1", tags=tags, run_config=run_config, instance=instance, raise_on_error=False
            )
            assert not result.success
            assert not [e for e in result.all_events if e.event_type_value == "STEP_START"]
            errors = [
                e.event_specific_data.error
                for e in result.all_events
                if e.is_failure or e.event_type_value == "RESOURCE_INIT_FAILURE"
            ]
            text = "\n".join(
                c.message for err in errors if err for c in [err, *([err.cause] if err.cause else [])]
            )
            assert what in text and str(config) in text, text[-2000:]
            assert not prompts.exists()
        result = job.execute_in_process(
            partition_key="B1", tags={"dagster/image": IMAGE, "owner": "me"}, instance=instance
        )
        assert result.success and prompts.exists()


# ---------------------------------------------------------------- the shipped instance configs


def test_every_shipped_instance_config_carries_the_guard(monkeypatch):
    for name in ("local", "postgres"):
        for var in ("HOST", "PORT", "USERNAME", "PASSWORD", "DB"):
            monkeypatch.setenv(f"DAGSTER_PG_{var}", "5432" if var == "PORT" else "x")
        doc = dagster_instance_config(str(REPO / "deploy" / name))[0]  # Dagster's own validation of the file
        coordinator = doc["run_coordinator"]
        assert {k: coordinator[k] for k in LAUNCH_GUARD} == LAUNCH_GUARD, name
        built = ConfigurableClassData(
            coordinator["module"], coordinator["class"], yaml.safe_dump(coordinator["config"])
        )
        assert isinstance(built.rehydrate(as_type=RunCoordinator), LaunchGuardRunCoordinator)
    values = yaml.safe_load((REPO / "deploy" / "k8s" / "values.yaml").read_text())
    rc = values["dagsterDaemon"]["runCoordinator"]
    assert rc["enabled"] and rc["type"] == "CustomRunCoordinator"
    custom = rc["config"]["customRunCoordinator"]
    assert {k: custom[k] for k in LAUNCH_GUARD} == LAUNCH_GUARD
    built = ConfigurableClassData(custom["module"], custom["class"], yaml.safe_dump(custom["config"]))
    coordinator = built.rehydrate(as_type=RunCoordinator)  # the chart passes this config as it stands
    assert isinstance(coordinator, LaunchGuardRunCoordinator)
    assert ONE_RUN_PER_DATASET in coordinator.get_run_queue_config().tag_concurrency_limits
    # The webserver and the daemon import the guard: they run the project's image.
    image = values["dagster-user-deployments"]["deployments"][0]["image"]
    assert values["dagsterWebserver"]["image"] == image == values["dagsterDaemon"]["image"]


def test_eagle3_instance_puts_the_guard_in_place_of_dagsters_queued_coordinator(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    queued = {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}
    (home / "dagster.yaml").write_text(
        yaml.safe_dump({"run_coordinator": {**queued, "config": {"dequeue_interval_seconds": 2}}})
    )
    assert ensure_launch_guard(home)[0]
    doc = yaml.safe_load((home / "dagster.yaml").read_text())
    assert doc["run_coordinator"] == {**LAUNCH_GUARD, "config": {"dequeue_interval_seconds": 2}}
    assert ensure_launch_guard(home) == (True, f"launch guard: already in {home / 'dagster.yaml'}")
    ensure_run_limit(home)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert isinstance(instance.run_coordinator, LaunchGuardRunCoordinator)
        assert instance.run_coordinator.dequeue_interval_seconds == 2
    # Another coordinator is not replaced behind its owner's back: reported, the file untouched.
    other = Path(tmp_path / "other")
    other.mkdir()
    text = yaml.safe_dump({"run_coordinator": {"module": "my_platform.coordinators", "class": "Custom"}})
    (other / "dagster.yaml").write_text(text)
    guarded, message = ensure_launch_guard(other)
    assert (
        not guarded
        and "my_platform.coordinators.Custom" in message
        and "eagle3_assets.launch_guard" in message
    )
    assert (other / "dagster.yaml").read_text() == text
