"""DuckDB over every partition: the warehouse's views against sums computed apart with polars, through the
real `eagle3 sql` command; a crash's duplicate answer counted once (as `JournalTable.read`); partitions
missing a file left out cleanly; the `overview` asset materialised through Dagster; and the same views on
an object store (moto's S3 server)."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.report.warehouse import ANSWER_COLUMNS, open_warehouse
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.root_files import root_files
from eagle3_assets.core.storage.tables import FAILURE_SCHEMA, RESPONSE_SCHEMA, JournalTable

from .support.object_store import BUCKET, s3_options, s3_storage
from .support.partition_files import (
    answers,
    append_answers,
    append_failures,
    append_set_aside,
    failures,
    upload_tree,
    write_data_value_report,
    write_gate_report,
    write_tokens,
)
from .support.projects import REPO, make_project, user_rows

KEYS = ["B1", "B2", "B3"]


def project(tmp_path: Path, **top) -> Path:
    """A config naming B1..B3 (their sources are never read here: the files below stand for the stages)."""
    rows = user_rows(["Say hi."])
    return make_project(tmp_path, {k: {"rows": list(rows)} for k in KEYS}, **top)


def build_partitions(root: Path) -> None:
    """B1: two models, a crash's duplicate of b1-1 (later part, other figures) and a failure later answered;
    B2: answers, tokens, a permanent failure, no acceptance report; B3: answers only, no cost."""
    append_answers(root, "B1", answers(["b1-0", "b1-1", "b1-2"], model="m-a", cost=0.02, tokens=100))
    append_answers(root, "B1", answers(["b1-3"], model="m-b", cost=0.5, tokens=1000))
    append_answers(root, "B1", answers(["b1-1"], model="m-b", cost=9.0, tokens=9999, text="superseded"))
    append_failures(root, "B1", failures(["b1-3"], kind="timeout"))
    append_answers(root, "B2", answers([f"b2-{i}" for i in range(5)], model="m-a", cost=0.001, tokens=40))
    append_failures(root, "B2", failures(["b2-9"], kind="rate_limit"))
    append_failures(root, "B2", failures(["b2-9"], kind="content_filter", permanent=True))
    append_answers(root, "B3", answers(["b3-0", "b3-1"], model="m-a", cost=None, tokens=7))
    write_tokens(root, "B1", [10, 20, 30, 40], [5, 6, 7, 8], [True, False, True, None])
    write_tokens(root, "B2", [3, 4, 5, 6, 7], [1, 1, 2, 2, 3], [True] * 5)
    write_gate_report(root, "B1", heldout=1.8, untrained=1.05)
    write_gate_report(root, "B3", heldout=1.4, untrained=1.02, passed=False)


def sql_command(config: Path, query: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "--config", str(config), "sql", *flags, query],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def csv_rows(out: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(out)))


def journal_answers(root: Path, key: str) -> pl.DataFrame:
    return JournalTable(DatasetLayout(root, key).responses_dir, RESPONSE_SCHEMA).read(keep="first")


def expected_cost(root: Path) -> dict[tuple[str, str], tuple[int, int, float | None]]:
    """Per (dataset, model): answers, completion tokens, dollars, from the journal's own reader and polars."""
    out = {}
    for key in KEYS:
        df = journal_answers(root, key)
        if df.height == 0:
            continue
        agg = df.group_by("model").agg(
            pl.len().alias("n"),
            pl.col("completion_tokens").sum(),
            pl.col("cost_usd").sum(),
            pl.col("cost_usd").count().alias("priced"),
        )
        for r in agg.iter_rows(named=True):
            out[(key, r["model"])] = (r["n"], r["completion_tokens"], r["cost_usd"] if r["priced"] else None)
    return out


def test_sql_command_gives_the_journal_sums_per_dataset_and_model(tmp_path):
    config = project(tmp_path)
    root = tmp_path / "data"
    build_partitions(root)

    res = sql_command(config, "SELECT * FROM cost", "--csv")
    assert res.returncode == 0, res.stderr
    got = {
        (r["dataset"], r["model"]): (
            int(r["answers"]),
            int(r["completion_tokens"]),
            float(r["cost_usd"]) if r["cost_usd"] else None,
        )
        for r in csv_rows(res.stdout)
    }
    want = expected_cost(root)
    assert set(got) == set(want) == {("B1", "m-a"), ("B1", "m-b"), ("B2", "m-a"), ("B3", "m-a")}
    for k, (n, tokens, usd) in want.items():
        assert got[k][:2] == (n, tokens), k
        assert (got[k][2] is None) == (usd is None), k
        if usd is not None:
            assert got[k][2] == pytest.approx(usd), k
    # The superseded copy (9999 tokens, $9) is nowhere in the figures.
    assert got[("B1", "m-b")] == (1, 1000, pytest.approx(0.5))

    res = sql_command(config, "SELECT * FROM tokens ORDER BY dataset", "--csv")
    assert res.returncode == 0, res.stderr
    tokens = {r["dataset"]: r for r in csv_rows(res.stdout)}
    assert set(tokens) == {"B1", "B2"}  # B3 has no tokens.parquet
    for key in ("B1", "B2"):
        df = pl.read_parquet(DatasetLayout(root, key).tokens)
        assert int(tokens[key]["samples"]) == df.height
        assert int(tokens[key]["trained_tokens"]) == df["loss_mask"].list.sum().sum()
        assert int(tokens[key]["tokens"]) == df["input_ids"].list.len().sum()
        assert float(tokens[key]["reference_match_rate"]) == pytest.approx(
            df["reference_match"].cast(pl.Float64).mean()
        )
    assert float(tokens["B1"]["reference_match_rate"]) == pytest.approx(2 / 3)  # the null is not a miss

    md = sql_command(config, "SELECT dataset, answers FROM summary", "--markdown")
    assert md.returncode == 0, md.stderr
    assert md.stdout.splitlines()[:5] == [
        "| dataset | answers |",
        "| --- | --- |",
        "| B1 | 4 |",
        "| B2 | 5 |",
        "| B3 | 2 |",
    ]
    bad = sql_command(config, "SELECT nope FROM answers")
    assert bad.returncode == 1 and "nope" in bad.stderr


def test_the_prompt_runs_statements_until_the_end_of_input(tmp_path):
    config = project(tmp_path)
    build_partitions(tmp_path / "data")
    res = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.cli", "--config", str(config), "sql", "--csv"],
        cwd=REPO,
        input="SELECT count(*) AS n\nFROM answers;\nSELECT bogus;\n.tables\nSELECT 7 AS seven;\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[:2] == ["n", "11"]
    assert any(line.startswith("error:") and "bogus" in line for line in lines)
    assert "cost" in lines and "acceptance" in lines  # .tables
    assert lines[-2:] == ["seven", "7"]


def test_a_crash_duplicate_is_counted_once_as_the_journal_reads_it(tmp_path):
    root = tmp_path / "data"
    build_partitions(root)
    con = open_warehouse(root_files(root), KEYS)
    for key in KEYS:
        want = journal_answers(root, key).sort("id")
        got = con.execute(
            "SELECT id, completion_tokens, content FROM answers WHERE dataset = ? ORDER BY id", [key]
        ).fetchall()
        assert got == list(want.select("id", "completion_tokens", "content").iter_rows()), key
    # The raw parts do hold the duplicate: without the rule B1 would count 5 answers.
    raw = JournalTable(DatasetLayout(root, "B1").responses_dir, RESPONSE_SCHEMA).scan(["id"]).collect()
    assert raw.height == 5
    assert con.execute("SELECT count(*) FROM answers WHERE dataset = 'B1'").fetchone() == (4,)
    assert con.execute("SELECT content FROM answers WHERE id = 'b1-1'").fetchone() == ("answer b1-1",)

    # Failures keep the last, as the validation report reads them; one answered later is marked so.
    want_f = JournalTable(DatasetLayout(root, "B2").failures_dir, FAILURE_SCHEMA).read(keep="last")
    got_f = con.execute(
        "SELECT id, error_kind, permanent, answered FROM failures ORDER BY dataset, id"
    ).fetchall()
    assert got_f == [("b1-3", "timeout", False, True), ("b2-9", want_f["error_kind"][0], True, False)]
    assert want_f["error_kind"][0] == "content_filter"
    assert con.execute("SELECT dataset, failures FROM summary WHERE failures > 0").fetchall() == [("B2", 1)]


def test_partitions_missing_a_file_are_left_out_and_empty_views_keep_their_columns(tmp_path):
    root = tmp_path / "data"
    build_partitions(root)
    write_data_value_report(
        root,
        [
            {
                "draft": "B1",
                "acceptance_length": 1.6,
                "per_position": [0.4, 0.2],
                "cost_usd": 0.56,
                "flags": [],
            },
            {"draft": "all", "acceptance_length": 1.9, "cost_usd": 0.57, "flags": ["degenerate_loop"]},
            {
                "draft": "untrained",
                "acceptance_length": 1.1,
                "cost_usd": 0.0,
                "gain_over_floor": 0.0,
                "flags": [],
            },
        ],
    )
    con = open_warehouse(root_files(root), KEYS)
    gate = con.execute(
        "SELECT dataset, acceptance_length, untrained_acceptance_length, passed FROM acceptance "
        "WHERE source = 'gate' ORDER BY dataset"
    ).fetchall()
    assert gate == [("B1", 1.8, 1.05, True), ("B3", 1.4, 1.02, False)]  # B2: no report, no row
    gains = con.execute(
        "SELECT round(gain_over_floor, 9) FROM acceptance WHERE source = 'gate' ORDER BY dataset"
    )
    assert gains.fetchall() == [(0.75,), (0.38,)]
    assert con.execute("SELECT count(*) FROM answers WHERE dataset = 'B2'").fetchone() == (5,)
    suite = con.execute(
        "SELECT dataset, draft, acceptance_length, round(gain_over_floor, 9), n_prompts, draft_tokens, flags "
        "FROM acceptance WHERE source = 'data_value' ORDER BY draft"
    ).fetchall()
    assert suite == [
        ("B1", "B1", 1.6, 0.5, 5, 3, None),
        (None, "all", 1.9, 0.8, 5, 3, ["degenerate_loop"]),
        (None, "untrained", 1.1, 0.0, 5, 3, None),
    ]

    # A part cut short (a crash mid-copy on another machine) is skipped, as JournalTable.files skips it.
    part = next((root / "B3" / "responses").glob("*.parquet"))
    (root / "B3" / "responses" / "part-99999999999999999999-cut.parquet").write_bytes(part.read_bytes()[:-10])
    con = open_warehouse(root_files(root), KEYS)
    assert con.execute("SELECT count(*) FROM answers WHERE dataset = 'B3'").fetchone() == (2,)

    # No partition has any file: every view answers, with no row and its columns.
    empty = open_warehouse(root_files(tmp_path / "nothing"), KEYS)
    for view in ("answers", "failures", "cost", "token_rows", "tokens", "acceptance"):
        assert empty.execute(f"SELECT count(*) FROM {view}").fetchone() == (0,), view
    described = [r[0] for r in empty.execute("DESCRIBE answers").fetchall()]
    assert described == ["dataset", *(n for n, _ in ANSWER_COLUMNS)]
    assert empty.execute("SELECT dataset, answers, cost_usd FROM summary").fetchall() == [
        ("B1", 0, None),
        ("B2", 0, None),
        ("B3", 0, None),
    ]


def test_overview_materialises_with_table_metadata_and_the_markdown_report(tmp_path):
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import build_definitions

    config = project(tmp_path)
    root = tmp_path / "data"
    build_partitions(root)
    defs = build_definitions(load_config(config), str(config))
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        # Only the overview: no validation_report partition was materialised, yet it runs on what exists.
        result = job.execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("overview")], raise_on_error=False
        )
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    md = next(iter(result.asset_materializations_for_node("overview"))).metadata
    summary = md["summary_table"]
    assert isinstance(summary, dg.TableMetadataValue)
    rows = {r.data["dataset"]: r.data for r in summary.records}
    assert rows["B1"]["answers"] == 4 and rows["B2"]["answers"] == 5
    assert rows["B1"]["heldout_acceptance_length"] == pytest.approx(1.8)
    assert rows["B2"]["heldout_acceptance_length"] is None  # no report
    assert {c.name: c.type for c in summary.schema.columns}["cost_usd"] == "float"
    cost_rows = md["cost_table"].records
    assert sum(r.data["completion_tokens"] for r in cost_rows) == sum(
        v[1] for v in expected_cost(root).values()
    )
    text = (root / "overview.md").read_text()
    assert text == md["overview"].value
    assert "Held-out acceptance length per dataset" in text and "█" in text
    assert "| B2 | 5 |" in text
    assert "Dollars spent per dataset" in text  # B1 and B2 paid


def test_bar_chart_starts_at_its_floor_and_shows_a_missing_value_as_missing():
    from eagle3_assets.core.report.markdown_table import bar_chart

    lines = bar_chart("t", [("B1", 1.8), ("B2", None), ("B3", 1.4), ("B4", 1.0)], width=20, floor=1.0)
    bars = {line.split()[0]: line.count("█") for line in lines.splitlines()[2:-1]}
    assert bars == {"B1": 20, "B2": 0, "B3": 10, "B4": 0}
    assert "B2  (none)" in lines


def rounded(rows: list[tuple]) -> list[tuple]:
    return [tuple(round(v, 9) if isinstance(v, float) else v for v in r) for r in rows]


@pytest.mark.slow
def test_the_same_views_over_an_object_store_root(tmp_path, s3_server, aws_env):
    from eagle3_assets.core.storage.remote_writes import make_store

    local = tmp_path / "local"
    build_partitions(local)
    store = make_store(f"s3://{BUCKET}/wh", s3_options(s3_server))
    upload_tree(local, store)
    queries = [
        "SELECT * FROM cost",
        "SELECT * FROM tokens",
        "SELECT dataset, id, content FROM answers ORDER BY dataset, id",
        "SELECT dataset, id, error_kind, answered FROM failures ORDER BY dataset, id",
        "SELECT dataset, source, acceptance_length FROM acceptance ORDER BY dataset",
        "SELECT * FROM summary",
    ]
    on_disk = open_warehouse(root_files(local), KEYS)
    remote = open_warehouse(root_files(f"s3://{BUCKET}/wh", s3_options(s3_server), remote=True), KEYS)
    for q in queries:  # floats rounded: DuckDB sums in parallel, in no fixed order
        assert rounded(remote.execute(q).fetchall()) == rounded(on_disk.execute(q).fetchall()), q
    assert remote.execute("SELECT count(*) FROM answers").fetchone() == (11,)

    # The command, with the config's own object-store root (the local working copies are never used).
    config = project(tmp_path, storage=s3_storage(s3_server, "wh", tmp_path / "cache"))
    res = sql_command(
        config, "SELECT dataset, sum(answers) AS n FROM cost GROUP BY dataset ORDER BY dataset", "--csv"
    )
    assert res.returncode == 0, res.stderr
    assert csv_rows(res.stdout) == [
        {"dataset": "B1", "n": "4"},
        {"dataset": "B2", "n": "5"},
        {"dataset": "B3", "n": "2"},
    ]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.parquet"))

    # The overview report lands beside the partitions, in the store.
    files = root_files(f"s3://{BUCKET}/wh", s3_options(s3_server), remote=True)
    assert files.read_text("overview.md") is None
    assert files.write_text("overview.md", "# x\n") == f"s3://{BUCKET}/wh/overview.md"
    assert files.read_text("overview.md") == "# x\n"


def test_loading_the_definitions_does_not_import_duckdb(tmp_path):
    """The code server loads the definitions at every start: DuckDB is imported when the overview runs."""
    config = project(tmp_path)
    code = (
        "import sys; from eagle3_assets.config import load_config; "
        "from eagle3_assets.definitions import build_definitions; "
        f"build_definitions(load_config({str(config)!r}), {str(config)!r}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'duckdb'))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_the_object_filesystem_reads_any_range_of_an_object_larger_than_its_tail(tmp_path):
    """Ranges before, across and inside the cached tail read the object's own bytes; DuckDB reads a Parquet
    file through it as polars reads it from disk; a file cut short is not Parquet."""
    import random

    import duckdb
    from obstore.store import LocalStore

    from eagle3_assets.core.storage.object_fs import TAIL_BYTES, ObjectStoreFileSystem

    rng = random.Random(7)
    data = bytes(rng.randrange(256) for _ in range(3 * TAIL_BYTES + 123))
    (tmp_path / "blob.bin").write_bytes(data)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(2000)) for _ in range(200)]
    df = pl.DataFrame({"id": [f"r{i}" for i in range(200)], "content": texts})
    df.write_parquet(tmp_path / "big.parquet", compression="uncompressed")
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "big.parquet").read_bytes()[:-3])
    assert (tmp_path / "big.parquet").stat().st_size > 2 * TAIL_BYTES

    fs = ObjectStoreFileSystem(LocalStore(str(tmp_path)))
    with fs.open("eagle3root://blob.bin") as fh:
        assert fh.read() == data
    n = len(data)
    for start, end in [(0, 10), (n - TAIL_BYTES - 5, n - TAIL_BYTES + 5), (n - 100, n), (5, n - 5)]:
        with fs.open("eagle3root://blob.bin", block_size=4096) as fh:
            fh.seek(start)
            assert fh.read(end - start) == data[start:end], (start, end)
    assert fs.is_parquet("big.parquet") and not fs.is_parquet("cut.parquet") and not fs.is_parquet("blob.bin")

    con = duckdb.connect()
    con.register_filesystem(fs)
    got = con.execute(
        "SELECT id, content FROM read_parquet('eagle3root://big.parquet') ORDER BY id"
    ).fetchall()
    assert got == list(df.sort("id").iter_rows())


def test_the_overview_reads_again_when_a_part_was_folded_away_after_the_listing(tmp_path):
    import duckdb

    from eagle3_assets.core.report.overview import build_overview, build_overview_fresh

    def opener(root: Path, opened: list):
        build_partitions(root)

        def open_then_compact():
            con = open_warehouse(root_files(root), KEYS)
            if not opened:  # B1's journal folded into one file right after the first listing
                JournalTable(DatasetLayout(root, "B1").responses_dir, RESPONSE_SCHEMA).compact()
            opened.append(con)
            return con

        return open_then_compact

    with pytest.raises(duckdb.IOException):  # the stale listing alone fails
        build_overview(opener(tmp_path / "a", [])())
    opened: list = []
    overview = build_overview_fresh(opener(tmp_path / "b", opened))
    assert len(opened) == 2
    assert overview.tables["summary"].column("answers") == [4, 5, 2]


def test_spent_dollars_add_the_answers_set_aside_once_as_the_validation_report_does(tmp_path):
    from eagle3_assets.core.report.summary import StoredTables

    root = tmp_path / "data"
    build_partitions(root)
    append_set_aside(root, "B1", answers(["old-0", "old-1"], cost=0.25, tokens=50))
    append_set_aside(root, "B1", answers(["old-1"], cost=0.25, tokens=50))  # a crash's second copy
    append_set_aside(root, "B3", answers(["old-9"], cost=None, tokens=5))
    con = open_warehouse(root_files(root), KEYS)
    got = dict(con.execute("SELECT dataset, spent_usd FROM summary").fetchall())
    for key in KEYS:
        tables = StoredTables.read(DatasetLayout(root, key))
        costs = pl.concat([tables.responses["cost_usd"], tables.aside["cost_usd"]]).drop_nulls()
        want = float(costs.sum()) if costs.len() else None
        assert (got[key] is None) == (want is None), key
        if want is not None:
            assert got[key] == pytest.approx(want), key
    assert got["B1"] == pytest.approx(0.02 + 0.021 + 0.022 + 0.5 + 0.25 + 0.251)
    assert got["B3"] is None  # nothing priced, neither kept nor set aside
    assert con.execute("SELECT dataset, set_aside FROM summary WHERE set_aside > 0").fetchall() == [
        ("B1", 2),
        ("B3", 1),
    ]
    reasons = con.execute("SELECT DISTINCT aside_reason FROM set_aside").fetchall()
    assert reasons == [("prompt_edited",)]
