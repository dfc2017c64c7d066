"""Which layers the stored states are, and how each engine and trainer counts them.

This project counts aux layers as outputs of decoder layers, 0-based (`hidden_states.aux_layers`, three by
default: [1, L//2-1, L-4]). SGLang (and through it SpecForge) and Model-Optimizer read ids in that convention
too; vLLM and speculators read `output_hidden_states` indices, where index j is the output of decoder layer
j - 1 and 0 the embeddings, so their ids are ours + 1. A wrong convention feeds a draft other layers without
any error, so the shift is written here once and every engine, export and draft config goes through it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...config import HiddenStatesConfig

DEFAULT_AUX_LAYER_COUNT = (
    3  # default_aux_layers' length: what a server sends per token is this + the last layer
)


def default_aux_layers(num_layers: int) -> list[int]:
    """Outputs of decoder layers [1, L//2-1, L-4] (SpecForge and Model-Optimizer; speculators' [2, L//2, L-3]
    counted as layer inputs are the same tensors)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def configured_aux_layers(hidden: HiddenStatesConfig, num_layers: int) -> list[int]:
    """The aux layers a configuration extracts: `hidden_states.aux_layers`, or the default for this depth."""
    return list(hidden.aux_layers) if hidden.aux_layers else default_aux_layers(num_layers)


def aux_layer_count(hidden: HiddenStatesConfig) -> int:
    """How many aux layers a configuration extracts, known without the target's depth."""
    return len(hidden.aux_layers) if hidden.aux_layers else DEFAULT_AUX_LAYER_COUNT


def output_hidden_states_ids(aux_layers: Sequence[int]) -> list[int]:
    """Our aux layers (decoder outputs) as `output_hidden_states` indices (vLLM's and speculators' ids)."""
    return [a + 1 for a in aux_layers]


def decoder_output_ids(output_hidden_states_indices: Sequence[int]) -> list[int]:
    """`output_hidden_states` indices back as decoder-layer outputs (the ids SGLang reads from a draft
    config)."""
    return [i - 1 for i in output_hidden_states_indices]
