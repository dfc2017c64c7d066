"""A server this process started is stopped with every process it started: vLLM's API server starts an engine
core and workers, and terminating the API server alone once left `VLLM::Worker` processes running after the
tests.

A real process tree stands in for the server (no vLLM here: what is tested is the stop, not the server): a
leader in its own session, as `launch` starts it, with a worker that ignores SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from resources.vllm.server import RunningServer, ServeSpec

WORKER = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(600)"
)
LEADER = f"""
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], stdout=subprocess.PIPE, text=True)
worker.stdout.readline()
print(worker.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait here for a reaper that never comes)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_stopping_a_server_stops_the_workers_it_started(tmp_path):
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    worker = int(leader.stdout.readline())
    assert running(worker)
    spec = ServeSpec(model="", aux_layers=[1], num_layers=30, storage_path=str(tmp_path))
    server = RunningServer("http://127.0.0.1:9/v1", tmp_path, spec, leader, tmp_path / "server.log")
    try:
        server.stop()
        assert leader.returncode is not None
        deadline = time.monotonic() + 10  # SIGKILL is delivered at once; its exit is observed a moment later
        while running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(worker)
        server.stop()  # stopping twice is harmless
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)  # where the stop failed, the worker does not outlive the test


def test_a_stand_in_outside_its_own_session_is_stopped_too(tmp_path):
    """The tests' stand-in for a server started by hand (`EAGLE3_TEST_VLLM_*`) is a plain child of this
    process."""
    idle = subprocess.Popen(["sleep", "600"])
    spec = ServeSpec(model="", aux_layers=[1], num_layers=30, storage_path=str(tmp_path))
    RunningServer("http://127.0.0.1:9/v1", tmp_path, spec, idle, Path("/dev/null")).stop()
    assert idle.returncode is not None
