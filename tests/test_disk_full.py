"""A full disk under the storage root. The run watches the room left where answers are written and stops
buying before a write can fail, so every answer bought is stored; a disk that fills anyway (another process
writes it full) stops dispatch at once and loses at most what was in flight. After the data moves somewhere
roomy the next run answers every prompt once. A real filesystem that fills: a small tmpfs mounted for the test
(root only; elsewhere the test says why it cannot run)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import threading
import time

import pytest

from eagle3_assets.config import DatasetConfig, OpenRouterConfig
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.journal import ResponseJournal
from eagle3_assets.core.generation.protocol import FatalRunError
from eagle3_assets.core.generation.run import generate_responses
from eagle3_assets.core.prompts.ingest import write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout
from resources.inference.openrouter import OpenRouterBackend

from .support.engine_runs import make_plan
from .support.fake_servers import FakeOpenRouter
from .support.projects import user_rows, write_jsonl

KEY_ENV = "EAGLE3_TEST_OPENROUTER_KEY"
N = 400


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the full-disk test cannot run here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the full-disk test cannot run"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _run(layout: DatasetLayout, server: FakeOpenRouter, chat, concurrency: int = 16):
    cfg = OpenRouterConfig(
        base_url=server.base_url, api_key_env=KEY_ENV, max_concurrency=concurrency, stream=False
    )
    settings = EngineSettings(
        max_concurrency=concurrency, initial_concurrency=concurrency, flush_interval_s=0.2
    )
    plan = make_plan(layout.key, 4096, 100_000_000)  # room for the echoed prompt: never cut
    return generate_responses(layout, plan, OpenRouterBackend(cfg, chat), chat, settings, log=lambda m: None)


def _partition(tmp_path, small_disk) -> tuple[DatasetLayout, list[str]]:
    # Incompressible prompts, echoed in the answers: the journal grows by kilobytes per answer.
    texts = [f"{i} " + " ".join(secrets.token_hex(8) for _ in range(180)) for i in range(N)]
    src = write_jsonl(tmp_path / "B1.jsonl", user_rows(texts))
    layout = DatasetLayout(small_disk / "data", "B1").ensure()
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    return layout, texts


def _resume_elsewhere(tmp_path, small_disk, server: FakeOpenRouter, chat, texts: list[str]) -> int:
    """Move the data somewhere roomy and finish: every prompt answered; returns how many were bought twice."""
    roomy = tmp_path / "roomy"
    shutil.copytree(small_disk / "data", roomy)
    moved = DatasetLayout(roomy, "B1")
    assert _run(moved, server, chat).n_responses == N
    sent = [h.prompt for h in server.hits]
    assert set(sent) == set(texts)
    return len(sent) - len(set(sent))


def test_a_disk_running_full_stops_the_buying_before_a_write_fails(small_disk, tmp_path, chat, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    layout, texts = _partition(tmp_path, small_disk)
    filler = small_disk / "filler"
    with FakeOpenRouter(latency=0.05) as server:
        # No room for a window of answers of max_tokens (nothing stored yet says they are smaller): nothing is
        # sent at all.
        filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 1200 * 1024))
        with pytest.raises(FatalRunError, match="MiB free, under the") as stopped:
            _run(layout, server, chat)
        assert "storage.root" in str(stopped.value) and server.hits == []
        # Room for a window and some: it buys, learns what an answer takes, and stops while every answer
        # bought can still be stored.
        filler.unlink()
        filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 2200 * 1024))
        with pytest.raises(FatalRunError, match="MiB free, under the"):
            _run(layout, server, chat)
        bought = len(server.hits)
        assert 16 < bought < N
        assert len(ResponseJournal(layout).done_ids()) == bought  # every answer bought is stored
        assert _resume_elsewhere(tmp_path, small_disk, server, chat, texts) == 0  # nothing bought twice


def test_a_disk_filled_by_another_process_loses_at_most_what_was_in_flight(
    small_disk, tmp_path, chat, monkeypatch
):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    layout, texts = _partition(tmp_path, small_disk)

    def fill_after_the_first_flush() -> None:
        while not list(layout.responses_dir.glob("part-*.parquet")):
            time.sleep(0.005)
        free = shutil.disk_usage(small_disk).free
        (small_disk / "filler").write_bytes(b"\0" * free)  # every byte: the next write fails

    concurrency = 16
    filler = threading.Thread(target=fill_after_the_first_flush, daemon=True)
    with FakeOpenRouter(latency=0.05) as server:
        filler.start()
        with pytest.raises(Exception, match=r"No space left on device|MiB free"):
            _run(layout, server, chat, concurrency)
        filler.join(5)
        bought = len(server.hits)
        kept = ResponseJournal(layout).done_ids()
        assert 0 < bought < N
        # Bought and not stored: at most the answers in flight when the disk filled and those waiting for the
        # flush that failed (the window's worth, twice over at the most).
        assert bought - len(kept) <= 2 * concurrency
        (small_disk / "filler").unlink()
        twice = _resume_elsewhere(tmp_path, small_disk, server, chat, texts)
    assert twice == bought - len(kept)  # only what could not be stored is bought again
