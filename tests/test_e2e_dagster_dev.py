"""The real thing: `dagster dev` (webserver + daemon) on a loopback port, a partition backfill launched
through the GraphQL API and executed by the daemon; once on the default SQLite instance, once on a real
PostgreSQL server."""

from __future__ import annotations

import json
import socket

import pytest

from .support.dagster_dev import DagsterDev, PostgresServer, postgres_bin, prepare_home, small_project

STAGES = ["prompts", "responses", "tokens", "validation_report"]
CHECKS = """
{ assetNodes(assetKeys: [{path: ["tokens"]}, {path: ["responses"]}]) {
    assetKey { path }
    assetChecksOrError { ... on AssetChecks { checks { name blocking
      executionForLatestMaterialization { status evaluation { success } } } } } } }"""


def backfill_and_verify(dev: DagsterDev, tmp_path) -> None:
    backfill = dev.launch_backfill(STAGES, ["B1", "B2"], title="e2e top-up")
    result = dev.wait_backfill(backfill)
    assert result["status"] in ("COMPLETED", "COMPLETED_SUCCESS"), (result, dev.log_tail())
    assert result["runs"] and all(r["status"] == "SUCCESS" for r in result["runs"])
    # Generation for both datasets is one run (single-run backfill policy): one engine, one window for the
    # key.
    generating = [
        r for r in result["runs"] if ["responses"] in [a["path"] for a in r["assetSelection"] or []]
    ]
    assert len(generating) == 1, [(r["assetSelection"], r["tags"]) for r in result["runs"]]
    tags = {t["key"]: t["value"] for t in generating[0]["tags"]}
    assert (tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]) == (
        "B1",
        "B2",
    )
    for key, n in (("B1", 2), ("B2", 1)):
        report = json.loads((tmp_path / "data" / key / "report.json").read_text())
        assert report["n_prompts"] == n and report["n_responses"] == n
        assert report["reference_match_rate"] is not None
    nodes = dev.graphql(CHECKS)["assetNodes"]
    checks = {c["name"]: c for node in nodes for c in node["assetChecksOrError"]["checks"]}
    assert {
        "tokens_lengths_match",
        "tokens_reference_match",
        "tokens_end_of_turn",
        "responses_unique_ids",
    } <= set(checks)
    for name in ("tokens_lengths_match", "tokens_end_of_turn", "responses_unique_ids"):
        execution = checks[name]["executionForLatestMaterialization"]
        assert execution and execution["evaluation"]["success"], (name, execution)


def assert_loopback_only(port: int) -> None:
    """The webserver listens on 127.0.0.1 only: the machine's other address refuses the connection."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))  # no packet is sent; this only picks the outgoing interface
        address = s.getsockname()[0]
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    if not address.startswith("127."):
        with pytest.raises(OSError):
            socket.create_connection((address, port), timeout=5).close()


@pytest.mark.slow
def test_backfill_through_graphql_on_the_default_instance(tmp_path):
    config = small_project(tmp_path)
    home = tmp_path / "dagster_home"
    prepare_home(home, config, "local")
    with DagsterDev(config, home) as dev:
        assert_loopback_only(dev.port)
        backfill_and_verify(dev, tmp_path)
    assert (home / "storage").exists() or list(home.glob("*.db")) or (home / "history").exists()


@pytest.mark.slow
@pytest.mark.skipif(
    postgres_bin() is None, reason="Debian's postgresql is not installed (make test installs it)"
)
def test_backfill_with_postgres_instance_storage(tmp_path):
    config = small_project(tmp_path)
    home = tmp_path / "dagster_home"
    with PostgresServer(tmp_path / "pg") as pg:
        prepare_home(home, config, "postgres", pg.env())
        with DagsterDev(config, home, env=pg.env()) as dev:
            backfill_and_verify(dev, tmp_path)
        runs = int(pg.query("SELECT count(*) FROM runs").strip())
        events = int(pg.query("SELECT count(*) FROM event_logs").strip())
        assert runs >= 2 and events > 50  # the runs and their events live in PostgreSQL, not in SQLite files
    assert not list(home.rglob("*.db"))
