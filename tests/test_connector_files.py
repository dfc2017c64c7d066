"""The served extraction's wait for connector files, without a server: a file is taken only once its writer
lets go of the lock, a file that never comes is reported with what was last seen, and many waits share one
poller."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

from resources.vllm.extraction import LockWatcher


def test_a_file_is_taken_once_its_writer_lets_go_and_a_missing_one_times_out(tmp_path: Path):
    held = [str(tmp_path / f"held-{k}.safetensors") for k in range(5)]
    fds = []
    for path in held:
        Path(path).write_bytes(b"x")
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # the server is still writing
        fds.append(fd)
    bare = tmp_path / "no-lock.safetensors"
    bare.write_bytes(b"x")  # a connector without the lock protocol

    async def scenario() -> tuple[list[str], str, str, str]:
        watcher = LockWatcher()
        waits = [asyncio.create_task(watcher.wait(p, 5.0)) for p in held]
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waits)  # locked by the writer: nothing is read early
        for fd in fds:
            os.close(fd)  # the writes finish
        states = await asyncio.gather(*waits)
        present = await watcher.wait(str(bare), 5.0)
        missing = await watcher.wait(str(tmp_path / "never.safetensors"), 0.2)
        fd = os.open(str(tmp_path / "stuck.safetensors.lock"), os.O_CREAT | os.O_WRONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            busy = await watcher.wait(str(tmp_path / "stuck.safetensors"), 0.2)
        finally:
            os.close(fd)
        return states, present, missing, busy

    states, present, missing, busy = asyncio.run(scenario())
    assert states == ["locked"] * 5
    assert present == "present"
    assert missing == "missing" and busy == "busy"
