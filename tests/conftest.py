"""Shared fixtures: the real embedded model and tokenizer, and small project configs in temporary folders."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

warnings.filterwarnings("ignore")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from eagle3_assets.core.target.loading import builtin_dir

    return builtin_dir("smollm2")


@pytest.fixture(scope="session")
def smol_tok(smollm2_dir):
    from eagle3_assets.core.target.loading import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="session")
def chat(smol_tok):
    from eagle3_assets.core.target.chat import ChatTokenizer

    return ChatTokenizer(smol_tok)


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def make_project(root: Path, datasets: dict[str, dict], **top) -> Path:
    """A config file in `root` with the given datasets (source rows written beside it)."""
    cfg: dict = {"storage": {"root": "data"}, "datasets": {}}
    for key, spec in datasets.items():
        rows = spec.pop("rows")
        write_jsonl(root / "prompts" / f"{key}.jsonl", rows)
        cfg["datasets"][key] = {
            "source": f"prompts/{key}.jsonl",
            "format": spec.pop("format", "messages"),
            "max_tokens": spec.pop("max_tokens", 12),
            **spec,
        }
    cfg.update(top)
    path = root / "eagle3.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def make_plan(
    key: str, max_tokens: int, budget_tokens: int, budget_usd: float | None = None, sampling=None, **run
):
    """A generation plan for a dataset section written in code (tests and benchmarks)."""
    from eagle3_assets.config import DatasetConfig, SamplingConfig
    from eagle3_assets.core.generation.run import GenerationPlan

    ds = DatasetConfig(
        source="(in code)",
        format="messages",
        max_tokens=max_tokens,
        budget_tokens=budget_tokens,
        budget_usd=budget_usd,
    )
    return GenerationPlan(key, ds, sampling or SamplingConfig(), **run)


def user_rows(texts: list[str], with_ids: bool = True) -> list[dict]:
    rows = []
    for i, t in enumerate(texts):
        row = {"messages": [{"role": "user", "content": t}]}
        if with_ids:
            row["id"] = f"p{i:03d}"
        rows.append(row)
    return rows


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start building the training frameworks' environments in the background as soon as a collected test needs
    them (`@pytest.mark.consumers(...)`), and the session's vLLM server (`@pytest.mark.vllm`): a cold build takes
    minutes, the rest of the suite runs meanwhile."""
    names = {n for item in items if (m := item.get_closest_marker("consumers")) for n in m.args}
    if names:
        from .consumers import environments

        environments.prefetch(sorted(names))
    if any(item.get_closest_marker("vllm") for item in items):
        from . import vllm_server

        if vllm_server.skip_reason() is None:
            vllm_server.start_in_background()  # the build, then the server: minutes the other tests overlap


def pytest_sessionfinish(session: pytest.Session) -> None:
    from . import vllm_server

    vllm_server.stop()


@dataclass
class ShippedRun:
    """B3 materialised through every asset with the shipped eagle3.yaml, unchanged."""

    root: Path
    success: bool
    failures: list[str]
    materialized: set[str]
    checks: dict  # check name -> AssetCheckEvaluation

    @property
    def layout(self):
        from eagle3_assets.core.storage.layout import DatasetLayout

        return DatasetLayout(self.root / "data", "B3")


@pytest.fixture(scope="session")
def shipped_b3(tmp_path_factory) -> ShippedRun:
    """One run of the shipped defaults for the whole session (the acceptance gate trains a draft: minutes), read by
    the shipped-defaults test and by the training frameworks' tests. Six answers keep it short (the gate trains on
    five, holds one out)."""
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import build_definitions

    root = tmp_path_factory.mktemp("shipped")
    shutil.copy(REPO / "eagle3.yaml", root / "eagle3.yaml")
    shutil.copytree(REPO / "prompts", root / "prompts")
    path = root / "eagle3.yaml"
    assert path.read_text() == (REPO / "eagle3.yaml").read_text()
    defs = build_definitions(load_config(path), str(path))
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        result = job.execute_in_process(
            partition_key="B3",
            instance=instance,
            run_config={"ops": {"responses": {"config": {"limit": 6}}}},
            raise_on_error=False,
        )
    return ShippedRun(
        root=root,
        success=result.success,
        failures=[e.message for e in result.all_events if e.is_failure],
        materialized={
            m.asset_key.to_user_string() for m in result.asset_materializations_for_node("responses")
        },
        checks={
            e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
            for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"
        },
    )


def kill_once_written(
    cmd: list[str], folder: Path, pattern: str, count: int, timeout_s: float, env: dict | None = None
) -> None:
    """Start `cmd` in its own session, wait until `folder` holds `count` files matching `pattern`, then kill -9
    its whole process group: a crash at a moment the test chose, mid-run."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(list(folder.glob(pattern))) < count:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def materialize_in_process(path: Path, select: tuple[str, ...], partition: str = "B1"):
    """The project at `path` as its definitions build it: `select`ed assets of one partition in process, on a
    throwaway instance; fails with the failures' messages."""
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import build_definitions

    defs = build_definitions(load_config(path), str(path))
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        result = job.execute_in_process(
            partition_key=partition,
            instance=instance,
            asset_selection=[dg.AssetKey(k) for k in select],
            raise_on_error=False,
        )
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    return result


class FullTargetGuard:
    """Refuses to load the whole target in this process and records the depth of every decoder forward: what the
    steps past generation may run of a target that never fits (pieces of the checkpoint, never the whole)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        import transformers
        from transformers.models.llama import modeling_llama

        from eagle3_assets.core.target import loading

        self.depths: list[int] = []
        forward = modeling_llama.LlamaModel.forward

        def counted(model, *args, **kwargs):
            self.depths.append(len(model.layers))
            return forward(model, *args, **kwargs)

        def refuse(*args, **kwargs):
            raise AssertionError(f"the whole target was loaded in the step's process: {args[:1]}")

        loading.shared_model.cache_clear()  # a copy loaded earlier (by generation) is not reused either
        monkeypatch.setattr(modeling_llama.LlamaModel, "forward", counted)
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
        monkeypatch.setattr(loading, "load_model", refuse)
        monkeypatch.setattr(loading, "shared_model", refuse)


@contextlib.contextmanager
def moto_server(bucket: str) -> Iterator[str]:
    """moto's S3-compatible server started on a free loopback port, with `bucket` created; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.3)
        # moto accepts any credentials; a bucket is created with one plain PUT.
        urllib.request.urlopen(urllib.request.Request(f"{url}/{bucket}", method="PUT"), timeout=10)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
