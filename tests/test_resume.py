"""Crash safety through the real command line: kill -9 mid-run, resume, and the API key never leaks."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.generation.journal import ResponseJournal
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable

from .support.cli_runs import env_for, kill_once_written, materialize_cmd
from .support.engine_runs import KEY_ENV
from .support.fake_servers import FakeOpenRouter
from .support.projects import REPO, make_project, user_rows


def openrouter_project(tmp_path: Path, base_url: str, texts: list[str], concurrency: int = 16) -> Path:
    return make_project(
        tmp_path,
        {"B1": {"rows": user_rows(texts), "max_tokens": 64}},
        backend="openrouter",
        backends={
            "openrouter": {
                "base_url": base_url,
                "api_key_env": KEY_ENV,
                "max_concurrency": concurrency,
                "max_retries": 2,
            }
        },
        # The key-leak test answers one prompt of three with an error on purpose; the failure-share check
        # blocks above this share, and the run must reach every stage.
        checks={"max_failure_share": 0.5},
    )


def test_kill_9_mid_run_then_resume_sends_nothing_twice(tmp_path):
    texts = [f"resume question {i}" for i in range(400)]
    key = "k-" + secrets.token_hex(8)
    with FakeOpenRouter(key=key, latency=0.5) as server:
        config = openrouter_project(tmp_path, server.base_url, texts)
        env = env_for(config, tmp_path / "dagster_home", key)
        responses_dir = tmp_path / "data" / "B1" / "responses"
        kill_once_written(materialize_cmd(), responses_dir, "part-*.parquet", 2, 120, env)
        stored_at_kill = JournalTable(responses_dir, RESPONSE_SCHEMA).keys()
        prompts = pl.read_parquet(tmp_path / "data" / "B1" / "prompts.parquet")
        text_of = dict(
            zip(prompts["id"], [m[-1]["content"] for m in prompts["messages"].to_list()], strict=True)
        )
        hits_before = len(server.hits)
        assert 0 < len(stored_at_kill) < len(texts)

        done = subprocess.run(
            materialize_cmd(), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        resent = {h.prompt for h in server.hits[hits_before:]}
    # Nothing that was stored before the kill was sent again.
    assert not resent & {text_of[i] for i in stored_at_kill}
    final = pl.read_parquet(responses_dir / "*.parquet")
    assert final.height == len(texts) == final["id"].n_unique()
    # Only requests that were in flight (or not yet flushed) at the kill were paid twice.
    assert len(server.hits) - len(texts) <= 16 + 2 * 16
    # And the resumed run charged each of them to the budget: every request the server saw before the kill is
    # either stored or counted as lost in flight (a few more may have been on their way when the kill came).
    usage = ResponseJournal(DatasetLayout(tmp_path / "data", "B1")).prior_usage()
    lost = usage.lost_requests
    assert hits_before - len(stored_at_kill) <= lost <= hits_before - len(stored_at_kill) + 16, lost
    billed = int(final["completion_tokens"].sum())
    assert usage.completion_tokens >= billed + lost * 1  # the lost ones count too, at an expected length


def test_the_api_key_reaches_no_file_log_or_metadata(tmp_path):
    key = "sk-or-v1-" + secrets.token_hex(24)
    texts = ["a question", "another question", "echo my headers [[echokey]]"]
    with FakeOpenRouter(key=key) as server:
        config = openrouter_project(tmp_path, server.base_url, texts, concurrency=2)
        home = tmp_path / "dagster_home"
        env = env_for(config, home, key)
        done = subprocess.run(
            materialize_cmd("prompts,responses,tokens,validation_report"),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert server.hits and server.hits[0].headers["Authorization"] == f"Bearer {key}"
    assert done.returncode == 0, done.stderr[-3000:]
    assert key not in done.stdout and key not in done.stderr
    failures = pl.read_parquet(tmp_path / "data" / "B1" / "failures" / "*.parquet")
    assert "[redacted]" in failures["message"][0]
    for root in (tmp_path / "data", home):
        for path in root.rglob("*"):
            if path.is_file():
                assert key.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("missing", ["key"])
def test_missing_key_fails_fast_naming_the_variable(tmp_path, missing):
    config = make_project(
        tmp_path,
        {"B1": {"rows": user_rows(["x"])}},
        backend="openrouter",
        backends={"openrouter": {"api_key_env": "EAGLE3_TEST_ABSENT_KEY"}},
    )
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_TEST_ABSENT_KEY"}
    env.update(EAGLE3_CONFIG=str(config))
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "preflight"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "export EAGLE3_TEST_ABSENT_KEY=" in done.stdout
