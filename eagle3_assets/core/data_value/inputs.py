"""What a data_value report was computed from, versioned (`storage.data_version`): every training partition's
states, prompts, answers and target record, the suite's file, the draft and suite settings, and the code that
trains and measures drafts. With nothing of it changed a rerun re-reports the stored report (seconds, no
training); any change reruns it, and the log names what changed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ...config import ProjectConfig
from ..acceptance.gate_version import GATE_CODE_VERSION, states_files
from ..storage.data_version import InputsVersion, files_version, settings_version, sources_version
from ..storage.layout import DatasetLayout

CORE = Path(__file__).resolve().parents[1]
# What computes the report beyond the gate's own sources: this package, the loop flags, the suite's ingest.
VALUE_CODE_VERSION = GATE_CODE_VERSION + sources_version(CORE / "data_value")
VALUE_SOURCES = (CORE / "tokens" / "answer_quality.py", CORE / "prompts" / "ingest.py")


def suite_file(cfg: ProjectConfig) -> Path:
    assert cfg.data_value is not None
    s = cfg.data_value.suite
    return cfg.resolve_path(cfg.dataset(s.dataset).source if s.dataset is not None else str(s.source))


def value_inputs(
    cfg: ProjectConfig,
    layouts: Mapping[str, DatasetLayout],
    template_fingerprint: str,
    suite_answers: DatasetLayout | None = None,
) -> InputsVersion:
    """The inputs version of a report over `layouts` (the partitions with stored states). States as the gate
    reads them (not the extraction plan, which every extraction run rewrites); the template, which renders the
    suite and the turn prompts; the target's stored answers to the suite (`suite_answers`, the suite's
    journal), which every draft is compared with."""
    assert cfg.data_value is not None
    parts = {
        f"partition:{k}": files_version(
            [*states_files(lay), lay.prompts, lay.responses_dir, lay.target_identity], lay.root
        )
        for k, lay in layouts.items()
    }
    source = suite_file(cfg)
    parts["suite"] = files_version([source], source.parent)
    if suite_answers is not None:
        parts["suite_answers"] = files_version([suite_answers.responses_dir], suite_answers.dir)
    parts["settings"] = settings_version(
        {
            "data_value": cfg.data_value.model_dump(mode="json"),
            "acceptance": cfg.acceptance.model_dump(mode="json"),
            "target": cfg.target.model_dump(mode="json"),
            "suite_dataset": cfg.dataset(cfg.data_value.suite.dataset).model_dump(mode="json")
            if cfg.data_value.suite.dataset
            else None,
        }
    )
    parts["template"] = template_fingerprint
    parts["code"] = VALUE_CODE_VERSION + files_version(list(VALUE_SOURCES), CORE)
    return InputsVersion.of(parts)
