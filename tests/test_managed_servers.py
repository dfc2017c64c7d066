"""GPU steps that bring their own engine (`hidden_states.vllm.managed`): each extraction step starts vLLM on
its own devices (here the CPU build), extracts its share of the shards and stops the server whatever ends the
step; a step killed outright leaves no server behind; a missing prerequisite fails the step in seconds, before
any server or training starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
import torch

from eagle3_assets.config import load_config
from eagle3_assets.core.hidden_states.extraction import ExtractionSettings
from eagle3_assets.definitions import HIDDEN_STATES_JOB, build_definitions
from resources.vllm.cpu_build import cpu_supports_vllm
from resources.vllm.managed import ManagedServerError

from .support.hidden_states import reference_states, write_tokens
from .support.projects import REPO, make_project
from .support.vllm_server import vllm_server_pids

pytestmark = pytest.mark.slow


def managed_project(root: Path, **vllm) -> Path:
    return make_project(
        root,
        {"B1": {"rows": [{"messages": [{"role": "user", "content": "hi"}]}]}},
        sampling={"temperature": 0.7},  # canned answers, read as sampled by the spot check's head rule
        hidden_states={
            "engine": "vllm",
            "storage_dtype": "float32",
            "shard_bytes": 200_000,
            "vllm": {"managed": True, "cpu": True, "kv_cache_gib": 1, "start_timeout_s": 900, **vllm},
        },
    )


@pytest.fixture
def cpu_build():
    why = cpu_supports_vllm()
    if why:
        pytest.skip(f"vLLM's CPU build cannot run here: {why}")


def test_each_replica_step_serves_itself_and_stops_its_server(cpu_build, chat, tmp_path, reference_model):
    path = managed_project(tmp_path, replicas=2)
    layout = write_tokens(chat, tmp_path / "data", repeat=2)  # 16 samples, a few shards
    defs = build_definitions(load_config(path), str(path))
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def(HIDDEN_STATES_JOB).execute_in_process(
            partition_key="B1", instance=instance
        )
        messages = [r.user_message for r in instance.all_logs(result.run_id)]
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    steps = {e.step_key for e in result.all_events if e.event_type_value == "STEP_SUCCESS"}
    assert {s for s in steps if "extract_hidden_states_managed" in s} == {
        "hidden_states.extract_hidden_states_managed[replica_0_of_2]",
        "hidden_states.extract_hidden_states_managed[replica_1_of_2]",
    }
    started = [m for m in messages if "starting vLLM for B1 replica" in m]
    assert len(started) == 2  # a server per step, none shared
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert all(c.passed for c in checks.values()), {k: c.metadata for k, c in checks.items() if not c.passed}
    # The states are the target's: equal to an independent forward (fp32 server, fp32 shards).
    from eagle3_assets.core.hidden_states.reader import HiddenStatesReader

    stored = HiddenStatesReader(layout.hidden_states_dir)
    tokens = pl.read_parquet(layout.tokens)
    for sid, ids in zip(tokens["id"].to_list()[:3], tokens["input_ids"].to_list()[:3], strict=True):
        aux, last, _ = reference_states(reference_model, ids)
        got = stored.sample(sid)
        assert got["aux_hidden_states"].shape == aux.shape and got["last_hidden_state"].shape == last.shape
        for stored_part, expected in ((got["aux_hidden_states"], aux), (got["last_hidden_state"], last)):
            cos = torch.nn.functional.cosine_similarity(stored_part.float(), expected.float(), dim=-1)
            assert float(cos.min()) >= 0.9999  # vLLM's kernels against transformers', both in fp32
    assert vllm_server_pids(f"connector-{os.getpid()}-") == []  # no server outlives its step
    assert not list((Path.home() / ".cache/eagle3-assets/servers").glob(f"connector-{os.getpid()}-*"))


KILLED_STEP = r"""
import sys
from eagle3_assets.cli import main
sys.exit(main(["--config", sys.argv[1], "hidden-states", "--dataset", "B1"]))
"""


def test_a_step_killed_outright_leaves_no_server_behind(cpu_build, chat, tmp_path):
    path = managed_project(tmp_path)
    write_tokens(chat, tmp_path / "data", repeat=1)
    step = subprocess.Popen(
        [sys.executable, "-c", KILLED_STEP, str(path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    marker = f"connector-{step.pid}-"
    try:
        deadline = time.monotonic() + 300
        while not vllm_server_pids(marker):
            assert step.poll() is None, step.stdout.read() if step.stdout else ""
            assert time.monotonic() < deadline, "the step's server never started"
            time.sleep(0.5)
        os.killpg(
            step.pid, signal.SIGKILL
        )  # the step's process group only: the server is a session of its own
        step.wait()
        deadline = time.monotonic() + 60
        while vllm_server_pids(marker):
            left = vllm_server_pids(marker)
            assert time.monotonic() < deadline, f"the server outlived its killed step: {left}"
            time.sleep(0.5)
    finally:
        for pid in vllm_server_pids(marker):  # never leave one holding memory, whatever failed above
            os.killpg(pid, signal.SIGKILL)


def test_missing_prerequisites_fail_the_step_in_seconds_before_anything_starts(chat, tmp_path):
    path = managed_project(tmp_path, cpu=False, python=str(tmp_path / "no-vllm" / "bin" / "python"))
    write_tokens(chat, tmp_path / "data", repeat=1)
    defs = build_definitions(load_config(path), str(path))
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def(HIDDEN_STATES_JOB).execute_in_process(
            partition_key="B1", instance=instance, raise_on_error=False
        )
    # Failed before anything expensive: no server started, no shard written (not a wall-clock bound).
    assert not result.success
    assert not list((tmp_path / "data" / "B1").rglob("*.safetensors"))
    failure = " ".join(e.step_failure_data.error.to_string() for e in result.all_events if e.is_step_failure)
    assert (
        "hidden_states.vllm.python" in failure and "no-vllm" in failure and "nothing was started" in failure
    )
    assert not any("starting vLLM" in (e.message or "") for e in result.all_events)
    # The acceptance gate checks its servers' prerequisites before it reads the checkpoint or trains.
    from eagle3_assets.assets.acceptance import gate_engines
    from eagle3_assets.core.storage.layout import DatasetLayout

    accept = make_project(
        tmp_path / "gate",
        {"B1": {"rows": [{"messages": [{"role": "user", "content": "hi"}]}]}},
        acceptance={"engine": "vllm", "vllm": {"python": "/nonexistent/python"}},
    )
    cfg = load_config(accept)
    with pytest.raises(ManagedServerError, match=r"acceptance.vllm.python .*/nonexistent/python"):
        gate_engines(cfg, DatasetLayout(cfg.storage_root, "B1"), chat, print)
    assert ExtractionSettings.from_config(cfg).hidden.engine == "transformers"
