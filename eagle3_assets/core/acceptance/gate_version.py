"""The gate's inputs version: a rerun of a partition whose inputs did not change re-reports the stored report
instead of training and measuring again (minutes on a GPU, most of a no-op `make demo`).

What the gate reads, each a part of the version (`core.storage.data_version`):

- `hidden_states`: the index and the safetensors files of hidden_states/ (the index by content, shards by
  size, header and stored identity; not the extraction plan, which every extraction run rewrites with a new
  timestamp);
- `prompts`, `responses`, `target_identity`: what the boundary check renders and the source-answers arm
  trains on (prompts.parquet, the stored answers a turn row rebuilds its prompt from, target.json);
- `settings`: the acceptance section, and the target and hidden_states sections (the engine that serves the
  target, and how the source-answers arm extracts its states);
- `template`: the chat tokenizer's fingerprint (template, options, vocabulary): the boundaries are rendered
  with it;
- `code`: `GATE_CODE_VERSION`, a hash of the sources that compute the report (below).

Code version: a hash of the sources, not a constant to bump. A constant that someone forgets to bump keeps a
stale verdict with nothing to show for it; a hash reruns the gate after an edit that changed nothing the
gate computes (a comment), which costs one gate run and is wrong in the safe direction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...config import ProjectConfig
from ..storage.data_version import (
    InputsVersion,
    RecordedVersion,
    files_version,
    forget_inputs_version,
    record_inputs_version,
    recorded_inputs_version,
    settings_version,
    unchanged_since,
)
from ..storage.layout import DatasetLayout
from .gate_report import GateReport, read_report

_CORE = Path(__file__).resolve().parents[1]
# What computes the report: this package (split, training, decoding, measurement, verdict), the draft's shape
# and vocabulary, the states reader, how a row's prompts and answers are rendered into ids (the turns, the
# chat tokenizer and its tool calls: the template's fingerprint covers the template, not the code that
# applies it), and the vLLM engine's measurer.
GATE_SOURCES = (
    _CORE / "acceptance",
    _CORE / "hidden_states" / "draft_format.py",
    _CORE / "hidden_states" / "reader.py",
    _CORE / "hidden_states" / "layer_ids.py",
    _CORE / "tokens" / "turns.py",
    _CORE / "target_model",
    _CORE.parents[1] / "resources" / "vllm" / "acceptance.py",
)


def _sources_version(paths: tuple[Path, ...]) -> str:
    files = [f for p in paths for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]
    return files_version(files, _CORE.parents[1])


GATE_CODE_VERSION = _sources_version(GATE_SOURCES)


def states_files(layout: DatasetLayout) -> list[Path]:
    """What the gate reads of hidden_states/: the index and the safetensors files (shards, the final norm),
    not the extraction plan, which every extraction run rewrites with its own timestamp."""
    folder = layout.hidden_states_dir
    return [layout.hidden_states_index, *sorted(folder.glob("*.safetensors"))]


def gate_inputs_version(
    layout: DatasetLayout, cfg: ProjectConfig, template_fingerprint: str, code: str = GATE_CODE_VERSION
) -> InputsVersion:
    """The version of everything the gate reads for this partition (see the module's docstring)."""
    base = layout.dir
    return InputsVersion.of(
        {
            "hidden_states": files_version(states_files(layout), base),
            "prompts": files_version([layout.prompts], base),
            "responses": files_version([layout.responses_dir], base),
            "target_identity": files_version([layout.target_identity], base),
            "settings": settings_version(
                {
                    "acceptance": cfg.acceptance.model_dump(mode="json"),
                    "target": cfg.target.model_dump(mode="json"),
                    "hidden_states": cfg.hidden_states.model_dump(mode="json"),
                }
            ),
            "template": template_fingerprint,
            "code": code,
        }
    )


@dataclass(frozen=True)
class StoredGate:
    """A stored report computed from exactly the inputs a rerun would read."""

    report: GateReport
    recorded: RecordedVersion


def stored_gate(layout: DatasetLayout, inputs: InputsVersion) -> StoredGate | None:
    """The stored report and its record, if both are there, the record names `inputs` and the draft is beside
    them; None: run the gate."""
    recorded = unchanged_since(layout.acceptance_dir, inputs)
    if recorded is None:
        return None
    draft = layout.draft_dir
    if not ((draft / "config.json").is_file() and (draft / "model.safetensors").is_file()):
        return None
    try:
        report = read_report(layout)
    except ValueError:  # a report that no longer reads (an older contract): run again
        return None
    return None if report is None else StoredGate(report, recorded)


@dataclass(frozen=True)
class GateOutcome:
    """The report a run of the asset reports: computed now, or stored and computed from the same inputs."""

    report: GateReport
    recorded: RecordedVersion
    reused: bool
    changed: list[str] = field(default_factory=list)  # the inputs that changed since the last record
    had_record: bool = True  # False: no earlier record (a first run, or the last one died halfway)


def versioned_gate(
    layout: DatasetLayout, inputs: InputsVersion, run: Callable[[], GateReport]
) -> GateOutcome:
    """The stored report where it was computed from `inputs`; else `run()` (the gate), then the record. The
    old record goes first: a gate that dies halfway leaves none, so the next run computes again."""
    stored = stored_gate(layout, inputs)
    if stored is not None:
        return GateOutcome(stored.report, stored.recorded, reused=True)
    previous = recorded_inputs_version(layout.acceptance_dir)
    forget_inputs_version(layout.acceptance_dir)
    report = run()
    recorded = record_inputs_version(layout.acceptance_dir, inputs)
    changed = inputs.changed(previous.inputs if previous is not None else None)
    return GateOutcome(report, recorded, reused=False, changed=changed, had_record=previous is not None)
