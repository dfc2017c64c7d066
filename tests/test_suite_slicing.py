"""A slice of the suite pays only for its own set-up: `--collect-only`, and a `-k` run of one light test,
start none of the heavy side environments (the training frameworks', the image's install, vLLM's CPU build)
and no vLLM server.

Each run is a real pytest session over the whole tests/ folder in a subprocess, with the cache root
(`EAGLE3_CACHE`, where `resources.side_env` builds every side environment) and the temporary folder (where a
session vLLM server keeps its log and connector files) pointed at empty folders of this test: the session's
collection hook starting any of that set-up creates a folder there at once (`side_env.ensure` makes its base
folder before building). With the hook run before pytest's own deselection, as it once was, both runs fail
here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .support.projects import REPO

LIGHT_TEST = "test_the_description_check_names_each_undocumented_key_at_any_depth"
TIMEOUT_S = 400  # a whole-suite collection on a loaded 2-core machine takes under a minute


def _pytest_session(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run pytest over tests/ with `args`; fails as soon as the session starts any heavy set-up (it would
    otherwise go on building for minutes), else returns its exit status and output."""
    cache, tmp, log = tmp_path / "cache", tmp_path / "tmp", tmp_path / "pytest.log"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_TEST_VLLM_")}
    env |= {"EAGLE3_CACHE": str(cache), "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "--durations=0", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None:
            started = _started(cache, tmp)
            assert not started, f"`pytest {' '.join(args)}` started heavy set-up: {started}"
            assert time.monotonic() < deadline, f"`pytest {' '.join(args)}` still running after {TIMEOUT_S}s"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _started(cache, tmp) == []
    return proc.returncode, log.read_text()


def _started(cache: Path, tmp: Path) -> list[str]:
    """What a session's heavy set-up leaves behind: side-environment folders, vLLM server folders."""
    made = [p for p in (cache / "consumers", cache / "environments") if p.exists()]
    return [str(p) for p in [*made, *tmp.glob("eagle3-vllm-*")]]


def test_collecting_the_suite_starts_nothing(tmp_path):
    status, out = _pytest_session(tmp_path, "--collect-only")
    assert status == 0, out[-3000:]
    assert "tests collected" in out  # the whole suite, the heavy tests' markers included


def test_a_k_run_of_one_light_test_starts_nothing_else(tmp_path):
    status, out = _pytest_session(tmp_path, "-k", LIGHT_TEST)
    assert status == 0, out[-3000:]
    assert "1 passed" in out and "deselected" in out, out[-3000:]
