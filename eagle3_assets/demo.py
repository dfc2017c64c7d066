"""`make demo`: the main job over every partition on the embedded model, then a summary table; with a
`data_value` section (the shipped config has one), hidden states for a few partitions and what each buys on
the held-out suite, as a second table.

Runs are recorded in the Dagster instance of DAGSTER_HOME (the Makefile points it at .dagster/), so `make dev`
shows them afterwards with their metadata, checks and lineage.
"""

from __future__ import annotations

import json
import os
import sys
import time

import dagster as dg

from resources import Storage

from .config import config_path, get_config
from .core.hidden_states.exports.export import export
from .core.storage.layout import DatasetLayout
from .definitions import ACCEPTANCE_JOB, DATA_VALUE_JOB, HIDDEN_STATES_JOB, TRAINING_DATA_JOB, defs

QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
# The partitions whose hidden states data_value's drafts train on in the demo: chat, code and math, three
# kinds the suite asks about, at about three CPU minutes of extraction each (the gate runs for B3 only).
VALUE_KEYS = ("B1", "B3", "B4")


def _instance() -> dg.DagsterInstance:
    return dg.DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else dg.DagsterInstance.ephemeral()


def _row(
    key: str,
    layout: DatasetLayout,
    ok: bool,
    seconds: float,
    checks: str,
    hidden: str = "-",
    gate: str = "-",
) -> dict:
    r = json.loads(layout.report_json.read_text()) if layout.report_json.exists() else {}
    rate = r.get("reference_match_rate")
    return {
        "dataset": key,
        "prompts": r.get("n_prompts", "-"),
        "quarantined": r.get("n_quarantined", "-"),
        "responses": r.get("n_responses", "-"),
        "failures": r.get("n_failures", "-"),
        "tokens": r.get("n_tokens_rows", "-"),
        "match": f"{100 * rate:.1f}%" if rate is not None else "n/a",
        "ref": r.get("n_reference", 0),
        "checks": checks,
        "hidden states": hidden,
        "acceptance (k=4: train / heldout / untrained / source answers)": gate,
        "run": "ok" if ok else "FAILED",
        "secs": f"{seconds:.0f}",
    }


def _overall_match(root, keys: list[str]) -> str:
    """Exact match of reconstructed vs produced ids: all answers, finished answers, and explained differences
    excepted (the cut of truncated answers, the model's own splits), then the differences by kind."""
    import polars as pl

    frames = [
        pl.read_parquet(p, columns=["reference_match", "match_explained", "finish_reason", "mismatch"])
        for k in keys
        if (p := DatasetLayout(root, k).tokens).exists()
    ]
    if not frames:
        return "n/a"
    df = pl.concat(frames).filter(pl.col("reference_match").is_not_null())
    if df.height == 0:
        return "n/a (no reference ids)"
    fin = df.filter(pl.col("finish_reason") == "stop")

    def pct(s: pl.Series) -> str:
        if not s.len():
            return "n/a (0 rows)"
        hits = int(s.cast(pl.Int64).sum())
        return f"{100 * hits / s.len():.2f}% ({hits}/{s.len()})"

    kinds = df.filter(~pl.col("reference_match"))["mismatch"].value_counts(sort=True)
    differences = ", ".join(f"{k} {n}" for k, n in kinds.iter_rows()) or "none"
    return (
        f"{pct(df['reference_match'])} exact; finished answers {pct(fin['reference_match'])}; "
        f"explained differences excepted (the cut of truncated answers, the model's own splits) "
        f"{pct(df['match_explained'])}; differences: {differences}"
    )


def _print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols))
    print("  ".join("-" * width[c] for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(width[c]) for c in cols))


def _checks(result) -> tuple[int, int]:
    evaluations = [
        e.event_specific_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
    ]
    return sum(1 for ev in evaluations if ev.passed), len(evaluations)


def _run(job, key: str, instance):
    """One job for one partition, as the demo runs every job: quiet logs, failures reported, not raised."""
    return job.execute_in_process(
        partition_key=key,
        instance=instance,
        raise_on_error=False,
        run_config=QUIET_LOGS,
        tags={"eagle3/source": "make demo"},
    )


def _hidden_states(
    definitions: dg.Definitions, key: str, instance, storage: Storage
) -> tuple[bool, str, float]:
    """hidden_states (CPU for the embedded model) with its blocking checks, then a speculators export (stored
    with the partition's other outputs, an object-store root included)."""
    t0 = time.monotonic()
    result = _run(definitions.resolve_job_def(HIDDEN_STATES_JOB), key, instance)
    passed, total = _checks(result)
    if not result.success:
        return False, f"FAILED ({passed}/{total} checks)", time.monotonic() - t0
    with storage.stage(key, "exports") as layout:
        if not layout.hidden_states_index.exists():
            return False, f"FAILED ({passed}/{total} checks)", time.monotonic() - t0
        n = export(
            layout.hidden_states_dir, layout.export_dir("speculators"), "speculators", log=lambda m: None
        )
    return True, f"{n} samples, {passed}/{total} checks, exported", time.monotonic() - t0


def _acceptance(definitions: dg.Definitions, key: str, instance, root) -> tuple[bool, str]:
    """The acceptance gate: a draft trained on the partition's hidden states, measured against the target."""
    result = _run(definitions.resolve_job_def(ACCEPTANCE_JOB), key, instance)
    passed, total = _checks(result)
    path = DatasetLayout(root, key).acceptance_report
    if not result.success or not path.exists():
        return False, "FAILED"
    r = json.loads(path.read_text())
    src = r["source_answers"].get("heldout", {}).get("acceptance_length")
    parts = [f"{r[p]['acceptance_length']:.2f}" for p in ("train", "heldout", "untrained")]
    parts.append(f"{src:.2f}" if src is not None else "n/a")
    verdict = "gate passed" if r["gate"]["passed"] and passed == total else "GATE FAILED"
    return passed == total, f"{' / '.join(parts)}, {verdict}"


def value_keys(cfg, keys: list[str]) -> list[str]:
    """The partitions data_value trains on in the demo: VALUE_KEYS among `keys` (none without a data_value
    section; never the dataset held out as the suite)."""
    if cfg.data_value is None:
        return []
    held_out = cfg.data_value.suite.dataset
    return [k for k in VALUE_KEYS if k in keys and k != held_out]


def _data_value(definitions: dg.Definitions, instance, cfg) -> tuple[bool, float]:
    """The data_value asset (not partitioned) over the partitions with stored states."""
    t0 = time.monotonic()
    result = definitions.resolve_job_def(DATA_VALUE_JOB).execute_in_process(
        instance=instance, raise_on_error=False, run_config=QUIET_LOGS, tags={"eagle3/source": "make demo"}
    )
    if not result.success:
        for e in result.all_events:
            if e.is_failure and e.message:
                print(f"data_value: {e.message[:2000]}")
    return result.success, time.monotonic() - t0


def _value_rows(cfg) -> list[dict]:
    """data_value's matrix, best acceptance first and the floor last, each flag by its name only (the report
    spells each out)."""
    from .assets.data_value import read_value_report
    from .core.data_value.value_report import FLOOR

    report = read_value_report(cfg)
    if report is None:
        return []
    rows = sorted(report.rows, key=lambda x: (x.draft == FLOOR, -x.acceptance_length))
    return [
        {
            "draft": r.draft,
            "datasets": "+".join(r.datasets) or "-",
            "acceptance length": f"{r.acceptance_length:.3f}",
            "gain over floor": f"{r.gain_over_floor:+.3f}",
            "$": f"{r.cost_usd:.4f}",
            "$/0.1": "-" if r.usd_per_0_1_acceptance is None else f"{r.usd_per_0_1_acceptance:.4f}",
            "completion tokens": r.completion_tokens,
            "GPU s": f"{r.gpu_seconds:.0f}",
            "flags": ", ".join(f.split(":", 1)[0] for f in r.flags) or "-",
        }
        for r in rows
    ]


def main(keys: list[str] | None = None, hidden_keys: list[str] | None = None) -> int:
    cfg = get_config()
    keys = keys or list(cfg.datasets)
    # Hidden states on CPU are slow beside everything else: one partition shows the whole path with the gate
    # (B3, code, by default); with data_value configured, its partitions' states too (without the gate).
    gate_key = "B3" if "B3" in keys else keys[0]
    valued = value_keys(cfg, keys) if hidden_keys is None else []
    if hidden_keys is None:
        hidden_keys = [gate_key, *(k for k in valued if k != gate_key)]
    instance = _instance()
    storage = Storage(cfg)
    definitions = defs()
    job = definitions.resolve_job_def(TRAINING_DATA_JOB)
    print(f"eagle3-assets demo: config {config_path()}, backend {cfg.backend}, {len(keys)} datasets")
    print(
        f"outputs under {cfg.storage_root}; "
        f"Dagster instance {os.environ.get('DAGSTER_HOME', '(ephemeral)')}\n"
    )
    rows, started = [], time.monotonic()
    for key in keys:
        t0 = time.monotonic()
        result = _run(job, key, instance)
        passed, total = _checks(result)
        ok, hidden, gate = result.success, "-", "-"
        if ok and key in hidden_keys:
            ok, hidden, _ = _hidden_states(definitions, key, instance, storage)
            if ok and key == gate_key:
                ok, gate = _acceptance(definitions, key, instance, cfg.storage_root)
        rows.append(
            _row(
                key,
                DatasetLayout(cfg.storage_root, key),
                ok,
                time.monotonic() - t0,
                f"{passed}/{total}",
                hidden,
                gate,
            )
        )
    elapsed = time.monotonic() - started
    print()
    _print_table(rows)
    print(f"\nreference match over all datasets: {_overall_match(cfg.storage_root, keys)}")
    print(f"total time {elapsed / 60:.1f} min")
    print(f"outputs: {cfg.storage_root}/<dataset>/ (prompts.parquet, responses/, tokens.parquet, report.md)")
    for key in hidden_keys:
        print(
            f"hidden states: {cfg.storage_root}/{key}/hidden_states/ (shards + index.parquet); a speculators "
            f"export in {cfg.storage_root}/{key}/exports/speculators/; the acceptance gate's report and "
            f"draft in {cfg.storage_root}/{key}/acceptance/"
        )
    value_ok = True
    if valued and cfg.data_value and all(r["run"] == "ok" for r in rows if r["dataset"] in valued):
        from .core.data_value.store import value_layout

        suite = cfg.data_value.suite
        value_ok, secs = _data_value(definitions, instance, cfg)
        matrix = _value_rows(cfg) if value_ok else []
        print(
            f"\nwhat each dataset buys (data_value: drafts on {', '.join(valued)} measured on the held-out "
            f"suite {suite.source or suite.dataset}; {secs:.0f} s"
            f"{'' if value_ok else ', FAILED'}):"
        )
        if matrix:
            print()
            _print_table(matrix)
            print(
                f"report: {value_layout(cfg).report_md} (each flag spelled out; $ is the bought "
                "answers' cost, 0 on the embedded model)"
            )
    print("inspect runs, lineage and checks with `make dev`, then open http://127.0.0.1:3000")
    return 0 if all(r["run"] == "ok" for r in rows) and value_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or None))
