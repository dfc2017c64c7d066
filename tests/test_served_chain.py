"""The chain past generation for a target that never enters the process: the shipped defaults plus
`hidden_states.engine: vllm` (the session's real vLLM server, CPU build) and `acceptance.engine: vllm` (the
step starts vLLM itself with each draft as EAGLE-3). A guard fails the test when hidden_states or acceptance
loads the whole target or runs a forward of it here; only pieces of the checkpoint (the embedding, the first
layers) may be. Run on each tested vLLM version (`cpu_build.TESTED_VLLM_VERSIONS`): the extraction server and
the acceptance step's servers are that version's CPU build. On the newest, data_value follows with the same
engine (its drafts served by vLLM; the suite answered by the shipped embedded backend, outside the guard).
"""

from __future__ import annotations

import json
import shutil

import psutil
import pytest
import yaml

from .support import vllm_server
from .support.hidden_states import L
from .support.projects import REPO
from .support.target_guard import FullTargetGuard

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module", params=vllm_server.VERSIONS, ids=vllm_server.version_ids)
def vllm_version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(vllm_version) -> vllm_server.VllmServer:
    return vllm_server.session_server("float32", vllm_version)


def _served_config(root, server, vllm_version: str) -> dict:
    cfg = yaml.safe_load((REPO / "eagle3.yaml").read_text())
    cfg["hidden_states"] = {
        "engine": "vllm",
        "vllm": {"base_urls": [server.base_url], "storage_path": str(server.storage)},
    }
    acceptance: dict = {"cpu": True}
    if vllm_version != vllm_server.NEWEST:  # that version's CPU build (cpu: true alone is the newest's)
        acceptance["python"] = str(vllm_server.python_of(vllm_version))
    cfg["acceptance"] = {"engine": "vllm", "vllm": acceptance}
    return cfg


def _eagle3_servers() -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "vllm.entrypoints" in cmd and '"method":"eagle3"' in cmd:
            found.append(p.info["pid"])
    return found


# Four vLLM starts and a draft's training on two cores, beside the suite's other servers; on the newest
# version data_value's two more starts and its draft.
@pytest.mark.timeout(3000)
def test_hidden_states_and_acceptance_run_with_the_target_served_only(
    server, vllm_version, tmp_path, monkeypatch
):
    import dagster as dg

    import resources.vllm.managed as step_servers
    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import (
        ACCEPTANCE_JOB,
        DATA_VALUE_JOB,
        HIDDEN_STATES_JOB,
        TRAINING_DATA_JOB,
        build_definitions,
    )

    shutil.copytree(REPO / "prompts", tmp_path / "prompts")
    path = tmp_path / "eagle3.yaml"
    path.write_text(yaml.safe_dump(_served_config(tmp_path, server, vllm_version)))
    assert server.version == vllm_version
    started: list[str | None] = []  # the version each server the acceptance step started reported

    def launch_and_note(*args, **kwargs):
        running = real_launch(*args, **kwargs)
        started.append(running.version)
        return running

    real_launch = step_servers.launch
    monkeypatch.setattr(step_servers, "launch", launch_and_note)
    config = load_config(path)
    defs = build_definitions(config, str(path))
    with dg.instance_for_test() as instance:
        run = defs.resolve_job_def(TRAINING_DATA_JOB).execute_in_process(  # the embedded backend generates
            partition_key="B3", instance=instance, run_config={"ops": {"responses": {"config": {"limit": 8}}}}
        )
        assert run.success
        results = {}
        with pytest.MonkeyPatch.context() as guarded:
            guard = FullTargetGuard(guarded)
            for job in (HIDDEN_STATES_JOB, ACCEPTANCE_JOB):
                results[job] = defs.resolve_job_def(job).execute_in_process(
                    partition_key="B3", instance=instance, raise_on_error=False
                )
                assert results[job].success, [e.message for e in results[job].all_events if e.is_failure]
        gate_servers = len(started)
        if vllm_version == vllm_server.NEWEST:
            # data_value with the same engine: the shipped suite answered by the shipped (embedded) backend,
            # which is why it runs outside the guard; B3's draft and the floor served by vLLM as EAGLE-3.
            value = defs.resolve_job_def(DATA_VALUE_JOB).execute_in_process(
                instance=instance, raise_on_error=False
            )
            assert value.success, [e.message for e in value.all_events if e.is_failure]
            _assert_served_data_value(config, started[gate_servers:], vllm_version)
    assert max(guard.depths, default=0) < L, guard.depths  # no forward of the whole target
    assert guard.depths, "the spot check recomputed nothing"

    checks = {e.check_name: e for r in results.values() for e in r.get_asset_check_evaluations()}
    assert all(c.passed for c in checks.values()), {k: c.metadata for k, c in checks.items() if not c.passed}
    assert {"hidden_states_spot_check", "acceptance_gate"} <= set(checks)

    layout_dir = config.storage_root / "B3" / "acceptance"
    report = json.loads((layout_dir / "report.json").read_text())
    k = report["draft_tokens"]
    assert report["engine"] == "vllm" and report["max_new_tokens"] == config.acceptance.max_new_tokens
    for part in ("train", "heldout", "untrained"):
        p = report[part]
        c = p["counters"]
        assert c["num_drafts"] > 0 and c["num_draft_tokens"] == k * c["num_drafts"]
        assert p["acceptance_length"] == round(1 + c["num_accepted_tokens"] / c["num_drafts"], 4)
        assert len(p["prompt_ids"]) == p["n_prompts"] and len(c["accepted_per_position"]) == k
    assert (
        report["untrained"]["counters"]["num_accepted_tokens"]
        <= report["untrained"]["counters"]["num_drafts"]
    )
    assert report["gate"]["passed"], report["gate"]
    # The source-answers arm: its states extracted by the hidden-states server, its draft served by vLLM.
    assert report["source_answers"]["heldout"]["counters"]["num_drafts"] > 0
    # Speculative decoding changed no greedy answer.
    g = report["greedy_check"]
    assert g["prompts"] >= 1 and g["equal"] == g["prompts"], g
    # The draft: vLLM's layer ids in config.json (the layers it was trained on), SGLang's beside it.
    draft = layout_dir / "draft"
    assert json.loads((draft / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [
        2,
        15,
        27,
    ]
    sglang = json.loads((draft / "config.sglang.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert _eagle3_servers() == []  # every server the step started is gone, engine core and workers included
    assert gate_servers >= 3 and set(started) == {vllm_version}, started  # the drafts served by that version


def _assert_served_data_value(config, started: list[str | None], vllm_version: str) -> None:
    """data_value's report measured by vLLM: the floor, B3's draft and `all` (the same data, measured once),
    each with counters from the engine, every server it started gone."""
    from eagle3_assets.assets.data_value import read_value_report

    report = read_value_report(config)
    assert report is not None and report.engine == "vllm"
    rows = {r.draft: r for r in report.rows}
    assert set(rows) == {"B3", "all", "untrained"}
    assert all(len(r.per_position) == report.draft_tokens for r in rows.values())
    assert all(r.acceptance_length >= 1.0 for r in rows.values())
    assert rows["all"].acceptance_length == rows["B3"].acceptance_length
    assert report.suite.answers is not None and report.suite.answers.answers == report.suite.n_prompts
    assert len(started) >= 2 and set(started) == {vllm_version}, started  # floor and B3's draft, served
    assert _eagle3_servers() == []
