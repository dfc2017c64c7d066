"""Steps spread over machines by an existing engine: `execution.executor: ray` on a real two-node Ray cluster
on loopback (tests/support/ray_cluster.py). One partition's managed extraction steps land on both nodes, each
starting its own vLLM (the CPU build) on its node's slot; the states equal an independent forward. A node lost
in the middle costs only the shards it was writing: the next materialisation extracts only what is missing,
nothing twice, nothing lost, and no server outlives its step."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
import torch
from dagster._core.definitions.reconstruct import ReconstructableRepository

from eagle3_assets.assets.hidden_states import replica_shards
from eagle3_assets.core.hidden_states.reader import HiddenStatesReader
from eagle3_assets.core.target_model.loading import cache_root
from eagle3_assets.definitions import HIDDEN_STATES_JOB
from resources.vllm.cpu_build import cpu_supports_vllm

from .support.hidden_states import reference_states, write_tokens
from .support.projects import REPO, make_project
from .support.ray_cluster import SLOT, WORKER_IP, RayCluster
from .support.vllm_server import vllm_server_pids

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="the `ray` extra (Ray and dagster-ray) is not installed")


@pytest.fixture
def cluster(tmp_path):
    why = cpu_supports_vllm()
    if why:
        pytest.skip(f"vLLM's CPU build cannot run here: {why}")
    with RayCluster(tmp_path) as c:
        yield c


def ray_project(root: Path, cluster: RayCluster, **top) -> Path:
    return make_project(
        root,
        {"B1": {"rows": [{"messages": [{"role": "user", "content": "hi"}]}]}},
        sampling={"temperature": 0.7},
        hidden_states={
            "engine": "vllm",
            "storage_dtype": "float32",
            "shard_bytes": 150_000,
            "vllm": {
                "managed": True,
                "replicas": 2,
                "cpu": True,
                "kv_cache_gib": 1,
                "start_timeout_s": 900,
                # One sample at a time: shards appear one by one, so a node can be lost between two.
                "max_concurrency": 1,
            },
        },
        execution={
            "executor": "ray",
            "max_concurrent_steps": 4,
            "ray": {"address": cluster.dashboard, "gpu_step_resources": {SLOT: 1}},
        },
        **top,
    )


def instance_home(root: Path) -> Path:
    home = root / "dagster_home"
    home.mkdir()
    # Two GPU steps at once: one per node's slot (Ray places them; the pool must not hold the second back).
    (home / "dagster.yaml").write_text(
        "concurrency:\n  pools:\n    default_limit: 4\ntelemetry:\n  enabled: false\n"
    )
    return home


def run_hidden_states(path: Path, home: Path, monkeypatch) -> dg.ExecuteJobResult:
    """The hidden-states job as a run executes it (its own executor, not in-process), partition B1."""
    monkeypatch.setenv("EAGLE3_CONFIG", str(path))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    repo = ReconstructableRepository.for_module(
        "eagle3_assets.definitions", "defs", working_directory=str(REPO)
    )
    job = repo.get_reconstructable_job(HIDDEN_STATES_JOB)
    with dg.DagsterInstance.get() as instance:
        return dg.execute_job(job, instance, tags={"dagster/partition": "B1"}, raise_on_error=False)


def failures(result) -> str:
    return "\n".join(
        e.step_failure_data.error.to_string() if e.is_step_failure else e.message or ""
        for e in result.all_events
        if e.is_failure
    )


def extraction_steps(cluster: RayCluster) -> list[dict]:
    return [
        j for j in cluster.jobs() if "extract_hidden_states_managed" in j["metadata"].get("dagster/op", "")
    ]


def vllm_servers() -> list[int]:
    """Pids of the vLLM servers managed steps started (their connector folders are in the cache's
    `servers/`; the suite's own session servers write elsewhere)."""
    return vllm_server_pids(str(cache_root() / "servers" / "connector-"))


def running_extraction(cluster: RayCluster) -> list[dict] | None:
    """The two extraction steps' jobs once both run on a node; None before."""
    steps = extraction_steps(cluster)
    placed = len(steps) == 2 and all(s["status"] == "RUNNING" and s["node"] for s in steps)
    return steps if placed else None


def wait_for(what: str, condition, timeout_s: float = 900, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
    return value


def test_a_partition_spreads_over_two_nodes_and_a_lost_node_costs_only_its_shards(
    cluster, chat, tmp_path, reference_model, monkeypatch
):
    path = ray_project(tmp_path, cluster)
    layout = write_tokens(chat, tmp_path / "data", repeat=8)  # 64 samples, a shard each
    home = instance_home(tmp_path)
    folder = layout.hidden_states_dir

    # Run 1, on both nodes; the worker node is lost once its step has written a shard.
    outcome: dict = {}
    started = time.monotonic()
    runner = threading.Thread(
        target=lambda: outcome.update(result=run_hidden_states(path, home, monkeypatch))
    )
    runner.start()
    print("run 1 started", flush=True)
    steps = wait_for("both extraction steps running on the cluster", lambda: running_extraction(cluster))
    assert {s["node"] for s in steps} == {"127.0.0.2", WORKER_IP}, steps  # one per node
    on_worker = next(s for s in steps if s["node"] == WORKER_IP)["metadata"]["dagster/op"]
    unit = on_worker.split("[", 1)[1].rstrip("]").replace("_", "-")
    planned_first, mine = set(planned(layout)), set(replica_shards(unit, layout))
    print(f"steps {steps}; the worker runs {unit}: {sorted(mine)}", flush=True)
    wait_for("the worker's first shard", lambda: mine & shard_names(folder), every_s=0.05)
    cluster.worker.stop(signal.SIGKILL)
    print(f"worker killed with {sorted(shard_names(folder))} written", flush=True)
    lost_at = shard_names(folder)
    runner.join(900)
    assert not runner.is_alive(), "the run did not end after its node was lost"
    first = outcome["result"]
    assert not first.success  # the lost node's step failed; the other one finished its share
    wait_for("no server left", lambda: not vllm_servers(), timeout_s=120)  # none outlives its step
    after_first = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*")}
    assert set(after_first) >= planned_first - mine  # the surviving node's share is whole
    assert not mine <= set(after_first)  # the lost node's is not
    first_s = time.monotonic() - started

    # Run 2, the worker back: only the missing samples are extracted, nothing twice, nothing lost.
    cluster.start_worker()
    started = time.monotonic()
    second = run_hidden_states(path, home, monkeypatch)
    assert second.success, failures(second)
    redone = set(planned(layout))
    assert redone and not redone & set(after_first)
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*") if p.name in after_first}
    assert kept == after_first  # no shard written again
    reader = HiddenStatesReader(folder)
    tokens = pl.read_parquet(layout.tokens)
    assert sorted(reader.ids()) == sorted(tokens["id"].to_list())  # nothing lost
    assert samples_in_shards(folder) == tokens.height  # nothing extracted twice
    for sid, ids in zip(tokens["id"].to_list()[::8], tokens["input_ids"].to_list()[::8], strict=True):
        aux, last, _ = reference_states(reference_model, ids)
        got = reader.sample(sid)
        for stored, expected in ((got["aux_hidden_states"], aux), (got["last_hidden_state"], last)):
            cos = torch.nn.functional.cosine_similarity(stored.float(), expected.float(), dim=-1)
            assert float(cos.min()) >= 0.9999
    assert not vllm_servers()
    print(
        f"run 1: {len(planned_first)} shards planned, {len(mine)} on the lost node; written when it was lost:"
        f" {len(lost_at & mine)} of its own and {len(lost_at - mine)} of the other node's; {first_s:.0f} s. "
        f"Run 2: {len(redone)} shards (the lost node's missing ones), {time.monotonic() - started:.0f} s"
    )


def samples_in_shards(folder: Path) -> int:
    """Samples held by the shard files themselves (a sample extracted twice would be counted twice)."""
    from safetensors import safe_open

    total = 0
    for shard in folder.glob("shard-*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            total += len(f.get_tensor("cu_seqlens")) - 1
    return total


def shard_names(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("shard-*.safetensors")}


def planned(layout) -> list[str]:
    from eagle3_assets.core.hidden_states.extraction import planned_shards

    return [p.name for p in planned_shards(layout)]


def test_terminate_stops_every_step_and_server_on_every_node(cluster, chat, tmp_path):
    """Terminate from the UI's API, while each node's step is extracting through its own server: the run ends
    CANCELED, the steps' Ray jobs are stopped and no server is left on any node."""
    from .support.dagster_dev import DagsterDev, prepare_home

    path = ray_project(tmp_path, cluster, pools={"llm_api": 1, "gpu": 2})
    write_tokens(chat, tmp_path / "data", repeat=8)  # 64 samples: the servers are busy when it lands
    home = tmp_path / "dagster_home"
    prepare_home(home, path, "local")
    with DagsterDev(path, home) as dev:
        launched = dev.launch_run(HIDDEN_STATES_JOB, "B1", {})
        assert launched["__typename"] == "LaunchRunSuccess", launched
        run_id = launched["run"]["runId"]
        wait_for("a server on each node", lambda: len(vllm_servers()) == 2)
        assert dev.terminate(run_id)["__typename"] == "TerminateRunSuccess"
        terminated = time.monotonic()
        assert dev.wait_run(run_id, 300)["status"] == "CANCELED"
        wait_for("no server left", lambda: not vllm_servers(), timeout_s=120)
        stopped_s = time.monotonic() - terminated
    steps = [j for j in cluster.jobs() if j["metadata"].get("dagster/run-id") == run_id]
    assert steps and all(j["status"] in ("STOPPED", "FAILED", "SUCCEEDED") for j in steps), steps
    assert not any(j["status"] == "RUNNING" for j in cluster.jobs())
    print(f"terminated: every server gone {stopped_s:.0f} s after Terminate")
