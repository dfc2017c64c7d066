"""A real two-node Ray cluster on loopback for the executor tests: a head node on 127.0.0.2 and a worker node
on 127.0.0.3 (Ray moves a node given 127.0.0.1 to the machine's own address), each with one `accel` slot
standing in for a GPU, started from this project's environment with `ray start --block`, so that each node is
one process tree that a test stops by its pid (`ray stop` kills by name: every Ray process on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from resources.vllm.server import free_port

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
SLOT = "accel"  # the custom resource each node offers once: a GPU step's slot


class RayNode:
    """One node: `ray start --block` in a session of its own, and its log."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]):
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "ray"), "start", *args, "--block"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """The node's whole process tree: its raylet, its workers and the jobs' drivers on it (which Ray
        starts in sessions of their own, so they are found by parentage, before anything is killed)."""
        if self.process.poll() is not None:
            return
        tree = descendants(self.process.pid)
        os.killpg(self.process.pid, sig)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class RayCluster:
    """Head and worker on loopback; `dashboard` is the job API the executor submits to."""

    def __init__(self, root: Path):
        # Ray's socket paths have a length limit: a short temp dir of its own, removed at the end.
        self.temp = Path(f"/tmp/ray-e3-{secrets.token_hex(3)}")
        self.root = root
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.dashboard = f"http://{HEAD_IP}:{self.dashboard_port}"
        self.head: RayNode | None = None
        self.worker: RayNode | None = None

    def env(self) -> dict[str, str]:
        venv_bin = str(Path(sys.executable).parent)
        return {
            **os.environ,
            "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Both "nodes" share this machine's memory with the rest of the suite: Ray's own killer would take
            # the machine's total for one node's and kill the steps' servers long before the kernel needs to.
            "RAY_memory_monitor_refresh_ms": "0",
        }

    def start_worker(self) -> RayNode:
        node = RayNode(
            [
                f"--address={HEAD_IP}:{self.gcs_port}",
                f"--node-ip-address={WORKER_IP}",
                "--num-cpus=2",
                f"--resources={json.dumps({SLOT: 1})}",
            ],
            self.root / f"ray-worker-{time.time_ns()}.log",
            self.env(),
        )
        self.worker = node
        self.wait_for_nodes(2)
        return node

    def __enter__(self) -> RayCluster:
        self.head = RayNode(
            [
                "--head",
                f"--node-ip-address={HEAD_IP}",
                f"--port={self.gcs_port}",
                f"--dashboard-host={HEAD_IP}",
                f"--dashboard-port={self.dashboard_port}",
                "--include-dashboard=true",
                "--num-cpus=2",
                f"--resources={json.dumps({SLOT: 1})}",
                f"--temp-dir={self.temp}",
            ],
            self.root / "ray-head.log",
            self.env(),
        )
        try:
            self.wait_for_nodes(1)
            self.start_worker()
            self.wait_for_jobs()
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_for_jobs(self, timeout_s: float = 120) -> None:
        """Until the job API takes and runs a job (its agents come up after the nodes)."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(self.dashboard)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                probe = client.submit_job(entrypoint="true")
                while client.get_job_status(probe) not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
                    time.sleep(0.5)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def __exit__(self, *exc: object) -> None:
        for node in (self.worker, self.head):
            if node is not None:
                node.stop()
        shutil.rmtree(self.temp, ignore_errors=True)

    def nodes(self, alive_only: bool = True) -> dict[str, str]:
        """Node id -> IP of the cluster's nodes (alive ones, or every one it has seen), from its state API."""
        try:
            with urllib.request.urlopen(f"{self.dashboard}/api/v0/nodes?limit=100", timeout=5) as r:
                data = json.loads(r.read())
        except OSError:
            return {}
        rows = data.get("data", {}).get("result", {}).get("result", [])
        return {n["node_id"]: n["node_ip"] for n in rows if not alive_only or n.get("state") == "ALIVE"}

    def alive_nodes(self) -> dict[str, str]:
        return self.nodes()

    def wait_for_nodes(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.alive_nodes()) < n:
            for node in (self.head, self.worker):
                if node is not None and node.process.poll() is not None:
                    raise RuntimeError(f"a Ray node exited:\n{node.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster has fewer than {n} nodes after {timeout_s:.0f} s")
            time.sleep(1)

    def jobs(self) -> list[dict]:
        """The cluster's jobs with the IP of the node each driver ran on."""
        from ray.job_submission import JobSubmissionClient

        nodes = self.nodes(alive_only=False)
        out = []
        for job in JobSubmissionClient(self.dashboard).list_jobs():
            out.append(
                {
                    "submission_id": job.submission_id,
                    "status": str(job.status),
                    "node": nodes.get(job.driver_node_id or "", job.driver_node_id),
                    "metadata": job.metadata or {},
                }
            )
        return out
