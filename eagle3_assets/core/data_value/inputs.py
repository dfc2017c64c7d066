"""What a data_value report was computed from, versioned (`storage.data_version`): every training partition's
states, prompts, answers and target record, the suite's file, the draft and suite settings, and the code that
trains and measures drafts. With nothing of it changed a rerun re-reports the stored report (seconds, no
training); any change reruns it, and the log names what changed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ...config import ProjectConfig
from ..storage.data_version import InputsVersion, files_version, settings_version, sources_version
from ..storage.layout import DatasetLayout

CORE = Path(__file__).resolve().parents[1]


def suite_file(cfg: ProjectConfig) -> Path:
    assert cfg.data_value is not None
    s = cfg.data_value.suite
    return cfg.resolve_path(cfg.dataset(s.dataset).source if s.dataset is not None else str(s.source))


def value_inputs(cfg: ProjectConfig, layouts: Mapping[str, DatasetLayout]) -> InputsVersion:
    """The inputs version of a report over `layouts` (the partitions with stored states)."""
    assert cfg.data_value is not None
    parts = {
        f"partition:{k}": files_version(
            [lay.hidden_states_dir, lay.prompts, lay.responses_dir, lay.target_identity], lay.root
        )
        for k, lay in layouts.items()
    }
    source = suite_file(cfg)
    parts["suite"] = files_version([source], source.parent)
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
    parts["code"] = sources_version(CORE / "data_value") + sources_version(CORE / "acceptance")
    return InputsVersion.of(parts)
