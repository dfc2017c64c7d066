"""hidden_states (GPU): a graph-backed asset that fans a dataset's shards out over as many GPU steps as exist.

plan (one step) -> extract shard (one step per shard: pool "gpu", a GPU requested under k8s_job_executor) -> index.
With the in-process executor (a laptop, a single GPU box) the shards run in turn in one process and the model is
loaded once; under Kubernetes every shard step is its own pod.
"""

import re

import dagster as dg

from resources import Project, Storage

from ..config import ProjectConfig
from ..core.extraction import ExtractionSettings, describe_layout, extract, finish, prepare
from ..core.versions import rows_version
from .common import GROUP

# One GPU per shard step when the run uses k8s_job_executor (ignored by the other executors).
GPU_STEP_TAGS = {
    "dagster-k8s/config": {
        "container_config": {
            "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}
        },
        "pod_spec_config": {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        },
    }
}
IO = "hidden_states_io"


def extraction_settings(cfg: ProjectConfig) -> ExtractionSettings:
    return ExtractionSettings(cfg.target, cfg.hidden_states, cfg.base_dir)


def _mapping_key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


@dg.op(
    ins={"tokens": dg.In(dg.Nothing)},
    out=dg.DynamicOut(str, io_manager_key=IO),
    description="Plan the shards still to extract (finished shards are never recomputed).",
)
def plan_hidden_state_shards(
    context: dg.OpExecutionContext, project: dg.ResourceParam[Project], storage: dg.ResourceParam[Storage]
):
    cfg = project.cfg
    key = context.partition_key
    work = prepare(storage.checkout(key, "hidden_states"), extraction_settings(cfg), log=context.log.info)
    storage.publish(key, "hidden_states")
    for plan in work.todo:
        yield dg.DynamicOutput(plan.name, mapping_key=_mapping_key(plan.name))


@dg.op(
    pool="gpu",
    tags=GPU_STEP_TAGS,
    out=dg.Out(dict, io_manager_key=IO),
    description="Run the target over one shard's samples and write the shard atomically.",
)
def extract_hidden_state_shard(
    context: dg.OpExecutionContext,
    shard: str,
    project: dg.ResourceParam[Project],
    storage: dg.ResourceParam[Storage],
) -> dict:
    cfg = project.cfg
    key = context.partition_key
    stats = extract(
        storage.checkout(key, "hidden_states"), extraction_settings(cfg), [shard], log=context.log.info
    )
    storage.publish(key, "hidden_states")
    return {
        "samples": stats.samples,
        "tokens": stats.tokens,
        "forward_s": stats.forward_s,
        "bytes": stats.bytes_written,
        "padded_tokens": stats.padded_tokens,
    }


@dg.op(out=dg.Out(io_manager_key=IO), description="Rebuild index.parquet from the shards on disk.")
def index_hidden_states(
    context: dg.OpExecutionContext, results: list[dict], storage: dg.ResourceParam[Storage]
):
    key = context.partition_key
    layout = storage.checkout(key, "hidden_states")
    index = finish(layout)
    storage.publish(key, "hidden_states")
    summary = describe_layout(layout.hidden_states_dir)
    tokens = sum(r["tokens"] for r in results)
    forward_s = sum(r["forward_s"] for r in results)
    return dg.Output(
        None,
        data_version=dg.DataVersion(rows_version(index.lazy(), ["id", "shard", "input_hash"])),
        metadata={
            "dagster/row_count": index.height,
            "samples": summary["samples"],
            "tokens": summary["tokens"],
            "shards": summary["shards"],
            "bytes": summary["bytes"],
            "bytes_per_token": summary["bytes"] / summary["tokens"] if summary["tokens"] else 0.0,
            "extracted_this_run_tokens": tokens,
            "extracted_this_run_shards": len(results),
            "forward_tokens_per_s": tokens / forward_s if forward_s else 0.0,
            "padded_tokens": sum(r["padded_tokens"] for r in results),
            "path": dg.MetadataValue.path(str(layout.hidden_states_dir)),
        },
    )


def build_hidden_states_asset(
    partitions: dg.PartitionsDefinition, automation_condition: dg.AutomationCondition | None = None
) -> dg.AssetsDefinition:
    @dg.graph_asset(
        name="hidden_states",
        ins={"tokens": dg.AssetIn("tokens", dagster_type=dg.Nothing)},
        partitions_def=partitions,
        automation_condition=automation_condition,
        group_name=GROUP,
        kinds={"pytorch", "safetensors"},
        description="Auxiliary hidden states of the target (3 aux layers + the last layer before the final norm) "
        "over every token sequence, in packed safetensors shards with index.parquet; one GPU step per shard.",
    )
    def hidden_states(tokens):
        shards = plan_hidden_state_shards(tokens)
        return index_hidden_states(shards.map(extract_hidden_state_shard).collect())

    return hidden_states
