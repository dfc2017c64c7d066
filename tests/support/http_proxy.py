"""A real forward proxy on loopback for the proxy tests: proxy.py (PyPI `proxy.py`) in a process of its own,
with the recording plugin of `proxy_plugin.py`. `records()` lists what it accepted, in order: `connects()` the
CONNECT tunnels (`host:port`), `forwarded()` the absolute-form requests (`METHOD http://host:port/path`);
`watch` is a string (an API key) whose appearance in any header the proxy receives is recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .projects import REPO

USER, PASSWORD = "eagle", "pr0xy-s3cret-pw"


class RecordingProxy:
    def __init__(
        self, folder: Path, basic_auth: str | None = None, forbid: tuple[str, ...] = (), watch: str = ""
    ):
        self.folder = Path(folder)
        self.basic_auth = basic_auth
        self.forbid = forbid
        self.watch = watch
        self.record = self.folder / "proxy-records.jsonl"
        self.port_file = self.folder / "proxy.port"
        self.log = self.folder / "proxy.log"
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_with(self, user: str, password: str) -> str:
        return f"http://{user}:{password}@127.0.0.1:{self.port}"

    def __enter__(self) -> RecordingProxy:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.record.write_text("")
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        env.update(
            PYTHONPATH=str(REPO),
            EAGLE3_PROXY_RECORD=str(self.record),
            EAGLE3_PROXY_FORBID=",".join(self.forbid),
            EAGLE3_PROXY_WATCH=self.watch,
        )
        argv = [
            sys.executable, "-m", "proxy",
            "--hostname", "127.0.0.1", "--port", "0", "--port-file", str(self.port_file),
            "--num-acceptors", "1", "--num-workers", "1",
            "--plugins", "tests.support.proxy_plugin.RecordingPlugin",
            "--log-level", "WARNING", "--log-file", str(self.log),
        ]  # fmt: skip
        if self.basic_auth:
            argv += ["--basic-auth", self.basic_auth]
        self.proc = subprocess.Popen(
            argv, env=env, cwd=self.folder, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                log = self.log.read_text() if self.log.exists() else ""
                raise RuntimeError(f"proxy.py did not start (exit {self.proc.returncode}):\n{log[-2000:]}")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text().split()[0])
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def reset(self) -> None:
        """Forget what was recorded (between tests; the proxy appends, so truncating while idle is safe)."""
        self.record.write_text("")

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]

    def connects(self) -> list[str]:
        return [f"{r['host']}:{r['port']}" for r in self.records() if r["method"] == "CONNECT"]

    def forwarded(self) -> list[str]:
        return [
            f"{r['method']} http://{r['host']}:{r['port']}{r['path']}"
            for r in self.records()
            if r["method"] != "CONNECT"
        ]
