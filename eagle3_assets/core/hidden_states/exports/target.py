"""What an export's side files need from the target: its config and the names of its head weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TargetFacts:
    """What the side files of an export need from the target: its sizes and the names of its head weights."""

    path: str  # as `from_pretrained` takes it
    config: Any  # the text model's PretrainedConfig
    lm_head_key: str
    embedding_key: str
    weight_index: bool  # a *.safetensors.index.json (SpecForge's target head loads through it)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


def read_target(ref: str, revision: str | None = None, trust_remote_code: bool = False) -> TargetFacts:
    """The target's config and head weight names (from its weight index or safetensors header, where
    local)."""
    from transformers import AutoConfig

    from ...target_model.loading import resolve

    path = resolve(ref)
    cfg = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    names = _weight_names(Path(path))
    tied = bool(getattr(text, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False)))
    embedding = _pick(names, "embed_tokens.weight", "model.embed_tokens.weight")
    head = embedding if tied and not any(n.endswith("lm_head.weight") for n in names) else None
    return TargetFacts(
        path=path,
        config=text,
        lm_head_key=head or _pick(names, "lm_head.weight", "lm_head.weight"),
        embedding_key=embedding,
        weight_index=Path(path).is_dir() and any(Path(path).glob("*.safetensors.index.json")),
    )


def _weight_names(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    for index in folder.glob("*.safetensors.index.json"):
        return list(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            names += list(st.keys())
    return names


def _pick(names: list[str], suffix: str, default: str) -> str:
    """The weight whose name ends with `suffix`, preferring the shortest (the text model's, not a tower's)."""
    hits = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
    return hits[0] if hits else default
