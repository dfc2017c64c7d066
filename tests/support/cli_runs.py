"""A stage run through the real command line (`dagster asset materialize` in a subprocess), and a crash of it
at a moment the test chooses: what a user's terminal or a killed pod does to a run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .engine_runs import KEY_ENV
from .projects import REPO


def materialize_cmd(select: str = "prompts,responses") -> list[str]:
    return [
        sys.executable,
        "-m",
        "dagster",
        "asset",
        "materialize",
        "-m",
        "eagle3_assets.definitions",
        "--select",
        select,
        "--partition",
        "B1",
    ]


def env_for(config: Path, dagster_home: Path, key: str) -> dict[str, str]:
    dagster_home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "EAGLE3_CONFIG": str(config), "DAGSTER_HOME": str(dagster_home), KEY_ENV: key}


def kill_once_written(
    cmd: list[str], folder: Path, pattern: str, count: int, timeout_s: float, env: dict | None = None
) -> None:
    """Start `cmd` in its own session, wait until `folder` holds `count` files matching `pattern`, then
    kill -9 its whole process group: a crash at a moment the test chose, mid-run."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(list(folder.glob(pattern))) < count:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
