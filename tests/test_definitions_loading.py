"""The code location is built when Dagster loads it, from the config the process was given: importing
`eagle3_assets.definitions` reads no config, so `EAGLE3_CONFIG=X` (or `eagle3 --config X`) never loads another
file first, and works outside a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from .support.projects import REPO, make_project


def _python(code: str, cwd, config) -> subprocess.CompletedProcess:
    """Run `code` as `make demo` would: its own DAGSTER_HOME holding the shipped local instance config."""
    home = cwd / ".dagster"
    home.mkdir(exist_ok=True)
    shutil.copy(REPO / "deploy" / "local" / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "EAGLE3_CONFIG": str(config), "PYTHONPATH": str(REPO), "DAGSTER_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_importing_the_definitions_reads_no_config(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    done = _python("import eagle3_assets.definitions as d; print('imported')", tmp_path, missing)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr
    done = _python("import eagle3_assets.definitions as d; d.defs()", tmp_path, missing)
    assert done.returncode != 0 and f"config file {missing} not found" in done.stderr


def test_the_location_is_built_from_the_given_config(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    path = make_project(tmp_path, {"Q1": {"rows": list(rows)}, "Q2": {"rows": list(rows)}})
    code = (
        "import eagle3_assets.definitions as d\n"
        "job = d.defs().resolve_job_def(d.TRAINING_DATA_JOB)\n"
        "print(sorted(job.partitions_def.get_partition_keys()))"
    )
    done = _python(code, tmp_path, path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['Q1', 'Q2']"


def test_the_demo_runs_the_main_job_from_the_given_config(tmp_path):
    """`make demo`'s entry point on a two-prompt project (the hidden states and the gate: the shipped-defaults
    test): it loads the definitions lazily and prints its table."""
    path = make_project(tmp_path, {"Q1": {"rows": [{"messages": [{"role": "user", "content": "Say hi."}]}]}})
    code = "import sys, eagle3_assets.demo as d; sys.exit(d.main(['Q1'], hidden_keys=[]))"
    done = _python(code, tmp_path, path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"config {path}" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("Q1 "))
    assert " ok " in row, done.stdout
