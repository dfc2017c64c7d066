"""Which target a partition's answers belong to (`<partition>/target.json`), so that two targets never mix.

Two configs on one storage root, or a config whose target changed, would otherwise adopt each other's answers
and retrain on them. The responses stage records the target that produced the partition's answers: the model
and revision of `target`, the tokenizer, and the name each backend serves it as. A run whose target differs
refuses before any request, naming both; on request (`fresh_answers`) it starts a fresh answer set instead,
the earlier answers set aside (kept, never trained). A new tokenizer or template with the same model is the
same target: its answers stand and the tokens stage rebuilds every row with the new tokenizer (its fingerprint
is in tokens.parquet's footer), never a mix.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ...config import ProjectConfig
from ..storage.files import write_json
from .binding import local_model_name


@dataclass(frozen=True)
class TargetIdentity:
    """The target a partition's answers come from."""

    model: str
    revision: str | None
    tokenizer: str
    # Backend name -> the model name it was asked for (OpenRouter's `model`, the embedded model's name).
    served: dict[str, str] = field(default_factory=dict)
    answer_set: str = ""  # a new one at each fresh answer set
    since: float = 0.0

    @classmethod
    def from_config(cls, cfg: ProjectConfig) -> TargetIdentity:
        t = cfg.target
        served = {"local": local_model_name(t.model), "openrouter": cfg.backends.openrouter.model}
        return cls(t.model, t.revision, t.tokenizer, served)

    def name(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.model}{rev}"

    def conflicts(self, current: TargetIdentity, backend: str) -> list[str]:
        """What makes answers recorded under `self` another target's than `current`'s, for a run on
        `backend`; empty when they are the same target."""
        out = []
        if self.model != current.model or self.revision != current.revision:
            out.append(f"target.model {current.name()!r} (the answers are {self.name()!r}'s)")
        was, now = self.served.get(backend), current.served.get(backend)
        if was is not None and now is not None and was != now:
            out.append(f"backends.{backend} asks {now!r} (the answers came from {was!r})")
        return out

    def joined(self, current: TargetIdentity, backend: str) -> TargetIdentity:
        """This identity with `current`'s tokenizer and its name on `backend` added (same target)."""
        served = dict(self.served)
        if backend in current.served:
            served[backend] = current.served[backend]
        return replace(self, tokenizer=current.tokenizer, served=served)

    def fresh(self, backend: str) -> TargetIdentity:
        """A new answer set of this target, first answered on `backend`."""
        served = {backend: self.served[backend]} if backend in self.served else {}
        return replace(self, served=served, answer_set=uuid.uuid4().hex[:12], since=time.time())


def read_identity(path: Path) -> TargetIdentity | None:
    """The recorded identity, or None where none is recorded (a new partition, or answers stored before
    identities were). A damaged record reads as none: the answers' own model names still bind them."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return TargetIdentity(
            model=str(data["model"]),
            revision=data.get("revision"),
            tokenizer=str(data.get("tokenizer", "")),
            served={str(k): str(v) for k, v in (data.get("served") or {}).items()},
            answer_set=str(data.get("answer_set", "")),
            since=float(data.get("since", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_identity(path: Path, identity: TargetIdentity) -> None:
    write_json(asdict(identity), path)


class TargetMismatch(RuntimeError):
    """A stage was asked to work on answers another target produced."""


def refusal(key: str, recorded: TargetIdentity, current: TargetIdentity, conflicts: list[str]) -> str:
    return (
        f"{key}: this partition's answers belong to another target: the config's "
        + "; ".join(conflicts)
        + ". Nothing was sent. To start a fresh answer set for the new target (the earlier answers are set "
        "aside, kept and never trained), materialise responses with run config "
        '{"ops": {"responses": {"config": {"fresh_answers": true}}}}; or point storage.root elsewhere for '
        f"the new target. (Recorded: {recorded.name()}, tokenizer {recorded.tokenizer}.)"
    )


def answers_target_problem(path: Path, current: TargetIdentity, key: str) -> str | None:
    """For a stage past generation: why it must not use the partition's answers under the config's target
    (they are another model's), or None."""
    recorded = read_identity(path)
    if recorded is None:
        return None
    conflicts = recorded.conflicts(current, backend="")
    if not conflicts:
        return None
    return (
        f"{key}: the stored answers belong to {recorded.name()}, not to the config's target "
        f"{current.name()}: they cannot be trained as its answers. Materialise responses with "
        '{"ops": {"responses": {"config": {"fresh_answers": true}}}} to answer the prompts with the new '
        "target (the earlier answers are set aside), or point storage.root elsewhere."
    )
