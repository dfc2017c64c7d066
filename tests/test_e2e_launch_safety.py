"""A shared deployment is safe to launch from: through the GraphQL API of a running `dagster dev` (the
shipped local instance file, so the launch guard), a launch can neither redirect the key or the endpoint nor
choose where or how code runs (a run tag a launcher reads, an `io_manager` override), whether it comes from a
launch, a re-execution, a backfill, a sensor or a schedule; per-run knobs, ordinary launches and backfills
still work, and two backfills of one dataset never buy its answers twice."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .support.dagster_dev import DagsterDev, prepare_home
from .support.fake_servers import FakeOpenRouter
from .support.guard_probe import HOSTILE_TAGS, PROBE_TAG
from .support.projects import REPO, make_project, user_rows

KEY_ENV = "EAGLE3_TEST_OPENROUTER_KEY"
TEXTS = [f"shared question {i}" for i in range(24)]


@dataclass
class Deployment:
    dev: DagsterDev
    provider: FakeOpenRouter  # holds the key
    elsewhere: FakeOpenRouter  # where a hostile launch would send it
    config: Path
    key: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """One `dagster dev` for the module: the project (OpenRouter backend on a stand-in holding the key) and
    tests/support/guard_probe.py, whose sensor and schedule ask for runs with a launcher's tag."""
    tmp = tmp_path_factory.mktemp("launch_safety")
    key = "sk-test-" + secrets.token_hex(12)
    with FakeOpenRouter(key=key, latency=0.3) as provider, FakeOpenRouter(latency=0.0) as elsewhere:
        config = make_project(
            tmp,
            {"B1": {"rows": user_rows(TEXTS), "max_tokens": 16}},
            backend="openrouter",
            backends={
                "openrouter": {
                    "base_url": provider.base_url,
                    "api_key_env": KEY_ENV,
                    "max_concurrency": 4,
                    "stream": False,
                }
            },
        )
        # A secret of the run worker's environment that a malicious launch would like to send away.
        env = {KEY_ENV: key, "DAGSTER_PG_PASSWORD": "pg-" + secrets.token_hex(8)}
        home = tmp / "dagster_home"
        prepare_home(home, config, "local", env)  # deploy/local/dagster.yaml, then `eagle3 instance`
        workspace = tmp / "workspace.yaml"
        workspace.write_text(
            yaml.safe_dump(
                {
                    "load_from": [
                        {"python_module": {**entry, "working_directory": str(REPO)}}
                        for entry in (
                            {
                                "module_name": "eagle3_assets.definitions",
                                "attribute": "defs",
                                "location_name": "eagle3_assets",
                            },
                            {
                                "module_name": "tests.support.guard_probe",
                                "attribute": "defs",
                                "location_name": "guard_probe",
                            },
                        )
                    ]
                }
            )
        )
        with DagsterDev(config, home, env=env, workspace=workspace) as dev:
            yield Deployment(dev, provider, elsewhere, config, key, env)


@pytest.mark.slow
def test_launches_cannot_redirect_the_key_and_one_run_per_dataset(deployment):
    dev, provider, elsewhere, config = (
        deployment.dev,
        deployment.provider,
        deployment.elsewhere,
        deployment.config,
    )
    # 1. Overriding the inference resource at launch: refused before any step, naming the file to edit.
    hostile = {
        "resources": {
            "inference": {"config": {"base_url": elsewhere.base_url, "api_key_env": "DAGSTER_PG_PASSWORD"}}
        }
    }
    launched = dev.launch_run("training_data", "B1", hostile)
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    assert dev.wait_run(run_id)["status"] == "FAILURE"
    messages = dev.run_messages(run_id)
    assert "may not set resources.inference" in messages and str(config) in messages, messages[-3000:]
    assert elsewhere.hits == [] and provider.hits == []  # nothing was sent, anywhere
    # The same for storage and the tokenizer (remote code).
    for name, cfg in (
        ("storage", {"root": "/tmp/elsewhere"}),
        ("target", {"trust_remote_code": True}),
    ):
        launched = dev.launch_run("training_data", "B1", {"resources": {name: {"config": cfg}}})
        run_id = launched["run"]["runId"]
        assert dev.wait_run(run_id)["status"] == "FAILURE"
        assert f"may not set resources.{name}" in dev.run_messages(run_id)

    # 2. What is safe per run still works from a launch: a limit, a lower concurrency.
    safe = {"ops": {"responses": {"config": {"limit": 3, "max_concurrency": 2}}}}
    launched = dev.launch_run("training_data", "B1", safe)
    assert launched["__typename"] == "LaunchRunSuccess", launched
    assert dev.wait_run(launched["run"]["runId"])["status"] == "SUCCESS", dev.log_tail()
    assert len(provider.hits) == 3
    assert all(h.headers["Authorization"] == f"Bearer {deployment.key}" for h in provider.hits)
    # ... but not a ceiling above the configured one.
    launched = dev.launch_run(
        "training_data", "B1", {"ops": {"responses": {"config": {"max_concurrency": 99}}}}
    )
    run_id = launched["run"]["runId"]
    assert dev.wait_run(run_id)["status"] == "FAILURE"
    assert "above the ceiling" in dev.run_messages(run_id)

    # 3. Two backfills of the same dataset launched together: the second run waits for the first (one run per
    #    partition), then finds everything answered. No prompt is bought twice.
    first = dev.launch_backfill(["prompts", "responses"], ["B1"], title="top-up 1")
    second = dev.launch_backfill(["prompts", "responses"], ["B1"], title="top-up 2")
    results = [dev.wait_backfill(b) for b in (first, second)]
    assert all(r["status"] in ("COMPLETED", "COMPLETED_SUCCESS") for r in results), results
    runs = [
        dev.graphql(
            "query($id: ID!) { runOrError(runId: $id) { ... on Run { startTime endTime } } }",
            {"id": r["runs"][0]["id"]},
        )["runOrError"]
        for r in results
    ]
    a, b = sorted(runs, key=lambda r: r["startTime"])
    assert a["endTime"] <= b["startTime"], runs  # never both at once
    sent = [h.prompt for h in provider.hits]
    assert sorted(sent) == sorted(set(sent)) and set(sent) == set(TEXTS)  # every prompt exactly once
    pg_password = deployment.env["DAGSTER_PG_PASSWORD"]
    assert not any(h.headers.get("Authorization", "").endswith(pg_password) for h in provider.hits)


# What a run that was queued, launched or started logs: a refused one logs none of it.
NEVER = {
    "RunEnqueuedEvent",
    "RunDequeuedEvent",
    "RunStartingEvent",
    "RunStartEvent",
    "ExecutionStepStartEvent",
}


def _refused(dev: DagsterDev, run: dict, what: str) -> None:
    """`run` ended FAILURE without being queued, its log naming `what` and where pod settings live, and
    nothing of the tag's value."""
    assert run["status"] == "FAILURE", run
    events = dev.run_event_types(run["runId"])  # past the planned materialisations: only the failure
    assert events[-1] == "RunFailureEvent" and not set(events) & NEVER, events  # never queued, never started
    messages = dev.run_messages(run["runId"])
    assert "launch refused" in messages and what in messages, messages[-3000:]
    assert "deploy/k8s/values.yaml" in messages and "attacker" not in messages


def _wait_for_runs(dev: DagsterDev, value: str, timeout: float = 120) -> list[dict]:
    """The finished runs tagged probe=`value`, once there is at least one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = dev.runs_with_tag(PROBE_TAG, value)
        if runs and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs):
            return runs
        time.sleep(1)
    raise TimeoutError(f"no finished {value} run in {timeout}s:\n{dev.log_tail()}")


@pytest.mark.slow
def test_nothing_set_at_launch_changes_where_or_how_code_runs(deployment):
    """The `dagster-k8s/config` tag (under K8sRunLauncher: the run pod's image, command and secrets) and an
    `io_manager` override, from every launch path: each run ends FAILURE at once, never queued, and nothing is
    sent anywhere. The plain request beside the hostile one still runs."""
    dev, provider, elsewhere = deployment.dev, deployment.provider, deployment.elsewhere
    hits = len(provider.hits)
    # A backfill first: the daemon picks it up on its own loop, while the other launches are checked.
    backfill = dev.launch_backfill(["prompts", "responses"], ["B1"], title="hostile", tags=HOSTILE_TAGS)

    # The Launchpad / GraphQL launchRun.
    launched = dev.launch_run("training_data", "B1", {}, tags=HOSTILE_TAGS)
    assert launched["__typename"] == "LaunchRunSuccess", launched  # the UI opens the failed run
    run_id = launched["run"]["runId"]
    run = {"runId": run_id, **dev.wait_run(run_id)}
    _refused(dev, run, "run tag dagster-k8s/config")
    assert {"key": "eagle3/launch_refused", "value": "run tag dagster-k8s/config"} in run["tags"]
    # Re-executed from the UI (which copies the parent's tags): refused again.
    again = dev.reexecute(run_id)
    assert again["__typename"] == "LaunchRunSuccess", again
    _refused(
        dev, {"runId": again["run"]["runId"], **dev.wait_run(again["run"]["runId"])}, "dagster-k8s/config"
    )

    # The default IO manager, which Dagster would otherwise let any launch point elsewhere.
    launched = dev.launch_run(
        "training_data", "B1", {"resources": {"io_manager": {"config": {"base_dir": "/tmp"}}}}
    )
    run_id = launched["run"]["runId"]
    assert dev.wait_run(run_id)["status"] == "FAILURE"
    assert "may not set resources.io_manager (base_dir)" in dev.run_messages(run_id)

    # A sensor's run requests (the daemon's submit path): the hostile one refused, the plain one runs.
    (sensed,) = _wait_for_runs(dev, "sensor-hostile")
    _refused(dev, sensed, "run tag dagster-k8s/config")
    (plain,) = _wait_for_runs(dev, "sensor-plain")
    assert plain["status"] == "SUCCESS", dev.log_tail()
    # A schedule's (every minute, from the dev server's start).
    scheduled = _wait_for_runs(dev, "schedule-hostile")
    for run in scheduled:
        _refused(dev, run, "run tag dagster-k8s/config")

    # The backfill: its run refused like the rest, the backfill finished.
    done = dev.wait_backfill(backfill)
    assert done["status"] in ("COMPLETED_FAILED", "FAILED", "COMPLETED"), done
    assert done["runs"], done
    for r in done["runs"]:
        run = {"runId": r["id"], **dev.wait_run(r["id"])}
        _refused(dev, run, "run tag dagster-k8s/config")
    assert len(provider.hits) == hits and elsewhere.hits == []  # nothing was sent, anywhere
