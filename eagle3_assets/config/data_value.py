"""What the data buys (`data_value`): a common held-out suite on which a draft per dataset, one on every
dataset and, opt-in, one on all but each are measured, with what each dataset cost. The drafts train and are
measured exactly as the acceptance gate's (`acceptance`: draft tokens, training steps, engine), so the two
agree."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Strict
from .datasets import InstructionFields

# The report's draft names beside the dataset keys: a dataset key spelled like one would make two rows one.
ALL_DRAFT = "all"
FLOOR_DRAFT = "untrained"
LEAVE_ONE_OUT_PREFIX = "all-but-"


def reserved_draft_name(key: str) -> bool:
    """Whether dataset key `key` is spelled like a data_value draft that is not a dataset's own."""
    k = key.lower()
    return k in (ALL_DRAFT, FLOOR_DRAFT) or k.startswith(LEAVE_ONE_OUT_PREFIX)


class SuiteConfig(Strict):
    """The held-out suite: a prompt file (the formats and field options of a dataset), or a configured dataset
    held out of every draft."""

    source: str | None = Field(
        None,
        description="A prompt file (JSON Lines, JSON or Parquet; relative to the config file's folder) in "
        "`format`; set this or `dataset`.",
    )
    format: Literal["messages", "sharegpt", "instruction"] = Field(
        "messages",
        description="How the file's rows are written, as a dataset's `format`.",
    )
    fields: InstructionFields = Field(
        default_factory=InstructionFields,
        description="Field names of `format: instruction` rows, as a dataset's `fields`.",
    )
    system_prompt: str | None = Field(
        None,
        description="A system prompt put before every suite prompt that has none, as a dataset's.",
    )
    dataset: str | None = Field(
        None,
        description="A configured dataset key whose prompts are the suite: that dataset is held out of every "
        "draft (no draft of its own, none of `all`); set this or `source`.",
    )
    max_prompts: int = Field(
        4,
        ge=1,
        description="Suite prompts measured (the first ones in source order): every draft decodes "
        "`acceptance.max_new_tokens` tokens from each, so the asset's time grows with drafts x prompts.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SuiteConfig:
        if (self.source is None) == (self.dataset is None):
            raise ValueError("data_value.suite needs exactly one of `source` (a file) or `dataset` (a key)")
        return self


class DataValueConfig(Strict):
    """The `data_value` asset: acceptance per dataset on a common suite, beside what each dataset cost. Drafts
    train and are measured with the `acceptance` section's settings."""

    suite: SuiteConfig = Field(description="The held-out suite every draft is measured on.")
    leave_one_out: bool = Field(
        False,
        description="Also train a draft on all datasets but each one (`all-but-<key>`): what each dataset "
        "adds to the others. One more draft per dataset.",
    )
