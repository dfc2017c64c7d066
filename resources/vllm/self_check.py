"""The self-check of a hidden-states server whose vLLM version no test of this project ran
(`cpu_build.TESTED_VLLM_VERSIONS`): instead of refusing it, the extraction warns and, before it extracts
anything from that server, checks one known sample.

The sample: a fixed text the server tokenizes and continues greedily (`ANSWER_TOKENS` tokens, its own
decoding), then the prompt and answer ids sent back through the extraction's own path (the request, the
connector's file, its lock, the checks of ids and shapes). The states are compared with pieces of the
checkpoint recomputed here, by the spot check's rules (`core/hidden_states/spot_pieces.check_known_sample`):
the shallowest aux layer from the embedding and the first decoder layers, and the last layer through the final
norm and the head, whose argmax must name the answer the server decoded. A layer off by one, rows shifted by a
position, states of another layer or of nothing fail it; the extraction then refuses, saying what disagreed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3_assets.config import ProjectConfig
from eagle3_assets.core.hidden_states.fp8 import FP8, QuantizedStates
from eagle3_assets.core.hidden_states.layer_ids import default_aux_layers
from eagle3_assets.core.hidden_states.spot_pieces import check_known_sample
from eagle3_assets.core.report.validation import Verdict
from eagle3_assets.core.target_model.loading import resolve

KNOWN_TEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
ANSWER_TOKENS = 16


class SelfCheckFailed(RuntimeError):
    """A server on an untested vLLM version failed the self-check (or it could not run); nothing was
    extracted."""


@dataclass(frozen=True)
class ServedSelfCheck:
    """What the self-check needs of the project: the target's checkpoint (read in pieces) and the aux layers
    the servers were started with."""

    model_ref: str
    revision: str | None = None
    aux_layers: tuple[int, ...] | None = None  # hidden_states.aux_layers; None: the default for the depth
    trust_remote_code: bool = False

    @classmethod
    def of(cls, cfg: ProjectConfig) -> ServedSelfCheck:
        aux = cfg.hidden_states.aux_layers
        return cls(
            resolve(cfg.target.model, cfg.base_dir),
            cfg.target.revision,
            tuple(aux) if aux else None,
            cfg.target.trust_remote_code,
        )

    def generation(self, model: str) -> dict[str, Any]:
        """The request that has the server tokenize the known text and continue it greedily (no file: it does
        not ask the connector to save)."""
        return {
            "model": model,
            "prompt": KNOWN_TEXT,
            "max_tokens": ANSWER_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }

    def verdict(self, ids: list[int], answer_start: int, states: Any) -> Verdict:
        """The served states of the known sample ([T, n_aux + 1, H], or as the connector wrote them in FP8)
        against the checkpoint's pieces. Raises `CheckpointError` where the checkpoint is not here."""
        from eagle3_assets.core.target_model.pieces import CheckpointPieces

        pieces = CheckpointPieces.find(self.model_ref, self.revision)
        depth = int(pieces.text_config["num_hidden_layers"])
        aux = list(self.aux_layers) if self.aux_layers else default_aux_layers(depth)
        if isinstance(states, QuantizedStates):
            values, compute, storage = states.dequantized(), states.source_dtype, FP8
        else:
            compute = str(states.dtype).removeprefix("torch.")
            values, storage = states.float(), compute
        return check_known_sample(
            pieces, aux, ids, answer_start, values, compute, storage, self.trust_remote_code
        )


def describe_verdict(verdict: Verdict) -> str:
    """What the check measured, in one line."""
    md = verdict.metadata
    return (
        f"aux layer {md['aux_layer_checked']}: worst token cosine {md['min_token_cosine']}, median "
        f"{md['min_median_token_cosine']} (rule {md['rule']}); the head names {md['head_share']:.0%} of the "
        f"server's greedy answer ({md['answer_tokens']} tokens; one row earlier "
        f"{md['head_share_one_row_earlier']:.0%}, one later {md['head_share_one_row_later']:.0%})"
    )
