"""A full disk under the storage root: the run stops buying at once with the system's own message, and after
the data is moved somewhere roomy the next run answers every prompt once (what the last flush could not store
is bought again). A real filesystem that fills: a small tmpfs mounted for the test (root only; elsewhere the
test says why it cannot run)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import pytest

from eagle3_assets.config import DatasetConfig, OpenRouterConfig
from eagle3_assets.core.generation.engine import EngineSettings
from eagle3_assets.core.generation.journal import ResponseJournal
from eagle3_assets.core.generation.run import generate_responses
from eagle3_assets.core.prompts.ingest import write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout
from resources.inference.openrouter import OpenRouterBackend

from .support.engine_runs import make_plan
from .support.fake_servers import FakeOpenRouter
from .support.projects import user_rows, write_jsonl

KEY_ENV = "EAGLE3_TEST_OPENROUTER_KEY"
N = 240


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the full-disk test cannot run here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the full-disk test cannot run"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _run(layout: DatasetLayout, server: FakeOpenRouter, chat):
    cfg = OpenRouterConfig(base_url=server.base_url, api_key_env=KEY_ENV, max_concurrency=16, stream=False)
    settings = EngineSettings(max_concurrency=16, initial_concurrency=16, flush_interval_s=0.2)
    plan = make_plan(layout.key, 64, 100_000_000)
    return generate_responses(layout, plan, OpenRouterBackend(cfg, chat), chat, settings, log=lambda m: None)


def test_a_full_disk_stops_the_run_and_nothing_is_lost_after_the_data_moves(
    small_disk, tmp_path, chat, monkeypatch
):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    # Incompressible prompts, echoed in the answers: the journal grows by kilobytes per answer.
    texts = [f"{i} {secrets.token_hex(1500)}" for i in range(N)]
    src = write_jsonl(tmp_path / "B1.jsonl", user_rows(texts))
    layout = DatasetLayout(small_disk / "data", "B1").ensure()
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * (free - 200 * 1024))  # room for a few dozen answers
    with FakeOpenRouter(latency=0.05) as server:
        with pytest.raises(Exception, match="No space left on device"):
            _run(layout, server, chat)
        bought_before = len(server.hits)
        assert 0 < bought_before < N  # it stopped buying, not after every prompt
        roomy = tmp_path / "roomy"
        shutil.copytree(small_disk / "data", roomy)
        moved = DatasetLayout(roomy, "B1")
        kept = ResponseJournal(moved).done_ids()
        summary = _run(moved, server, chat)
        assert summary.n_responses == N
    sent = [h.prompt for h in server.hits]
    assert set(sent) == set(texts)
    twice = len(sent) - len(set(sent))
    assert twice == bought_before - len(kept)  # only what the failed flush could not store is bought again
    assert sorted(ResponseJournal(moved).done_ids()) == sorted(f"p{i:03d}" for i in range(N))
