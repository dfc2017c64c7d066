"""The UI, end to end: headless Chromium (Debian's package, not a Playwright download) driven by Playwright
opens the Dagster UI served by a real `dagster dev`, finds the asset graph, materialises partition B1 of
`prompts` by clicking through the launch dialog, and waits until the run page says Success. The outcome is
checked again through GraphQL and on disk. Screenshots are kept under artifacts/ (git-ignored), also when the
test fails."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import pytest
from playwright.sync_api import Locator, Page, expect, sync_playwright

from .support.dagster_dev import DagsterDev, prepare_home, small_project
from .support.projects import REPO

CHROMIUM = Path("/usr/bin/chromium")
# As root Chromium needs --no-sandbox; the background-networking flags stop it from calling Google services,
# whose connections this closed network refuses (and which a test has no use for anyway).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# Waits on the UI: `expect` polls up to this long (its own default is 5 s, short for 2 busy cores).
expect.set_options(timeout=60_000)
ARTIFACTS = REPO / "artifacts"
SHOTS = {
    "graph": ARTIFACTS / "ui-asset-graph.png",
    "dialog": ARTIFACTS / "ui-launch-dialog.png",
    "run": ARTIFACTS / "ui-run-success.png",
    "after": ARTIFACTS / "ui-asset-graph-after.png",
    "failure": ARTIFACTS / "ui-failure.png",
}
FAILURE_TRACE = ARTIFACTS / "ui-failure-trace.zip"  # open with `playwright show-trace`
ASSETS = ["prompts", "responses", "tokens", "validation_report", "hidden_states", "acceptance"]
PARTITION = "B1"
# Queued -> dequeued by the daemon -> run process started -> done: seconds, but generous on 2 busy cores.
RUN_TIMEOUT_MS = 240_000

RUN_QUERY = """
query($id: ID!) {
  runOrError(runId: $id) {
    __typename
    ... on Run { status assetSelection { path } tags { key value } }
    ... on PythonError { message }
  }
}"""
MATERIALIZATIONS_QUERY = """
{ assetOrError(assetKey: {path: ["prompts"]}) {
    __typename
    ... on Asset { assetMaterializations(limit: 20) { partition runId } } } }"""


def graph_node(page: Page, name: str) -> Locator:
    """An asset's node in the lineage graph: the graph is an SVG whose nodes are HTML inside <foreignObject>,
    so this skips the same name in the sidebar's asset list."""
    return page.locator("foreignObject").get_by_text(name, exact=True)


def open_asset_graph(page: Page, url: str) -> None:
    """From the landing page, through the left navigation, to the global asset graph ("Lineage")."""
    page.goto(url)
    # The nav links are named by icon + label ("lineage Lineage"; Jobs' icon is "column_lineage").
    page.get_by_role("navigation").get_by_role("link", name=re.compile(r"Lineage$")).click()
    expect(page).to_have_url(re.compile(r"/asset-groups"))
    expect(page.get_by_text("Global asset lineage")).to_be_visible()
    for name in ASSETS:
        expect(graph_node(page, name)).to_be_visible()


def launch_one_partition(page: Page) -> str:
    """Select `prompts` in the graph, open its launch dialog, pick only partition B1, launch; the run id."""
    graph_node(page, "prompts").click()
    page.get_by_role("button", name="Materialize selected").click()
    dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize prompts")
    expect(dialog).to_be_visible()
    # "Custom" partition selection is preselected with nothing chosen; the picker is a popover with a filter
    # field and one checkbox menu item per partition (plus "Select all (n)").
    dialog.get_by_text("Select a partition or create one").click()
    page.get_by_placeholder("Filter partitions").fill(PARTITION)
    page.get_by_role("menuitem").filter(has=page.get_by_text(PARTITION, exact=True)).click()
    page.keyboard.press("Escape")  # closes the picker popover only
    expect(page.get_by_placeholder("Filter partitions")).to_be_hidden()
    expect(dialog).to_be_visible()
    expect(dialog.get_by_text("1 partition", exact=True)).to_be_visible()
    # One partition: the dialog launches a single run rather than a backfill.
    launch = dialog.get_by_role("button", name="Launch 1 run", exact=True)
    expect(launch).to_be_enabled()
    page.screenshot(path=SHOTS["dialog"])
    launch.click()
    # A toast "Launched run <id8>" with a "View" link to the run's page.
    view = page.get_by_role("listitem").filter(has_text="Launched run").get_by_role("link", name="View")
    expect(view).to_be_visible()
    href = view.get_attribute("href") or ""
    assert re.fullmatch(r"/runs/[0-9a-f-]{36}", href), href
    view.click()
    return href.rsplit("/", 1)[-1]


def wait_for_run(page: Page, dev: DagsterDev, run_id: str) -> None:
    """On the run's page, wait for its status tag to reach a final state and require Success."""
    expect(page).to_have_url(re.compile(run_id))
    expect(page.get_by_text(run_id[:8], exact=True).first).to_be_visible()  # the breadcrumb: Runs / <id8>
    final = page.get_by_text(re.compile(r"^(Success|Failure|Canceled)$")).first
    expect(final).to_be_visible(timeout=RUN_TIMEOUT_MS)
    status = final.inner_text().strip()
    assert status == "Success", f"the UI shows the run as {status}:\n{dev.log_tail()}"
    expect(page.get_by_text(f"partition: {PARTITION}", exact=True)).to_be_visible()


def verify_materialised(dev: DagsterDev, run_id: str, storage_root: Path) -> None:
    """Independently of the UI: the run through GraphQL, the materialisations, and the files on disk."""
    run = dev.graphql(RUN_QUERY, {"id": run_id})["runOrError"]
    assert run["__typename"] == "Run" and run["status"] == "SUCCESS", run
    tags = {t["key"]: t["value"] for t in run["tags"]}
    assert tags.get("dagster/partition") == PARTITION and tags.get("dagster/from_ui") == "true", tags
    assert run["assetSelection"] == [{"path": ["prompts"]}], run["assetSelection"]
    asset = dev.graphql(MATERIALIZATIONS_QUERY)["assetOrError"]
    assert asset["__typename"] == "Asset", asset
    assert [(m["partition"], m["runId"]) for m in asset["assetMaterializations"]] == [(PARTITION, run_id)]
    prompts = storage_root / PARTITION / "prompts.parquet"
    assert prompts.exists(), f"{prompts} missing"
    assert pl.read_parquet(prompts).height == 2  # small_project's B1 has two prompts
    assert not (storage_root / "B2" / "prompts.parquet").exists()  # only the chosen partition ran


def keep_failure(page: Page) -> None:
    """The failure screenshot and a Playwright trace; never masks the test's own error."""
    try:
        page.screenshot(path=SHOTS["failure"])
        page.context.tracing.stop(path=FAILURE_TRACE)
        print(f"UI test failed; screenshot {SHOTS['failure']}, trace {FAILURE_TRACE}")
    except Exception as exc:  # the browser may be the thing that broke
        print(f"UI test failed; no failure screenshot could be taken: {exc!r}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: `make test` installs Debian's chromium package"
)
def test_materialise_one_partition_from_the_ui(tmp_path):
    config = small_project(tmp_path)
    home = tmp_path / "dagster_home"
    prepare_home(home, config, "local")
    ARTIFACTS.mkdir(exist_ok=True)
    # No screenshot from an earlier session may pass for this one's.
    for stale in [*SHOTS.values(), FAILURE_TRACE]:
        stale.unlink(missing_ok=True)

    with DagsterDev(config, home) as dev, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            # Wide enough that the six-asset graph fits at a zoom where nodes show their partition status.
            context = browser.new_context(viewport={"width": 2200, "height": 1000})
            # The UI greets a new browser with a "Join the Dagster community" modal over everything; this
            # localStorage key is what its "Skip" button sets. The handler is the fallback should it show
            # anyway.
            context.add_init_script("window.localStorage.setItem('communityNux', '\"1\"')")
            context.set_default_timeout(60_000)
            context.set_default_navigation_timeout(120_000)
            context.tracing.start(screenshots=True, snapshots=True)
            page = context.new_page()
            page.add_locator_handler(
                page.get_by_text("Join the Dagster community"),
                lambda: page.get_by_role("button", name="Skip").click(),
            )
            try:
                open_asset_graph(page, dev.url)
                page.screenshot(path=SHOTS["graph"])

                run_id = launch_one_partition(page)
                wait_for_run(page, dev, run_id)
                page.screenshot(path=SHOTS["run"])

                verify_materialised(dev, run_id, tmp_path / "data")

                # Back on the graph, the node of `prompts` now counts one of its two partitions as filled.
                open_asset_graph(page, dev.url)
                node = page.locator("foreignObject").filter(has=page.get_by_text("prompts", exact=True))
                expect(node.get_by_text("50% filled")).to_be_visible()
                page.screenshot(path=SHOTS["after"])
            except BaseException:
                keep_failure(page)
                print(f"dagster dev log tail:\n{dev.log_tail()}")
                raise
            context.tracing.stop()
        finally:
            browser.close()

    for name in ("graph", "dialog", "run", "after"):
        assert SHOTS[name].stat().st_size > 0
        print(f"artifact: {SHOTS[name]}")
