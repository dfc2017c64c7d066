"""An EAGLE-3 draft as the trainers and servers see it outside any code: its shape (one decoder layer of the
target's width), its `config.json` (`LlamaForCausalLMEagle3`, as SGLang serves and SpecForge trains it) and
its vocabulary maps (`d2t`, `t2d`, SpecForge's `vocab_mapping.pt`). The exports write them for a trainer; the
acceptance gate's draft is saved in them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

VOCAB_MAPPING_FILE = "vocab_mapping.pt"  # SpecForge's name: {"d2t": int64 [draft vocab], "t2d": bool [vocab]}


@dataclass(frozen=True)
class DraftShape:
    """The draft's dimensions, taken from the target (one decoder layer of the target's width)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def from_target(cls, config: Any, draft_vocab_size: int) -> DraftShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        rope = getattr(text, "rope_theta", None)
        if rope is None:
            params = getattr(text, "rope_parameters", None) or {}
            rope = params.get("rope_theta", 10000.0)
        return cls(
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", heads) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab_size=text.vocab_size,
            draft_vocab_size=min(draft_vocab_size, text.vocab_size),
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5),
            rope_theta=float(rope),
            max_position_embeddings=getattr(text, "max_position_embeddings", 8192),
        )


def count_tokens(arrays: Iterable[Any]) -> Counter[int]:
    """How often each token id occurs over the arrays (the trained labels of a partition)."""
    counts: Counter[int] = Counter()
    for ids in arrays:
        values, n = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
        counts.update(dict(zip(values.tolist(), n.tolist(), strict=True)))
    return counts


def build_draft_vocab(counts: Counter[int], vocab_size: int, size: int, fill: bool = False) -> Any:
    """The draft vocabulary: the `size` most frequent tokens (ties to the lower id), sorted ascending so that
    d2t offsets are non-negative, as in SpecForge. Fewer if fewer occur (a token never seen as a label is
    never drafted anyway), unless `fill`: then the lowest unseen ids complete it, as SpecForge's own mapping
    does for a draft config whose `draft_vocab_size` is fixed."""
    import torch

    size = min(size, vocab_size)
    chosen = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    if fill and len(chosen) < size:
        taken = set(chosen)
        chosen += [i for i in range(size + len(taken)) if i not in taken][: size - len(chosen)]
    if not chosen:
        chosen = [0]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def vocab_mapping(draft_ids: Any, vocab_size: int) -> tuple[Any, Any]:
    """SpecForge's maps of a draft vocabulary (sorted target ids): `d2t[i]` is the offset from draft id i to
    its target id, `t2d` marks the target ids the draft vocabulary holds."""
    import torch

    ids = draft_ids.to(torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


def draft_config(s: DraftShape, aux_layer_ids: list[int], dtype: str) -> dict[str, Any]:
    """The `config.json` of an EAGLE-3 draft of shape `s` (`LlamaForCausalLMEagle3`, one decoder layer), with
    the aux layer ids as given: the caller picks the engine's reading (vLLM: `output_hidden_states` indices;
    SGLang and SpecForge: decoder-layer outputs, one less)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": s.vocab_size,
        "draft_vocab_size": s.draft_vocab_size,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }
