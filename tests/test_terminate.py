"""Stop means stop: a terminated run sends nothing more within seconds, stores what arrived, settles its
ledger, and the next run pays again at most what was in flight.

In process (a signal to this process, as Dagster's Terminate sends one to the step's process) and through the
real thing: `dagster dev`, the GraphQL mutations the UI's Terminate button and a backfill's Cancel call,
against a provider whose answers take seconds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from eagle3_assets.config import DatasetConfig, OpenRouterConfig
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.journal import ResponseJournal
from eagle3_assets.core.generation.run import generate_responses
from eagle3_assets.core.generation.stopping import RunTerminated, run_loop
from eagle3_assets.core.prompts.ingest import write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout
from resources.inference.openrouter import OpenRouterBackend

from .support.dagster_dev import DagsterDev
from .support.engine_runs import make_plan
from .support.fake_servers import FakeOpenRouter
from .support.projects import REPO, make_project, user_rows, write_jsonl

KEY_ENV = "EAGLE3_TEST_OPENROUTER_KEY"
KEY = "test-key-" + "t" * 24
LATENCY_S = 2.0  # every answer takes this long: a run of hundreds of prompts is minutes of spending


def _signal_when(server: FakeOpenRouter, hits: int, sig: int = signal.SIGINT) -> dict:
    """Send `sig` to this process once the provider has seen `hits` requests; returns how many it had seen
    when the signal was sent (`hits`, filled in then)."""
    sent: dict = {}

    def watch() -> None:
        while len(server.hits) < hits:
            time.sleep(0.02)
        sent["hits"] = len(server.hits)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, daemon=True).start()
    return sent


def _generate(tmp_path, server: FakeOpenRouter, layout: DatasetLayout, chat, concurrency: int):
    cfg = OpenRouterConfig(
        base_url=server.base_url, api_key_env=KEY_ENV, max_concurrency=concurrency, stream=False
    )
    settings = EngineSettings(
        max_concurrency=concurrency,
        initial_concurrency=concurrency,
        flush_interval_s=0.5,
        terminate_grace_s=0.5,
    )
    plan = make_plan(layout.key, 32, 10_000_000)
    return generate_responses(layout, plan, OpenRouterBackend(cfg, chat), chat, settings, log=lambda m: None)


def test_without_a_graceful_stop_a_signal_cancels_the_loop_and_the_handlers_are_put_back():
    cancelled = []

    async def forever() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(RunTerminated, match="SIGTERM"):
        run_loop(forever())
    assert cancelled == [True]  # cut short, not left to sleep its minute
    # The process's own handlers are put back (whatever they were: Dagster maps SIGTERM to SIGINT's).
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_sigint_stops_sending_stores_what_arrived_and_the_next_run_pays_only_the_in_flight(
    tmp_path, chat, monkeypatch
):
    monkeypatch.setenv(KEY_ENV, KEY)
    texts = [f"question number {i}" for i in range(120)]
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    src = write_jsonl(tmp_path / "B1.jsonl", user_rows(texts))
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    concurrency = 16
    with FakeOpenRouter(key=KEY, latency=LATENCY_S) as server:
        sent = _signal_when(server, 40)
        with pytest.raises(RunTerminated):
            _generate(tmp_path, server, layout, chat, concurrency)
        assert "hits" in sent
        n_before = len(server.hits)
        # Answers take LATENCY_S, far longer than the grace, so no slot frees after the signal: what
        # reaches the provider after it is at most what was already on its way (the window). Sending on
        # would be far more.
        assert n_before - sent["hits"] <= concurrency, f"{n_before - sent['hits']} requests after the stop"
        journal = ResponseJournal(layout)
        stored = journal.done_ids()
        assert 0 < len(stored) < len(texts)  # what arrived is in the table
        # The requests cut off in flight were settled from the ledger: charged to the budget as probably
        # billed.
        lost = journal.prior_usage().lost_requests
        assert 0 < lost <= concurrency
        summary = _generate(tmp_path, server, layout, chat, concurrency)
        assert summary.stop_reason == "done" and summary.n_responses == len(texts)
    prompts = [h.prompt for h in server.hits]
    paid_twice = len(prompts) - len(set(prompts))
    assert set(prompts) == set(texts)
    assert paid_twice == lost == n_before - len(stored)


# -- through dagster dev and GraphQL
# ---------------------------------------------------------------------------

CANCEL_BACKFILL = """
mutation($id: String!) { cancelPartitionBackfill(backfillId: $id) { __typename
  ... on CancelBackfillSuccess { backfillId } ... on PythonError { message } } }"""
RUNS_OF_BACKFILL = """
query($id: String!) { partitionBackfillOrError(backfillId: $id) { ... on PartitionBackfill {
  status runs(limit: 10) { id status } } } }"""


def _wait(predicate, timeout: float, what: str, dev: DagsterDev):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout}s:\n{dev.log_tail()}")


def _stored(tmp_path, key: str) -> set[str]:
    return ResponseJournal(DatasetLayout(tmp_path / "data", key)).done_ids()


@pytest.mark.slow
def test_terminate_and_cancel_through_graphql_stop_spending_within_seconds(tmp_path):
    n = 240
    texts = {k: [f"{k} question {i}" for i in range(n)] for k in ("B1", "B2", "B3")}
    concurrency = 12
    with FakeOpenRouter(key=KEY, latency=LATENCY_S) as provider:
        config = make_project(
            tmp_path,
            {k: {"rows": user_rows(t), "max_tokens": 16} for k, t in texts.items()},
            backend="openrouter",
            backends={
                "openrouter": {
                    "base_url": provider.base_url,
                    "api_key_env": KEY_ENV,
                    "max_concurrency": concurrency,
                    "stream": False,
                }
            },
        )
        home = tmp_path / "dagster_home"
        home.mkdir()
        shutil.copy(REPO / "deploy" / "local" / "dagster.yaml", home / "dagster.yaml")
        env = {KEY_ENV: KEY}
        setup = subprocess.run(
            [sys.executable, "-m", "eagle3_assets.cli", "--config", str(config), "instance"],
            cwd=REPO,
            env={**os.environ, "DAGSTER_HOME": str(home), **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert setup.returncode == 0, setup.stdout + setup.stderr
        with DagsterDev(config, home, env=env) as dev:
            # 1. One dataset's run, terminated as the UI's Terminate button does.
            launched = dev.launch_run("training_data", "B1", {})
            assert launched["__typename"] == "LaunchRunSuccess", launched
            run_id = launched["run"]["runId"]
            _wait(lambda: len(provider.hits_for("B1 question")) >= 30, 240, "B1's first answers", dev)
            result = dev.terminate(run_id)
            terminated_at = time.monotonic()
            assert result["__typename"] == "TerminateRunSuccess", result
            run = dev.wait_run(run_id, timeout=120)
            canceled_after = time.monotonic() - terminated_at
            assert run["status"] == "CANCELED", (run, dev.run_messages(run_id)[-3000:])
            b1_hits = provider.hits_for("B1 question")
            late = [h for h in b1_hits if h.at > terminated_at + 5]
            assert late == [], f"{len(late)} requests reached the provider more than 5 s after Terminate"
            stored_b1 = _stored(tmp_path, "B1")
            assert 0 < len(stored_b1) < n
            assert len(b1_hits) - len(stored_b1) <= concurrency  # cut off in flight, at most the window
            assert canceled_after < 60, canceled_after
            last = max(h.at for h in b1_hits) - terminated_at
            print(
                f"\nterminateRuns: last request {last:+.2f} s after it, CANCELED after {canceled_after:.1f} s"
            )

            # 2. A backfill of two datasets (one run), cancelled from the UI: the daemon terminates its run.
            backfill = dev.launch_backfill(["prompts", "responses"], ["B2", "B3"], title="cancel me")
            _wait(
                lambda: len(provider.hits_for("B2 question")) >= 20, 300, "the backfill's first answers", dev
            )
            res = dev.graphql(CANCEL_BACKFILL, {"id": backfill})["cancelPartitionBackfill"]
            cancelled_at = time.monotonic()
            assert res["__typename"] == "CancelBackfillSuccess", res
            status = _wait(
                lambda: (
                    b
                    if (b := dev.graphql(RUNS_OF_BACKFILL, {"id": backfill})["partitionBackfillOrError"])[
                        "status"
                    ]
                    in ("CANCELED", "COMPLETED_FAILED", "FAILED")
                    and all(r["status"] in ("CANCELED", "FAILURE", "SUCCESS") for r in b["runs"])
                    else None
                ),
                180,
                "the backfill's cancellation",
                dev,
            )
            assert status["status"] == "CANCELED", status
            print(f"cancelPartitionBackfill: CANCELED after {time.monotonic() - cancelled_at:.1f} s")
            generating = [r for r in status["runs"] if r["status"] != "SUCCESS"]
            assert generating and all(r["status"] == "CANCELED" for r in generating), status
            for key in ("B2", "B3"):
                hits = provider.hits_for(f"{key} question")
                late = [h for h in hits if h.at > cancelled_at + 8]
                assert late == [], f"{key}: {len(late)} requests after the backfill was cancelled"
                assert len(_stored(tmp_path, key)) < n
                print(
                    f"  {key}: last request {max(h.at for h in hits) - cancelled_at:+.2f} s after the cancel"
                )

            # 3. The next run finishes B1 and pays again at most what the terminated run had in flight.
            launched = dev.launch_run("training_data", "B1", {})
            assert dev.wait_run(launched["run"]["runId"], timeout=300)["status"] == "SUCCESS", dev.log_tail()
    prompts = [h.prompt for h in provider.hits_for("B1 question")]
    assert set(prompts) == set(texts["B1"])
    assert len(prompts) - len(set(prompts)) <= concurrency
    print(f"B1 paid twice after the terminate: {len(prompts) - len(set(prompts))} (window {concurrency})")
