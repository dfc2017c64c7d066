"""The Kubernetes deployment as its files describe it, installed into the recording API server
(tests/support/k8s_api.py), and the real dagster-k8s launcher and executor driven against it.

`install` does what deploy/k8s says to do before the chart: the `kubectl create` and `kubectl apply -f`
commands written at the top of values.yaml and vllm.yaml, through the kubernetes client's own
`create_from_dict` (as `kubectl create` posts them), then the objects the chart creates (helm_chart.py). A
volume or secret that no deploy file defines is then missing from the cluster, and a Job that mounts it shows
up in `RecordingApiServer.missing_references`.

`launch_run` goes the way of a run in the cluster: the chart's code server (`dagster api grpc` with the
environment the chart gives it: the image, the container context), a run of one of its jobs created from the
code location, and the instance's K8sRunLauncher (configured as the chart renders dagster.yaml) launching it.
`launch_steps` then does what that run's pod does with `k8s_job_executor`: Dagster builds the run's
orchestration context (the executor from the definitions, as `dagster api execute_run` does) and the
executor's own step handler launches a Job for every step of the plan.
"""

from __future__ import annotations

import base64
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .helm_chart import Release
from .k8s_api import RecordingApiServer
from .projects import REPO

DEPLOY = REPO / "deploy" / "k8s"
LOCATION = "eagle3-assets"


def documented_commands(path: Path) -> list[list[str]]:
    """The `kubectl` commands in the comment lines of a deploy file, split as a shell would."""
    commands, pending = [], ""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            pending = ""
            continue
        text = line.lstrip("# ").strip()
        if pending:
            text = f"{pending} {text}"
        elif not text.startswith("kubectl "):
            continue
        pending = text[:-1].rstrip() if text.endswith("\\") else ""
        if not pending:
            commands.append(shlex.split(text))
    return commands


def manifests(path: Path) -> list[dict[str, Any]]:
    """The Kubernetes objects of a YAML file (documents with an apiVersion and a kind)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [d for d in docs if isinstance(d, dict) and "apiVersion" in d and "kind" in d]


def _object_from_command(cmd: list[str]) -> dict[str, Any] | None:
    """What `kubectl create secret generic` / `kubectl create configmap` would post (run from the repository
    root, as the files say)."""
    if cmd[:3] == ["kubectl", "create", "configmap"]:
        kind, name, rest = "ConfigMap", cmd[3], cmd[4:]
    elif cmd[:4] == ["kubectl", "create", "secret", "generic"]:
        kind, name, rest = "Secret", cmd[4], cmd[5:]
    else:
        return None
    data: dict[str, str] = {}
    for arg in rest:
        option, _, value = arg.partition("=")
        key, _, source = value.partition("=")
        if option == "--from-literal":
            data[key] = source
        elif option == "--from-file":
            data[key] = (REPO / source).read_text()
        else:
            raise ValueError(f"unsupported kubectl option in a deploy file: {arg}")
    if kind == "Secret":
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "type": "Opaque",
            "data": encoded,
        }
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def deploy_objects(release: Release) -> list[dict[str, Any]]:
    """Every object the deploy files create, in the order they say: their kubectl commands (values.yaml
    first, then vllm.yaml's), then the chart's own."""
    objects: list[dict[str, Any]] = []
    for path in (DEPLOY / "values.yaml", DEPLOY / "vllm.yaml"):
        for cmd in documented_commands(path):
            if cmd[:2] == ["kubectl", "apply"]:
                objects += manifests(REPO / cmd[cmd.index("-f") + 1])
            elif (obj := _object_from_command(cmd)) is not None:
                objects.append(obj)
    return objects + release.objects()


def install(api: RecordingApiServer, kubeconfig: Path, release: Release) -> None:
    """Create the deployment's objects through the kubernetes client."""
    from kubernetes import config, utils

    client = config.new_client_from_config(str(kubeconfig))
    for obj in deploy_objects(release):
        utils.create_from_dict(client, obj, namespace=release.namespace)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class CodeServer:
    port: int
    process: subprocess.Popen


@contextmanager
def code_server(release: Release, config: Path, log: Path) -> Iterator[CodeServer]:
    """The chart's user-code server for deploy/k8s/values.yaml's deployment, serving the definitions built
    from `config` (the pod reads it at /config/eagle3.yaml from the config map)."""
    from dagster._grpc.client import DagsterGrpcClient

    deployment = release.deployments[0]
    args, env = release.code_server(deployment)
    env["EAGLE3_CONFIG"] = str(config)
    env["PYTHONPATH"] = str(REPO)  # this checkout's code, whatever the environment has installed
    port = _free_port()
    cmd = [sys.executable, "-m", "dagster", "api", "grpc", "-h", "127.0.0.1", "-p", str(port), *args]
    with open(log, "w") as out:
        process = subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        client = DagsterGrpcClient(port=port, host="127.0.0.1")
        deadline = time.monotonic() + 120
        while True:
            try:
                client.ping("ready")
                break
            except Exception:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the code server did not start: {log.read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield CodeServer(port, process)
    finally:
        process.terminate()
        process.wait(30)


def launch_run(instance: Any, server: CodeServer, job_name: str, partition: str) -> Any:
    """Create a run of `job_name` from the code server's location and launch it with the instance's
    launcher; return the run."""
    from dagster._core.test_utils import create_run_for_test
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import GrpcServerTarget

    target = GrpcServerTarget(host="127.0.0.1", port=server.port, socket=None, location_name=LOCATION)
    with WorkspaceProcessContext(instance, target) as workspace:
        request = workspace.create_request_context()
        location = request.get_code_location(LOCATION)
        repository = next(iter(location.get_repositories().values()))
        remote_job = repository.get_full_job(job_name)
        run = create_run_for_test(
            instance,
            job_name=job_name,
            remote_job_origin=remote_job.get_remote_origin(),
            job_code_origin=remote_job.get_python_origin(),
            tags={"dagster/partition": partition},
        )
        instance.launch_run(run.run_id, request)
    return instance.get_run_by_id(run.run_id)


def launch_steps(
    instance: Any, run: Any, dynamic: Mapping[str, Mapping[str, list[str]]] | None = None
) -> list[str]:
    """Launch a Job for every step of `run`'s plan with the executor its definitions configure, as the run
    pod does; `dynamic` gives the mapping keys of dynamic outputs (step key -> output -> keys). Returns the
    step keys launched."""
    from dagster._core.execution.api import create_execution_plan
    from dagster._core.execution.context_creation_job import (
        PlanOrchestrationContextManager,
        orchestration_context_event_generator,
    )
    from dagster._core.execution.plan.state import KnownExecutionState
    from dagster._core.executor.step_delegating.step_handler.base import StepHandlerContext
    from dagster._grpc.types import ExecuteStepArgs
    from dagster._utils.hosted_user_process import recon_job_from_origin

    job = recon_job_from_origin(run.job_code_origin)  # what `dagster api execute_run` loads in the run pod
    known = KnownExecutionState(dynamic_mappings={k: dict(v) for k, v in (dynamic or {}).items()})
    plan = create_execution_plan(job, run_config=run.run_config, tags=run.tags, known_state=known)
    plan.resolve(known.dynamic_mappings)  # as ActiveExecution does once the dynamic outputs are known
    manager = PlanOrchestrationContextManager(
        orchestration_context_event_generator, job, plan, run.run_config, run, instance, raise_on_error=True
    )
    list(manager.prepare_context())
    context = manager.get_context()
    try:
        executor = context.executor
        handler = executor._step_handler  # the K8sStepHandler that StepDelegatingExecutor.execute drives
        launched = []
        for step in plan.get_steps_to_execute_in_topo_order():
            args = ExecuteStepArgs(  # as StepDelegatingExecutor._get_step_handler_context builds them
                job_origin=context.reconstructable_job.get_python_origin(),
                run_id=run.run_id,
                step_keys_to_execute=[step.key],
                instance_ref=instance.get_ref(),
                retry_mode=executor.retries.for_inner_plan(),
                known_state=known,
                should_verify_step=True,
                print_serialized_events=False,
            )
            list(handler.launch_step(StepHandlerContext(instance, context, [step], args, run)))
            launched.append(step.key)
        return launched
    finally:
        list(manager.shutdown_context())
