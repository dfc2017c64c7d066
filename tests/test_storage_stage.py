"""A stage's storage: what it reads and writes is checked out before it runs and published after it
succeeded; after an error nothing is published (a half-written stage never replaces the stored outputs),
except for the append-only journal, whose whole part files hold answers that were paid for. Every path
comes from the layout."""

from __future__ import annotations

import pytest

from eagle3_assets.config import load_config
from eagle3_assets.core.storage.layout import DatasetLayout
from resources import Storage

from .support.projects import make_project, user_rows


class Recorder:
    """A remote root that records what is pulled and pushed (the real one is tested against moto's S3)."""

    def __init__(self):
        self.pulled: list[tuple[str, list[str]]] = []
        self.pushed: list[tuple[str, list[str]]] = []

    def pull(self, key, paths):
        self.pulled.append((key, list(paths)))

    def push(self, key, paths):
        self.pushed.append((key, list(paths)))


@pytest.fixture
def storage(tmp_path):
    cfg = load_config(make_project(tmp_path, {"B1": {"rows": user_rows(["q"])}}))
    s = Storage(cfg)
    s.remote = Recorder()
    return s


def test_a_stage_publishes_what_it_wrote_once_it_succeeded(storage):
    with storage.stage("B1", "tokens") as layout:
        reads = {"prompts.parquet", "responses/", "target.json", *TOKENS, ASIDE}
        assert storage.remote.pulled == [("B1", sorted(reads))]
        assert storage.remote.pushed == []
        assert layout.tokens.name == "tokens.parquet"
    assert storage.remote.pushed == [("B1", [*TOKENS, ASIDE])]


TOKENS = ["tokens.parquet", "tokens_errors.parquet"]
ASIDE = "quarantine/tokens/"  # damaged files the stage sets aside


def test_a_failed_stage_publishes_nothing(storage):
    with pytest.raises(RuntimeError), storage.stage("B1", "tokens"):
        raise RuntimeError("halfway")
    assert storage.remote.pushed == []


def test_the_append_only_journal_is_published_after_a_failure_too(storage):
    with pytest.raises(RuntimeError), storage.stage("B1", "responses", append_only=True):
        raise RuntimeError("the provider went away")
    assert storage.remote.pushed == [
        (
            "B1",
            [
                "responses/",
                "failures/",
                "journal/",
                "set_aside/",
                "target.json",
                "imports/",
                "quarantine/responses/",
            ],
        )
    ]


def test_every_stage_path_is_one_of_the_layout(tmp_path):
    layout = DatasetLayout(tmp_path, "B1")
    named = {
        p.relative_to(layout.dir).as_posix() + ("" if p.suffix else "/")
        for p in (
            layout.prompts, layout.quarantine, layout.responses_dir, layout.failures_dir, layout.journal_dir,
            layout.imports_dir, layout.tokens, layout.tokens_errors, layout.report_json, layout.report_md,
            layout.hidden_states_dir, layout.acceptance_dir, layout.export_dir("x").parent,
            layout.set_aside_dir, layout.target_identity,
            *(layout.damaged_dir(s) for s in ("prompts", "responses", "tokens", "hidden_states")),
            *(layout.damaged_records(s) for s in ("prompts", "responses", "tokens", "hidden_states")),
        )
    }  # fmt: skip
    for stage in (
        "prompts",
        "responses",
        "tokens",
        "validation_report",
        "hidden_states",
        "exports",
        "acceptance",
    ):
        reads, writes = layout.stage_paths(stage)
        assert set(reads) | set(writes) <= named, stage
    with pytest.raises(KeyError, match="unknown stage"):
        layout.stage_paths("nope")
