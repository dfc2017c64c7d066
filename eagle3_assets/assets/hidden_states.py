"""hidden_states (GPU): a graph-backed asset that fans a dataset's shards out over as many GPU steps as exist;
and its five blocking checks.

plan (one step) -> extract shard (one step per shard: pool "gpu", a GPU requested under k8s_job_executor) ->
index. With the in-process executor (a laptop, a single GPU box) the shards run in turn in one process and the
model is loaded once; under Kubernetes every shard step is its own pod. With `hidden_states.engine: vllm` the
servers hold the GPUs: one step (no GPU of its own) sends every planned shard's samples to them.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl

from resources import Project, Storage
from resources.vllm import extraction_backend
from resources.vllm.managed import extract_with_own_server

from ..config import ProjectConfig
from ..core.generation.stopping import watching
from ..core.hidden_states import checks as rules
from ..core.hidden_states.extraction import (
    ExtractionSettings,
    describe_layout,
    expected_metadata,
    extract,
    finish,
    load_target_model,
    planned_shards,
    prepare,
    skipped_samples,
    why_target_cannot_run_here,
)
from ..core.hidden_states.shards import ExtractionStats
from ..core.hidden_states.spot_pieces import AnswerDecoding, spot_check_pieces
from ..core.storage.layout import DatasetLayout
from ..core.storage.versions import rows_version
from .common import GROUP, MISSING, check_result, operator_stop, refuse_another_targets_answers

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
ALL_SHARDS = "all"  # the one unit of work of a served extraction (shard names start with "shard-")


def _mapping_key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


@dg.op(
    ins={"tokens": dg.In(dg.Nothing)},
    out=dg.DynamicOut(str, io_manager_key=IO),
    description="Plan the shards still to extract (finished shards are never recomputed), state the bytes "
    "they will write and, on a local storage root, refuse a plan larger than the free space.",
)
def plan_hidden_state_shards(
    context: dg.OpExecutionContext, project: dg.ResourceParam[Project], storage: dg.ResourceParam[Storage]
):
    # A remote root stages only what each step writes on the step's own disk: the whole plan is no measure
    # there.
    local = storage.remote is None
    with storage.stage(context.partition_key, "hidden_states") as layout:
        refuse_another_targets_answers(layout, project.cfg, context.partition_key)  # before any GPU step
        settings = ExtractionSettings.from_config(project.cfg)
        work = prepare(layout, settings, log=context.log.info, check_space=local)
    context.log_event(  # in the run and on the asset's page before any GPU step starts
        dg.AssetObservation(
            asset_key="hidden_states",
            partition=context.partition_key,
            metadata=work.planned,
        )
    )
    vllm = project.cfg.hidden_states.vllm
    if project.cfg.hidden_states.engine == "vllm" and vllm.managed:
        for unit in replica_units(len(work.todo), vllm.replicas):
            yield dg.DynamicOutput(unit, mapping_key=unit.replace("-", "_"))
        return
    if project.cfg.hidden_states.engine == "vllm":
        if work.todo:
            yield dg.DynamicOutput(ALL_SHARDS, mapping_key=ALL_SHARDS)
        return
    for plan in work.todo:
        yield dg.DynamicOutput(plan.name, mapping_key=_mapping_key(plan.name))


def replica_units(n_shards: int, replicas: int) -> list[str]:
    """The steps of a managed extraction: `replica-<i>-of-<n>` takes every n-th planned shard from the i-th
    (never more steps than shards: a server started for nothing costs minutes of GPU time)."""
    n = min(n_shards, replicas)
    return [f"replica-{i}-of-{n}" for i in range(n)]


def replica_shards(unit: str, layout: DatasetLayout) -> list[str]:
    """The planned shards of one replica unit, from the plan the plan step wrote beside the shards."""
    match = re.fullmatch(r"replica-(\d+)-of-(\d+)", unit)
    if match is None:
        raise ValueError(f"not a replica unit: {unit!r}")
    i, n = int(match.group(1)), int(match.group(2))
    return sorted(p.name for p in planned_shards(layout))[i::n]


def _extract_unit(context: dg.OpExecutionContext, unit: str, project: Project, storage: Storage) -> dict:
    key = context.partition_key
    served = extraction_backend(project.cfg, key, context.log.info)
    names = None if unit == ALL_SHARDS else [unit]
    with storage.stage(key, "hidden_states") as layout, watching(operator_stop(context)):
        settings = ExtractionSettings.from_config(project.cfg)
        stats = extract(layout, settings, names, log=context.log.info, served=served)
    return _stats(stats)


def _stats(stats: ExtractionStats) -> dict:
    return {
        "samples": stats.samples,
        "tokens": stats.tokens,
        "forward_s": stats.forward_s,
        "bytes": stats.bytes_written,
        "padded_tokens": stats.padded_tokens,
    }


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
    return _extract_unit(context, shard, project, storage)


@dg.op(
    out=dg.Out(dict, io_manager_key=IO),
    description="Send every planned sample to the vLLM servers (they hold the GPUs) and write each shard as "
    "it completes.",
)
def extract_hidden_states_served(
    context: dg.OpExecutionContext,
    shard: str,
    project: dg.ResourceParam[Project],
    storage: dg.ResourceParam[Storage],
) -> dict:
    return _extract_unit(context, shard, project, storage)


@dg.op(
    pool="gpu",
    tags=GPU_STEP_TAGS,
    out=dg.Out(dict, io_manager_key=IO),
    description="Start vLLM on this step's devices, extract this replica's share of the planned shards "
    "through it, and stop it whatever ends the step (`hidden_states.vllm.managed`).",
)
def extract_hidden_states_managed(
    context: dg.OpExecutionContext,
    unit: str,
    project: dg.ResourceParam[Project],
    storage: dg.ResourceParam[Storage],
) -> dict:
    key, cfg = context.partition_key, project.cfg
    with storage.stage(key, "hidden_states") as layout, watching(operator_stop(context)):
        names = replica_shards(unit, layout)
        stats = extract_with_own_server(cfg, layout, names, unit, log=context.log.info)
    return _stats(stats)


@dg.op(out=dg.Out(io_manager_key=IO), description="Rebuild index.parquet from the shards on disk.")
def index_hidden_states(
    context: dg.OpExecutionContext,
    results: list[dict],
    storage: dg.ResourceParam[Storage],
    project: dg.ResourceParam[Project],
):
    with storage.stage(context.partition_key, "hidden_states") as layout:
        index = finish(layout)
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
            "storage_dtype": project.cfg.hidden_states.storage_dtype,
            "extracted_this_run_tokens": tokens,
            "extracted_this_run_shards": len(results),
            "forward_tokens_per_s": tokens / forward_s if forward_s else 0.0,
            "padded_tokens": sum(r["padded_tokens"] for r in results),
            "path": dg.MetadataValue.path(str(layout.hidden_states_dir)),
        },
    )


def build_hidden_states_asset(
    partitions: dg.PartitionsDefinition,
    automation_condition: dg.AutomationCondition | None = None,
    engine: str = "transformers",
    managed: bool = False,
) -> dg.AssetsDefinition:
    extract_op = (
        extract_hidden_states_managed
        if engine == "vllm" and managed
        else extract_hidden_states_served
        if engine == "vllm"
        else extract_hidden_state_shard
    )

    @dg.graph_asset(
        name="hidden_states",
        ins={"tokens": dg.AssetIn("tokens", dagster_type=dg.Nothing)},
        partitions_def=partitions,
        automation_condition=automation_condition,
        group_name=GROUP,
        kinds={"pytorch", "safetensors"},
        description="Auxiliary hidden states of the target (3 aux layers + the last layer before the final "
        "norm) over every token sequence, in packed safetensors shards with index.parquet; one GPU step per "
        "shard.",
    )
    def hidden_states(tokens):
        shards = plan_hidden_state_shards(tokens)
        return index_hidden_states(shards.map(extract_op).collect())

    return hidden_states


def _spot_check_with_pieces(
    folder: Path, ids: list[str], cfg: ProjectConfig, key: str
) -> dg.AssetCheckResult:
    """The spot check from pieces of the checkpoint (embedding, first layers, final norm, head); a checkpoint
    that is not on this machine fails the check, naming the fix: states nobody recomputed never pass."""
    from ..core.target_model.pieces import CheckpointError, CheckpointPieces

    settings = ExtractionSettings.from_config(cfg)
    sampling = cfg.sampling_for(key)
    decoding = AnswerDecoding.of(sampling.temperature, sampling.top_k)
    try:
        pieces = CheckpointPieces.find(settings.model_ref, settings.target.revision)
        verdict = spot_check_pieces(folder, pieces, ids, decoding, cfg.target.trust_remote_code)
    except CheckpointError as e:  # not here, or lacking a tensor the pieces need
        return dg.AssetCheckResult(
            passed=False,
            severity=dg.AssetCheckSeverity.ERROR,
            description=f"not recomputed: {e}",
            metadata={
                "recomputed": False,
                "reason": str(e),
                "fix": "put the target's safetensors checkpoint on the machine that runs this check (only "
                "the embedding, the first decoder layers, the final norm and the head are read), then re-run "
                "it",
                "samples": len(ids),
            },
        )
    return check_result(verdict)


@dataclass(frozen=True)
class CheckedPartition:
    """What a hidden_states check reads: the partition's stored outputs, its token rows (the columns the check
    asks for) and, for the checks that compare with the configuration, the project's config."""

    key: str
    layout: DatasetLayout
    tokens: pl.LazyFrame
    cfg: ProjectConfig | None

    @property
    def folder(self) -> Path:
        return self.layout.hidden_states_dir

    @property
    def config(self) -> ProjectConfig:
        if self.cfg is None:
            raise ValueError("this check reads the project's config: declare it with needs_project")
        return self.cfg


@dataclass(frozen=True)
class HiddenStatesCheck:
    """One blocking check of hidden_states: its name and description, the token columns it reads, and its
    rule."""

    name: str
    description: str
    run: Callable[[CheckedPartition], dg.AssetCheckResult]
    token_columns: tuple[str, ...] = ("id",)
    needs_project: bool = False
    gpu: bool = False

    def evaluate(self, storage: Storage, key: str, cfg: ProjectConfig | None) -> dg.AssetCheckResult:
        layout = storage.checkout(key, "hidden_states")
        if not layout.hidden_states_index.exists() or not layout.tokens.exists():
            return MISSING
        tokens = pl.scan_parquet(layout.tokens).select(list(self.token_columns))
        return self.run(CheckedPartition(key, layout, tokens, cfg))


def _coverage(p: CheckedPartition) -> dg.AssetCheckResult:
    index = pl.read_parquet(p.layout.hidden_states_index)
    return check_result(rules.coverage(p.tokens.collect(), index, skipped_samples(p.layout)))


def _ids_match(p: CheckedPartition) -> dg.AssetCheckResult:
    return check_result(rules.ids_match(p.folder, p.tokens))


def _finite(p: CheckedPartition) -> dg.AssetCheckResult:
    return check_result(rules.finite(p.folder))


def _consistent(p: CheckedPartition) -> dg.AssetCheckResult:
    expected = expected_metadata(ExtractionSettings.from_config(p.config))
    return check_result(rules.consistent(p.folder, expected))


def _spot_check(p: CheckedPartition) -> dg.AssetCheckResult:
    cfg = p.config
    index = pl.read_parquet(p.layout.hidden_states_index)
    ids = rules.spot_sample_ids(index, cfg.checks.hidden_states_spot_samples)
    settings = ExtractionSettings.from_config(cfg)
    # The whole target only where it already runs in process (engine transformers) and fits: past generation
    # nothing needs a served target whole here.
    if cfg.hidden_states.engine == "transformers" and why_target_cannot_run_here(settings) is None:
        return check_result(rules.spot_check(p.folder, load_target_model(settings), ids))
    return _spot_check_with_pieces(p.folder, ids, cfg, p.key)


HIDDEN_STATES_CHECKS = (
    HiddenStatesCheck(
        "hidden_states_coverage",
        "Every token row has a sample (or is recorded as too long), and no sample is left over.",
        _coverage,
    ),
    HiddenStatesCheck(
        "hidden_states_ids_match",
        "The input_ids and loss_mask stored with the states are exactly tokens.parquet's.",
        _ids_match,
        token_columns=("id", "input_ids", "loss_mask"),
    ),
    HiddenStatesCheck("hidden_states_finite", "No NaN or Inf in any stored state.", _finite),
    HiddenStatesCheck(
        "hidden_states_consistent",
        "Every shard names the configured model, revision, tokenizer, layers and dtype, with tensor shapes "
        "that agree with its samples.",
        _consistent,
        needs_project=True,
    ),
    HiddenStatesCheck(
        "hidden_states_spot_check",
        "A few samples recomputed by an independent fp32 forward (output_hidden_states, one sample per "
        "forward, no extraction hooks, packing or server) agree with the stored states: every token ≥ 0.999 "
        "cosine for fp32 compute; for half-precision compute the median token ≥ 0.999 and every token ≥ "
        "0.99. With hidden_states.engine vllm (or a target too big for this machine) from pieces of the "
        "checkpoint only: the shallowest aux layer recomputed from the first decoder layers, and the head's "
        "argmax over the stored last states equal to the greedy answer's next tokens. Fails, saying why, "
        "where the checkpoint is not here.",
        _spot_check,
        needs_project=True,
        gpu=True,
    ),
)


def _asset_check(spec: HiddenStatesCheck, partitions: dg.PartitionsDefinition) -> dg.AssetChecksDefinition:
    """The Dagster check of one spec: blocking, with the project resource only where the rule reads the
    config."""
    options: dict[str, Any] = {
        "name": spec.name,
        "asset": "hidden_states",
        "blocking": True,
        "partitions_def": partitions,
        "description": spec.description,
        **({"pool": "gpu", "op_tags": GPU_STEP_TAGS} if spec.gpu else {}),
    }
    if spec.needs_project:

        @dg.asset_check(**options)
        def configured(
            context: dg.AssetCheckExecutionContext,
            project: dg.ResourceParam[Project],
            storage: dg.ResourceParam[Storage],
        ) -> dg.AssetCheckResult:
            return spec.evaluate(storage, context.partition_key, project.cfg)

        return configured

    @dg.asset_check(**options)
    def stored(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        return spec.evaluate(storage, context.partition_key, None)

    return stored


def build_hidden_states_checks(partitions: dg.PartitionsDefinition) -> list[dg.AssetChecksDefinition]:
    """Blocking: a partition's hidden states flow on to training only when each of these holds."""
    return [_asset_check(spec, partitions) for spec in HIDDEN_STATES_CHECKS]
