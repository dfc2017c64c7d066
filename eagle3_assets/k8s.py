"""Step pods under `execution.executor: k8s`: what `k8s_job_executor` gives each kind of step.

dagster-k8s builds a step's pod from, in order, the run launcher's config (the run pod's size, volumes and
environment, from the Helm values), the code location's container context, the executor's `step_k8s_config`,
the op's `dagster-k8s/config` tag and the executor's `per_step_k8s_config[op name]`, each merged key by key
onto the one before. So whatever sizes the run pod (`runK8sConfig` in deploy/k8s/values.yaml: it only
orchestrates) reaches every step pod unless the executor replaces it. This module builds that executor
config from the project config:

- every step: `step_k8s_config` with the `cpu` kind's requests, so no step keeps the run pod's;
- `responses` steps (pool `llm_api`): the `responses` kind's requests and the API key's secret as environment
  variables, which no other pod receives;
- GPU steps (pool `gpu`): the `gpu` kind's requests, `nvidia.com/gpu`, the GPU nodes' toleration and a
  memory-backed `/dev/shm`.

The kind comes from the op's pool, the one mark a GPU step already carries for Dagster's own concurrency
limits, so a GPU op added later is sized as one without being listed here. Nothing here is read at launch:
the executor is configured when the definitions load, and the launch guard refuses run config and tags that
would change it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import dagster as dg

from .config import ProjectConfig
from .config.vllm_server import VllmServerConfig

if TYPE_CHECKING:
    from dagster._core.definitions.node_definition import NodeDefinition

StepKind = Literal["cpu", "responses", "gpu"]
GPU_POOL = "gpu"
API_POOL = "llm_api"
# The ops whose steps start a vLLM server of their own: the acceptance gate, a managed extraction step.
ACCEPTANCE_STEP = "acceptance"
MANAGED_EXTRACTION_STEP = "extract_hidden_states_managed"
GPU_RESOURCE = "nvidia.com/gpu"
# GPU node pools are commonly tainted so that only pods asking for GPUs land there (GKE and EKS do it).
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
SHM_VOLUME = "dshm"


def step_kind(op: dg.OpDefinition) -> StepKind:
    """Which pod an op's steps get, from its pool."""
    if op.pool == GPU_POOL:
        return "gpu"
    if op.pool == API_POOL:
        return "responses"
    return "cpu"


def _ops(node: NodeDefinition, name: str) -> Iterator[tuple[str, dg.OpDefinition]]:
    """(node name, op) of `node` and, in a graph, of every node inside it."""
    if isinstance(node, dg.OpDefinition):
        yield name, node
    elif isinstance(node, dg.GraphDefinition):
        for child in node.nodes:
            yield from _ops(child.definition, child.name)


def executed_ops(nodes: Iterable[dg.AssetsDefinition | dg.AssetChecksDefinition]) -> dict[str, StepKind]:
    """Kind of every op the definitions execute, by the name `per_step_k8s_config` keys it by (the op's node
    name: for a graph-backed asset, the name of the node inside the graph). Two ops of one name that need
    different pods are a definitions error: the executor could not tell their steps apart."""
    kinds: dict[str, StepKind] = {}
    for definition in nodes:
        for name, op in _ops(definition.node_def, definition.node_def.name):
            kind = step_kind(op)
            if kinds.setdefault(name, kind) != kind:
                raise dg.DagsterInvalidDefinitionError(
                    f"two ops named {name!r} need different step pods ({kinds[name]} and {kind}): "
                    "k8s_job_executor's per-step config is keyed by op name"
                )
    return kinds


def step_gpus(cfg: ProjectConfig, op_name: str) -> int:
    """GPUs a GPU step asks for: `execution.k8s_steps.gpu.gpus`, except that a step starting a vLLM server
    of its own (the acceptance gate with `acceptance.engine: vllm`, a managed extraction step) with a fixed
    tensor-parallel size asks for the devices that server spans (with `tensor_parallel_size: null` the server
    takes every GPU the pod sees, so the configured count rules)."""
    served = server_of_step(cfg, op_name)
    if served is not None and served.tensor_parallel_size:
        return served.tensor_parallel_size * served.pipeline_parallel_size
    return cfg.execution.k8s_steps.gpu.gpus


def server_of_step(cfg: ProjectConfig, op_name: str) -> VllmServerConfig | None:
    """The vLLM server a step starts itself, if it does."""
    if op_name == ACCEPTANCE_STEP and cfg.acceptance.engine == "vllm":
        return cfg.acceptance.vllm
    hs = cfg.hidden_states
    if op_name == MANAGED_EXTRACTION_STEP and hs.engine == "vllm" and hs.vllm.managed:
        return hs.vllm
    return None


def pod_config(cfg: ProjectConfig, kind: StepKind, op_name: str = "") -> dict[str, Any]:
    """The `dagster-k8s/config`-shaped settings of one kind of step pod (snake_case, as dagster-k8s takes
    them). CPU and memory are always both set: a key left out would keep the run pod's value."""
    sizes = cfg.execution.k8s_steps
    size = {"cpu": sizes.cpu, "responses": sizes.responses, "gpu": sizes.gpu}[kind]
    requests: dict[str, str] = {"cpu": size.cpu, "memory": size.memory}
    limits: dict[str, str] = {"memory": size.memory}
    container: dict[str, Any] = {"resources": {"requests": requests, "limits": limits}}
    pod: dict[str, Any] = {}
    if kind == "responses":
        container["env_from"] = [{"secret_ref": {"name": cfg.execution.k8s_api_key_secret}}]
    if kind == "gpu":
        gpus = str(step_gpus(cfg, op_name))
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = gpus
        container["volume_mounts"] = [{"name": SHM_VOLUME, "mount_path": "/dev/shm"}]
        pod["tolerations"] = [GPU_TOLERATION]
        pod["volumes"] = [
            {"name": SHM_VOLUME, "empty_dir": {"medium": "Memory", "size_limit": sizes.gpu.shm}}
        ]
    return {"container_config": container, **({"pod_spec_config": pod} if pod else {})}


def k8s_executor_config(
    cfg: ProjectConfig, nodes: Iterable[dg.AssetsDefinition | dg.AssetChecksDefinition]
) -> dict[str, Any]:
    """`k8s_job_executor`'s config for these definitions: the `cpu` kind for every step, the other kinds
    per op."""
    per_step = {
        name: pod_config(cfg, kind, name) for name, kind in executed_ops(nodes).items() if kind != "cpu"
    }
    return {
        "max_concurrent": cfg.execution.max_concurrent_steps,
        "step_k8s_config": pod_config(cfg, "cpu"),
        "per_step_k8s_config": per_step,
    }
