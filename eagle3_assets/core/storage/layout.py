"""Where every output of a dataset lives. The one place that spells a path of a partition: no stage, and
no storage adapter, invents one; what each stage reads and writes is derived from these names too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...config import dataset_key_problem
from .data_version import INPUTS_VERSION
from .quarantine import QUARANTINE_DIR, QUARANTINE_STAGES, RECORDS

# Inside the hidden_states folder (the shard format's own files; shards are `shard-*.safetensors`).
HIDDEN_STATES_INDEX = "index.parquet"
FINAL_NORM = "final_norm.safetensors"
EXTRACTION_PLAN = "plan.json"
# At the storage root, beside the partitions: the unpartitioned data_value asset's folder and report.
DATA_VALUE_DIR = "data_value"
DATA_VALUE_REPORT = f"{DATA_VALUE_DIR}/report.json"


def check_key(key: str) -> str:
    """`key` if it names a partition folder inside a storage root (one plain path segment: no `.`, `..`,
    separator or hidden name), else ValueError naming the key and the rule."""
    problem = dataset_key_problem(key)
    if problem is not None:
        raise ValueError(f"dataset key {key!r} {problem}: refused as a folder under the storage root")
    return key


@dataclass(frozen=True)
class DatasetLayout:
    root: Path
    key: str

    def __post_init__(self) -> None:
        # The config refuses such keys at load; this refuses them wherever a layout is built (a CLI argument,
        # a partition key from a run), so no path of a partition can leave its root.
        check_key(self.key)

    @property
    def dir(self) -> Path:
        return self.root / self.key

    # -- prompts
    @property
    def prompts(self) -> Path:
        return self.dir / "prompts.parquet"

    @property
    def quarantine(self) -> Path:
        """Source rows the prompts stage could not use, each with its reason."""
        return self.dir / "quarantine.parquet"

    def damaged_dir(self, stage: str | None = None) -> Path:
        """Files a stage found damaged and set aside, each with a JSON record of why
        (`core.storage.quarantine`): `quarantine/<stage>/`, or the whole folder."""
        base = self.dir / QUARANTINE_DIR
        return base / stage if stage else base

    def damaged_records(self, stage: str) -> Path:
        """The records of what `stage` set aside (apart from the files: readers fetch only these)."""
        return self.damaged_dir(stage) / RECORDS

    # -- responses: the journal (append-only part files) and what generation keeps beside it
    @property
    def responses_dir(self) -> Path:
        return self.dir / "responses"

    @property
    def failures_dir(self) -> Path:
        return self.dir / "failures"

    @property
    def set_aside_dir(self) -> Path:
        """Answers that no longer answer their prompt as it stands (edited, removed), were served by another
        model, or belong to an earlier target: kept with the reason, charged, never trained."""
        return self.dir / "set_aside"

    @property
    def target_identity(self) -> Path:
        """The target the partition's answers belong to (`core.generation.identity`)."""
        return self.dir / "target.json"

    @property
    def journal_dir(self) -> Path:
        """The dispatch ledger: one line per attempt, written before it is sent."""
        return self.dir / "journal"

    @property
    def lost_dir(self) -> Path:
        """Requests a crash left in flight, charged at their expected cost."""
        return self.journal_dir / "lost"

    @property
    def imports_dir(self) -> Path:
        """Rows `eagle3 import-responses` could not use, with the reason."""
        return self.dir / "imports"

    # -- tokens and the report
    @property
    def tokens(self) -> Path:
        return self.dir / "tokens.parquet"

    @property
    def tokens_errors(self) -> Path:
        """Conversations the tokens stage could not render, each with its reason."""
        return self.dir / "tokens_errors.parquet"

    @property
    def report_json(self) -> Path:
        return self.dir / "report.json"

    @property
    def report_md(self) -> Path:
        return self.dir / "report.md"

    # -- hidden states, their exports and the acceptance gate
    @property
    def hidden_states_dir(self) -> Path:
        return self.dir / "hidden_states"

    @property
    def hidden_states_index(self) -> Path:
        return self.hidden_states_dir / HIDDEN_STATES_INDEX

    @property
    def extraction_plan(self) -> Path:
        return self.hidden_states_dir / EXTRACTION_PLAN

    def export_dir(self, fmt: str) -> Path:
        """Where `make demo` writes a training framework's export (the `eagle3 export` command takes any
        folder)."""
        return self.dir / "exports" / fmt

    @property
    def acceptance_dir(self) -> Path:
        return self.dir / "acceptance"

    @property
    def acceptance_report(self) -> Path:
        return self.acceptance_dir / "report.json"

    @property
    def draft_dir(self) -> Path:
        """The gate's trained draft, in the layout SGLang serves and SpecForge loads."""
        return self.acceptance_dir / "draft"

    def scratch(self, name: str) -> Path:
        """A stage's private working folder inside the partition, outside what any stage reads or writes (so
        never published); the stage creates and removes it."""
        return self.dir / f".{name}"

    def ensure(self) -> DatasetLayout:
        self.dir.mkdir(parents=True, exist_ok=True)
        return self

    # -- what each stage touches, for a storage root that is a working copy of an object store
    def stage_paths(self, stage: str) -> tuple[list[str], list[str]]:
        """(reads, writes) of `stage`, relative to the partition's folder; a trailing "/" marks a folder."""
        rel = self._rel
        journal = [
            rel(self.responses_dir),
            rel(self.failures_dir),
            rel(self.journal_dir),
            rel(self.set_aside_dir),
            rel(self.target_identity),
        ]
        prompts = [rel(self.prompts), rel(self.quarantine)]
        tokens = [rel(self.tokens), rel(self.tokens_errors)]
        hidden = [rel(self.hidden_states_dir)]
        records = [rel(self.damaged_records(s)) for s in QUARANTINE_STAGES]  # what the check and report read

        def aside(stage: str) -> str:
            return rel(self.damaged_dir(stage))

        paths = {
            "prompts": ([], [*prompts, aside("prompts")]),
            "responses": (
                [rel(self.prompts), *journal],
                [*journal, rel(self.imports_dir), aside("responses")],
            ),
            "tokens": (
                [rel(self.prompts), rel(self.responses_dir), rel(self.target_identity), *tokens],
                [*tokens, aside("tokens")],
            ),
            "validation_report": (
                [*prompts, *journal, *tokens, *records],
                [rel(self.report_json), rel(self.report_md)],
            ),
            "hidden_states": (
                [rel(self.tokens), rel(self.target_identity), *hidden],
                [*hidden, aside("hidden_states")],
            ),
            "quarantine": (records, []),
            "exports": (hidden, [rel(self.dir / "exports")]),
            "acceptance": (
                [
                    rel(self.prompts),
                    rel(self.responses_dir),
                    rel(self.target_identity),
                    *hidden,
                    rel(self.acceptance_dir),
                ],
                [rel(self.acceptance_dir)],
            ),
        }
        if stage not in paths:
            raise KeyError(f"unknown stage {stage!r}; one of {', '.join(paths)}")
        return paths[stage]

    def journal_paths(self) -> list[str]:
        """The journal folders, pushed at every flush of a running generation (with the journal's set-aside
        files: a push uploads them before it deletes the damaged originals, so the store never loses one)."""
        return [
            self._rel(self.responses_dir),
            self._rel(self.failures_dir),
            self._rel(self.journal_dir),
            self._rel(self.set_aside_dir),
            self._rel(self.target_identity),
            self._rel(self.damaged_dir("responses")),
        ]

    def _rel(self, path: Path) -> str:
        name = str(path.relative_to(self.dir))
        return name if path.suffix else name + "/"


@dataclass(frozen=True)
class DataValueLayout:
    """`<root>/data_value/`: the data_value asset's files (not a partition's: the folder name is a reserved
    dataset key). `rel` names a file as the root's store does (`RootFiles`), relative to the root."""

    root: Path

    @property
    def dir(self) -> Path:
        return self.root / DATA_VALUE_DIR

    @property
    def report_json(self) -> Path:
        return self.root / DATA_VALUE_REPORT

    @property
    def report_md(self) -> Path:
        return self.dir / "report.md"

    @property
    def suite_answers(self) -> Path:
        return self.dir / "suite_answers.jsonl"

    @property
    def inputs_version(self) -> Path:
        return self.dir / INPUTS_VERSION

    @property
    def suite(self) -> DatasetLayout:
        """The suite stored as a partition is (prompts.parquet, the answer journal, the target's record), in
        this folder: answered by the generation stage's machinery like any partition."""
        return DatasetLayout(self.dir, "suite")

    def suite_prefix(self) -> str:
        """The suite's folder as the object-store working copy of key DATA_VALUE_DIR names it."""
        return f"{self.suite.key}/"

    @property
    def drafts_scratch(self) -> Path:
        """Drafts served while they are measured, removed after (never stored)."""
        return self.dir / ".drafts"

    def stored(self) -> list[Path]:
        """What the asset stores, the inputs record last: a store never names inputs of a report it lacks."""
        return [self.report_json, self.report_md, self.suite_answers, self.inputs_version]

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()
