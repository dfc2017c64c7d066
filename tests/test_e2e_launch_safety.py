"""A shared deployment is safe to launch from: through the GraphQL API of a running `dagster dev`, a launch
cannot redirect the key or the endpoint, per-run knobs still work, and two backfills of one dataset never buy
its answers twice."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys

import pytest

from .support.dagster_dev import DagsterDev
from .support.fake_servers import FakeOpenRouter
from .support.projects import REPO, make_project, user_rows

KEY_ENV = "EAGLE3_TEST_OPENROUTER_KEY"


@pytest.mark.slow
def test_launches_cannot_redirect_the_key_and_one_run_per_dataset(tmp_path, monkeypatch):
    key = "sk-test-" + secrets.token_hex(12)
    texts = [f"shared question {i}" for i in range(24)]
    with FakeOpenRouter(key=key, latency=0.3) as provider, FakeOpenRouter(latency=0.0) as elsewhere:
        config = make_project(
            tmp_path,
            {"B1": {"rows": user_rows(texts), "max_tokens": 16}},
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
        home = tmp_path / "dagster_home"
        home.mkdir()
        shutil.copy(REPO / "deploy" / "local" / "dagster.yaml", home / "dagster.yaml")
        # A secret of the run worker's environment that a malicious launch would like to send away.
        env = {KEY_ENV: key, "DAGSTER_PG_PASSWORD": "pg-" + secrets.token_hex(8)}
        setup = subprocess.run(
            [sys.executable, "-m", "eagle3_assets.cli", "--config", str(config), "instance"],
            cwd=REPO,
            env={**__import__("os").environ, "DAGSTER_HOME": str(home), **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert setup.returncode == 0, setup.stdout + setup.stderr
        with DagsterDev(config, home, env=env) as dev:
            # 1. Overriding the inference resource at launch: refused before any step, naming the file to
            #    edit.
            hostile = {
                "resources": {
                    "inference": {
                        "config": {"base_url": elsewhere.base_url, "api_key_env": "DAGSTER_PG_PASSWORD"}
                    }
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
            assert all(h.headers["Authorization"] == f"Bearer {key}" for h in provider.hits)
            # ... but not a ceiling above the configured one.
            launched = dev.launch_run(
                "training_data", "B1", {"ops": {"responses": {"config": {"max_concurrency": 99}}}}
            )
            run_id = launched["run"]["runId"]
            assert dev.wait_run(run_id)["status"] == "FAILURE"
            assert "above the ceiling" in dev.run_messages(run_id)

            # 3. Two backfills of the same dataset launched together: the second run waits for the first (one
            #    run per partition), then finds everything answered. No prompt is bought twice.
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
    assert sorted(sent) == sorted(set(sent)) and set(sent) == set(texts)  # every prompt exactly once
    assert not any(
        h.headers.get("Authorization", "").endswith(env["DAGSTER_PG_PASSWORD"]) for h in provider.hits
    )
