"""Real services for end-to-end tests: `dagster dev` (webserver + daemon) and a PostgreSQL server, both
started by the test on free loopback ports and stopped afterwards, and the small project and DAGSTER_HOME they
serve."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from resources.vllm.server import free_port

from .projects import REPO, make_project, user_rows

LAUNCH_BACKFILL = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
    ... on PartitionKeysNotFoundError { message }
    ... on InvalidSubsetError { message }
    ... on UnauthorizedError { message }
  }
}"""

BACKFILL_STATUS = """
query($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill { status numPartitions
      runs(limit: 50) { id status tags { key value } assetSelection { path } } }
    ... on PythonError { message }
  }
}"""


LAUNCH_RUN = """
mutation($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on PythonError { message }
    ... on InvalidSubsetError { message }
  }
}"""

RUN_STATUS = """
query($id: ID!) {
  runOrError(runId: $id) {
    __typename ... on Run { status startTime endTime tags { key value } } ... on PythonError { message }
  }
}"""

RUNS_WITH_TAG = """
query($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs { results { runId status startTime tags { key value } } }
    ... on PythonError { message }
  }
}"""

REEXECUTE = """
mutation($params: ReexecutionParams!) {
  launchRunReexecution(reexecutionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
  }
}"""

TERMINATE = """
mutation($ids: [String!]!) { terminateRuns(runIds: $ids, terminatePolicy: SAFE_TERMINATE) {
  __typename ... on TerminateRunsResult { terminateRunResults { __typename
    ... on TerminateRunSuccess { run { runId } } ... on TerminateRunFailure { message } } } } }"""
RUN_MESSAGES = """
query($id: ID!) {
  logsForRun(runId: $id, limit: 1000) {
    __typename
    ... on EventConnection { events {
      __typename
      ... on MessageEvent { message }
      ... on ExecutionStepFailureEvent { error { message causes { message } } }
      ... on RunFailureEvent { error { message causes { message } } }
      ... on EngineEvent { error { message causes { message } } }
    } }
  }
}"""

LOCATION = "eagle3_assets"  # workspace.yaml
REPOSITORY = "__repository__"  # a Definitions object's repository


def small_project(tmp_path: Path) -> Path:
    """Two datasets of a few short prompts (B1: two, B2: one), one slot in each pool."""
    return make_project(
        tmp_path,
        {
            "B1": {"rows": user_rows(["What is 2+2?", "Name a colour."]), "max_tokens": 8},
            "B2": {"rows": user_rows(["Say hi."]), "max_tokens": 8},
        },
        pools={"llm_api": 1, "gpu": 1},
    )


def prepare_home(home: Path, config: Path, template: str, env: dict | None = None) -> None:
    """A DAGSTER_HOME from deploy/<template>'s instance file, with the config's pool limits applied (`eagle3
    instance`)."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "deploy" / template / "dagster.yaml", home / "dagster.yaml")
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "--config", str(config), "instance"],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(home), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


class DagsterDev:
    """`dagster dev -w workspace.yaml` (or another workspace file) on 127.0.0.1:<free port>, in its own
    process group."""

    def __init__(
        self,
        config: Path,
        dagster_home: Path,
        env: dict[str, str] | None = None,
        workspace: Path = REPO / "workspace.yaml",
    ):
        import yaml

        self.workspace = workspace
        entries = yaml.safe_load(workspace.read_text())["load_from"]
        self.locations = {next(iter(e.values()))["location_name"] for e in entries}
        self.port = free_port()
        self.home = dagster_home
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = dagster_home / "dagster-dev.log"
        self.env = {
            **os.environ,
            "EAGLE3_CONFIG": str(config),
            "DAGSTER_HOME": str(dagster_home),
            "DAGSTER_DISABLE_TELEMETRY": "1",
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DagsterDev:
        self._log = open(self.log_path, "w")  # the child writes to it until __exit__ closes it
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dagster",
                "dev",
                "-w",
                str(self.workspace),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
            ],
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc and self.proc.poll() is None, f"dagster dev exited:\n{self.log_tail()}"
            try:
                data = self.graphql(
                    "{ repositoriesOrError { __typename ... on RepositoryConnection "
                    "{ nodes { name location { name } } } } }"
                )
                loaded = {n["location"]["name"] for n in data["repositoriesOrError"].get("nodes", [])}
                if loaded >= self.locations:  # every location of the workspace
                    return
            except (urllib.error.URLError, ConnectionError, OSError, KeyError):
                pass
            time.sleep(1)
        raise TimeoutError(f"dagster dev not ready in {timeout}s:\n{self.log_tail()}")

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(
            f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.loads(resp.read())
        if out.get("errors"):
            raise RuntimeError(out["errors"])
        return out["data"]

    def launch_backfill(
        self, assets: list[str], partitions: list[str], title: str = "e2e", tags: dict[str, str] | None = None
    ) -> str:
        params = {
            "assetSelection": [{"path": [a]} for a in assets],
            "partitionNames": partitions,
            "title": title,
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()],
        }
        res = self.graphql(LAUNCH_BACKFILL, {"params": params})["launchPartitionBackfill"]
        assert res["__typename"] == "LaunchBackfillSuccess", res
        return res["backfillId"]

    def wait_backfill(self, backfill_id: str, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            b = self.graphql(BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]
            if b.get("status") in (
                "COMPLETED",
                "COMPLETED_SUCCESS",
                "COMPLETED_FAILED",
                "FAILED",
                "CANCELED",
            ):
                return b
            time.sleep(2)
        raise TimeoutError(f"backfill {backfill_id} not done in {timeout}s:\n{self.log_tail()}")

    def launch_run(
        self, job: str, partition: str, run_config: dict, tags: dict[str, str] | None = None
    ) -> dict:
        tags = {"dagster/partition": partition, **(tags or {})}
        params = {
            "selector": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "jobName": job},
            "runConfigData": run_config,
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in tags.items()]},
        }
        return self.graphql(LAUNCH_RUN, {"params": params})["launchRun"]

    def reexecute(self, run_id: str) -> dict:
        """Re-execute a run as the UI's *Re-execute all* does (with the parent's tags)."""
        params = {"parentRunId": run_id, "strategy": "ALL_STEPS"}
        return self.graphql(REEXECUTE, {"params": params})["launchRunReexecution"]

    def runs_with_tag(self, key: str, value: str) -> list[dict]:
        """Every run carrying tag `key`=`value`: id, status, start time and tags (as a dict)."""
        found = self.graphql(RUNS_WITH_TAG, {"filter": {"tags": [{"key": key, "value": value}]}})
        runs = found["runsOrError"]["results"]
        return [{**r, "tags": {t["key"]: t["value"] for t in r["tags"]}} for r in runs]

    def wait_run(self, run_id: str, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.graphql(RUN_STATUS, {"id": run_id})["runOrError"]
            if run.get("status") in ("SUCCESS", "FAILURE", "CANCELED"):
                return run
            time.sleep(1)
        raise TimeoutError(f"run {run_id} not done in {timeout}s:\n{self.log_tail()}")

    def terminate(self, run_id: str) -> dict:
        """Terminate a run as the UI's *Terminate* button does; the mutation's result for it."""
        return self.graphql(TERMINATE, {"ids": [run_id]})["terminateRuns"]["terminateRunResults"][0]

    def run_messages(self, run_id: str) -> str:
        """Every message and error text of a run's event log, one per line."""
        events = self.graphql(RUN_MESSAGES, {"id": run_id})["logsForRun"].get("events", [])
        lines = []
        for e in events:
            lines.append(e.get("message") or "")
            err = e.get("error") or {}
            lines.append(err.get("message") or "")
            lines += [c.get("message") or "" for c in err.get("causes") or []]
        return "\n".join(x for x in lines if x)

    def run_event_types(self, run_id: str) -> list[str]:
        """The GraphQL type of each event in a run's log, in order (RunEnqueuedEvent, RunStartEvent, ...)."""
        events = self.graphql(RUN_MESSAGES, {"id": run_id})["logsForRun"].get("events", [])
        return [e["__typename"] for e in events]

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def postgres_bin() -> Path | None:
    """Debian's PostgreSQL server binaries (initdb, pg_ctl), newest version first."""
    base = Path("/usr/lib/postgresql")
    for version in sorted(base.glob("*"), key=lambda p: p.name, reverse=True) if base.exists() else []:
        if (version / "bin" / "initdb").exists():
            return version / "bin"
    return None


class PostgresServer:
    """A throwaway PostgreSQL cluster on a free port, run as the `postgres` system user (it refuses root)."""

    def __init__(self, root: Path):
        self.bin = postgres_bin()
        assert self.bin, "PostgreSQL is not installed: `make test` installs Debian's postgresql"
        self.root = root
        self.data = root / "pgdata"
        self.port = free_port()
        self.user, self.password, self.db = "eagle3", "eagle3-test", "dagster"

    def _as_postgres(self, *args: str) -> subprocess.CompletedProcess:
        runner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*runner, *args], check=True, capture_output=True, text=True, timeout=120)

    def __enter__(self) -> PostgresServer:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            os.chmod(self.root, 0o755)
            for parent in self.root.parents:  # the server process must reach its data directory
                if parent == Path("/"):
                    break
                os.chmod(parent, os.stat(parent).st_mode | 0o011)
        self._as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self._as_postgres(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.root / "pg.log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1",
            "start",
        )
        self._psql("postgres", f"CREATE USER {self.user} PASSWORD '{self.password}'")
        self._psql("postgres", f"CREATE DATABASE {self.db} OWNER {self.user}")
        return self

    def env(self) -> dict[str, str]:
        return {
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USERNAME": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.db,
        }

    def _psql(self, db: str, sql: str) -> str:
        return self._as_postgres(
            str(self.bin / "psql"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            db,
            "-At",
            "-c",
            sql,
        ).stdout

    def query(self, sql: str) -> str:
        return self._psql(self.db, sql)

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
