"""Steps on a Ray cluster (`execution.executor: ray`): dagster-ray's step handler, each step a Ray job.

Spreading GPU work over machines is an existing engine's job, never a home-made one: every step of a run is
submitted to the cluster's job API as `dagster api execute_step`, and Ray places it. A GPU step (pool `gpu`:
an extraction step that starts its own vLLM, the acceptance gate) asks for `execution.ray.gpu_step_resources`
as the job's entrypoint resources, so Ray runs it on a node that holds them and never runs two on one GPU
slot; every other step asks for nothing and runs on the head node. On Kubernetes the cluster is KubeRay's.

What a step gets is decided here, from the project config, when the definitions load: the executor takes no
run config (the launch guard refuses `execution`), and the steps' environment carries the config file's path
and the instance's home, nothing chosen at launch. The API key is never put in a job's runtime environment
(Ray shows it in its dashboard): a `responses` step on Ray reads it from its node's environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.definitions.executor_definition import multiple_process_executor_requirements
from dagster._core.events import DagsterEvent
from dagster._core.execution.retries import RetryMode
from dagster._core.executor.init import InitExecutorContext
from dagster._core.executor.step_delegating import StepDelegatingExecutor, StepHandlerContext

from .config import ProjectConfig
from .k8s import StepKind, executed_ops

# Read from the process that runs the run, and set in every step's job: where the config and the instance
# are, where the cached environments are, and the interpreter's PATH (`dagster` and vLLM's CPU build).
STEP_ENV = ("EAGLE3_CONFIG", "DAGSTER_HOME", "EAGLE3_CACHE", "HOME", "PATH", "HF_HOME", "HF_HUB_OFFLINE")


def op_name(step_key: str) -> str:
    """The op a step runs: `hidden_states.extract_hidden_states_managed[replica_0_of_2]` ->
    `extract_hidden_states_managed` (the node name inside a graph-backed asset, as `executed_ops` keys it)."""
    return step_key.split("[", 1)[0].rsplit(".", 1)[-1]


def step_env(config_path: str) -> dict[str, str]:
    """Every step's environment: `STEP_ENV` as this process has it, the config file the definitions were
    built from (so the step loads the very same one), and this interpreter's folder first on PATH: a step's
    `dagster api execute_step` runs in the installation that built the run, wherever Ray starts it."""
    env = {name: os.environ[name] for name in STEP_ENV if name in os.environ}
    env["EAGLE3_CONFIG"] = os.path.abspath(config_path)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    return env


def placed_step_handler(
    client: Any, kinds: Mapping[str, StepKind], gpu_resources: Mapping[str, float], env: Mapping[str, str]
) -> Any:
    """dagster-ray's step handler, asking Ray for `gpu_resources` for the steps of GPU ops."""
    from dagster_ray.core.executor import RayStepHandler

    class PlacedRayStepHandler(RayStepHandler):
        @property
        def name(self) -> str:
            return "PlacedRayStepHandler"

        def launch_step(self, step_handler_context: StepHandlerContext) -> Iterator[DagsterEvent]:
            step = self._get_step_key(step_handler_context)
            gpu = kinds.get(op_name(step)) == "gpu"
            # A fresh dict per step: the parent class adds the step's own tag resources to it in place.
            self.resources = dict(gpu_resources) if gpu else {}
            yield from super().launch_step(step_handler_context)

    return PlacedRayStepHandler(
        client=client,
        env_vars=None,
        runtime_env={"env_vars": dict(env)},
        num_cpus=None,
        num_gpus=None,
        memory=None,
        resources=None,
    )


def ray_executor(
    cfg: ProjectConfig,
    config_path: str,
    nodes: Iterable[dg.AssetsDefinition | dg.AssetChecksDefinition],
) -> dg.ExecutorDefinition:
    """The executor of `execution.executor: ray` for these definitions."""
    kinds = executed_ops(nodes)
    ray = cfg.execution.ray
    env = step_env(config_path)
    max_concurrent = cfg.execution.max_concurrent_steps

    @dg.executor(name="ray", requirements=multiple_process_executor_requirements())
    def eagle3_ray_executor(_init_context: InitExecutorContext) -> StepDelegatingExecutor:
        from ray.job_submission import JobSubmissionClient

        client = JobSubmissionClient(ray.address)
        return StepDelegatingExecutor(
            placed_step_handler(client, kinds, ray.gpu_step_resources, env),
            retries=RetryMode.DISABLED,
            max_concurrent=max_concurrent,
            should_verify_step=True,
        )

    return eagle3_ray_executor
