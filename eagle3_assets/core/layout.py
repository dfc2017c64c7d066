"""Where every output of a dataset lives (design §4). One place, so no stage invents a path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DatasetLayout:
    root: Path
    key: str

    @property
    def dir(self) -> Path:
        return self.root / self.key

    @property
    def prompts(self) -> Path:
        return self.dir / "prompts.parquet"

    @property
    def quarantine(self) -> Path:
        """Source rows the prompts stage could not use, each with its reason."""
        return self.dir / "quarantine.parquet"

    @property
    def responses_dir(self) -> Path:
        return self.dir / "responses"

    @property
    def failures_dir(self) -> Path:
        return self.dir / "failures"

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

    @property
    def hidden_states_dir(self) -> Path:
        return self.dir / "hidden_states"

    @property
    def acceptance_dir(self) -> Path:
        return self.dir / "acceptance"

    def ensure(self) -> DatasetLayout:
        self.dir.mkdir(parents=True, exist_ok=True)
        return self
