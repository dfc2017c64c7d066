"""The spot check of a served target: pieces of the checkpoint (the embedding, the first decoder layers, the
final norm and the head, read by tensor name), never the whole target, which may be far larger than the
checking machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..report.validation import Verdict
from .spot_rules import (
    Agreement,
    StoredExtraction,
    agreement_summary,
    rules_metadata,
    spot_rule,
    worst_of,
)

# -- the spot check of a served target: pieces of the checkpoint, never the whole target
# ----------------------- The last states through the final norm and the head predict the answer's next
# tokens. For answers the target decoded greedily, the head's argmax at row t is input_ids[t + 1] at nearly
# every answer token: what falls short is a near tie the generating engine's kernels or dtype decided the
# other way, and the end-of-turn token an answer cut at max_tokens gets from the template. States one position
# off predict the token before or after instead.
HEAD_GREEDY_SHARE = 0.9  # per sample, of the answer's tokens
HEAD_FREE_MISMATCHES = 1  # per sample: what a short answer may miss whatever its share
HEAD_CHUNK_ROWS = 256  # rows through the head at once: [256, vocab] fp32 logits, 160 MB for a 160k vocabulary
HEAD_OFFSETS = (-1, 0, 1)  # the stored alignment and one position either side


@dataclass(frozen=True)
class AnswerDecoding:
    """How the dataset's answers were decoded: the head's argmax is the answer only where they were greedy."""

    greedy: bool
    how: str

    @classmethod
    def of(cls, temperature: float, top_k: int | None = None) -> AnswerDecoding:
        if temperature == 0 or top_k == 1:
            return cls(True, "greedy (temperature 0)" if temperature == 0 else "greedy (top_k 1)")
        return cls(False, f"sampled (temperature {temperature}, top_k {top_k})")


@dataclass
class HeadAgreement:
    """How many answer tokens the head's argmax over the stored last states names, at the stored alignment
    (offset 0) and with the rows one position either side (what states shifted by one would score)."""

    answer_tokens: int = 0
    hits: dict[int, int] = field(default_factory=lambda: dict.fromkeys(HEAD_OFFSETS, 0))

    def share(self, offset: int = 0) -> float:
        return self.hits[offset] / self.answer_tokens if self.answer_tokens else 0.0

    def add(self, other: HeadAgreement) -> None:
        self.answer_tokens += other.answer_tokens
        for k in HEAD_OFFSETS:
            self.hits[k] += other.hits[k]

    def greedy_ok(self) -> bool:
        misses = self.answer_tokens - self.hits[0]
        return self.answer_tokens > 0 and (
            self.share() >= HEAD_GREEDY_SHARE or misses <= HEAD_FREE_MISMATCHES
        )

    def aligned(self) -> bool:
        """The stored rows predict the answer better than the same rows one position off (any decoding)."""
        return self.hits[0] > max(self.hits[-1], self.hits[1])


@dataclass
class ShallowTarget:
    """The target cut after its first decoder layers (read from the checkpoint by tensor name), its final norm
    and head kept apart: the cut's own outputs are then decoder-layer outputs (no norm after the last one),
    and the norm and head score the stored last states."""

    base: Any
    norm: Any
    head: Any
    n_layers: int

    @classmethod
    def load(cls, pieces: Any, n_layers: int, trust_remote_code: bool = False) -> ShallowTarget:
        import torch

        model = pieces.first_layers_model(n_layers, trust_remote_code)
        base = getattr(model, "model", model)
        norm = base.norm
        base.norm = torch.nn.Identity()
        return cls(base, norm, model.get_output_embeddings(), n_layers)

    def layer_outputs(self, ids: Any) -> tuple:
        """hidden_states of one sample: entry i + 1 is decoder layer i's output, for i < n_layers."""
        import torch

        with torch.inference_mode():
            out = self.base(input_ids=ids.to(torch.long)[None], output_hidden_states=True, use_cache=False)
        return tuple(h[0].float() for h in out.hidden_states)

    def argmax(self, last: Any) -> Any:
        """The head's greedy token for each row of stored last states (through the final norm), in chunks."""
        import torch

        picks = []
        with torch.inference_mode():
            for a in range(0, last.shape[0], HEAD_CHUNK_ROWS):
                rows = last[a : a + HEAD_CHUNK_ROWS].float()
                picks.append(self.head(self.norm(rows)).argmax(-1))
        return torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long)


def answer_positions(mask: Any) -> np.ndarray:
    """The positions of the sample's last answer (its final run of loss_mask 1, never position 0): the turn
    the target generated; a row's earlier assistant turns may be the source's (train_all_assistant_turns)."""
    on = np.flatnonzero(np.asarray(mask) == 1)
    on = on[on >= 1]
    breaks = np.flatnonzero(np.diff(on) > 1)
    return on[breaks[-1] + 1 :] if breaks.size else on


def head_agreement(target: ShallowTarget, ids: Any, mask: Any, last: Any) -> HeadAgreement:
    """Row t - 1 + offset's argmax against answer token t, for each offset in HEAD_OFFSETS."""
    import torch

    wanted = answer_positions(mask)
    if wanted.size == 0:
        return HeadAgreement()
    lo, hi = max(0, int(wanted[0]) - 2), min(len(ids), int(wanted[-1]) + 1)
    picks = target.argmax(last[lo:hi])
    out = HeadAgreement(answer_tokens=int(wanted.size))
    tokens = ids.to(torch.long)[torch.as_tensor(wanted)]
    for offset in HEAD_OFFSETS:
        rows = torch.as_tensor(wanted - 1 + offset - lo)
        inside = (rows >= 0) & (rows < len(picks))
        out.hits[offset] = int((picks[rows[inside]] == tokens[inside]).sum())
    return out


def spot_check_pieces(
    folder: Path,
    pieces: Any,
    sample_ids: list[str],
    decoding: AnswerDecoding = AnswerDecoding(True, "greedy (temperature 0)"),
    trust_remote_code: bool = False,
) -> Verdict:
    """The spot check with pieces of the checkpoint only (`core.target_model.pieces.CheckpointPieces`), for a
    target served elsewhere: the shallowest aux layer recomputed from the embedding and the first decoder
    layers (held to `SPOT_RULES` like the whole forward), and the stored last states through the final norm
    and the head, whose argmax must name the greedy answer's next tokens (`HeadAgreement`). A layer off by one
    or states shifted by a position fail either part. The deeper aux layers would need most of the target:
    they are not recomputed, and the metadata says so."""
    from .reader import HiddenStatesReader

    reader = HiddenStatesReader(folder)
    made = {sid: StoredExtraction.of(folder, reader._where[sid][0]) for sid in sample_ids}
    if not made:
        return Verdict(False, {"samples": 0, "reason": "no sample to recompute"})
    target = ShallowTarget.load(pieces, max(m.first for m in made.values()) + 1, trust_remote_code)
    worst = Agreement(1.0, 1.0, 0.0, 0.0)
    failing: list[str] = []
    details: dict[str, dict[str, float]] = {}
    heads = HeadAgreement()
    for sid, how in made.items():
        stored = reader.sample(sid)
        hs = target.layer_outputs(stored["input_ids"])
        got = Agreement.of(how.first_block(stored["aux_hidden_states"], hs[0].shape[-1]), hs[how.first + 1])
        head = head_agreement(target, stored["input_ids"], stored["loss_mask"], stored["last_hidden_state"])
        heads.add(head)
        worst = worst_of(worst, got)
        if not how.rule.passes(got):
            failing.append(f"{sid}:aux{how.first}")
        if decoding.greedy and not head.greedy_ok():
            failing.append(f"{sid}:last")
        details[sid] = {
            "aux_min": round(got.min_cosine, 6),
            "aux_median": round(got.median_cosine, 6),
            "aux_max_norm_deviation": round(got.max_norm_dev, 5),
            "head": round(head.share(), 4),
        }
    if not decoding.greedy and not heads.aligned():
        failing.append("last (alignment over every sample)")
    return Verdict(
        not failing,
        {
            **_pieces_method(target.n_layers, made),
            **_aux_summary(made, worst),
            **_head_summary(heads, decoding),
            "failing": json.dumps(failing[:10]),
            "per_sample": json.dumps(details),
        },
    )


def _pieces_method(n_layers: int, made: dict[str, StoredExtraction]) -> dict[str, Any]:
    checked = sorted({m.first for m in made.values()})
    others = sorted({a for m in made.values() for a in m.aux_layers} - set(checked))
    return {
        "samples": len(made),
        "recomputed_with": f"pieces of the checkpoint: the embedding, decoder layers 0-{n_layers - 1}, the "
        "final norm and the head, read by tensor name (never the whole target)",
        "aux_layers_checked": json.dumps(checked),
        "aux_layers_not_recomputed": json.dumps(others),
        "not_recomputed_because": "the deeper aux layers need most of the target; the consistency checks "
        "(the layers every shard names, shapes, ids, finite values) stand for them",
    }


def _aux_summary(made: dict[str, StoredExtraction], worst: Agreement) -> dict[str, Any]:
    return {
        **agreement_summary(worst),
        "compute_dtype": ", ".join(sorted({m.compute_dtype for m in made.values()})),
        **rules_metadata({m.rule_key: m.rule for m in made.values()}),
    }


def _head_summary(heads: HeadAgreement, decoding: AnswerDecoding) -> dict[str, Any]:
    if decoding.greedy:
        rule = (
            "per sample, the head's argmax over the stored last states (through the final norm) names at "
            f"least {HEAD_GREEDY_SHARE:.0%} of the answer's next tokens (or misses at most "
            f"{HEAD_FREE_MISMATCHES})"
        )
    else:
        rule = (
            "the argmax rule does not apply to sampled answers; alignment only: over every sample, the "
            "stored rows name more answer tokens than the same rows one position earlier or later"
        )
    reading = "aligned: the stored last states name the answer's next tokens"
    if heads.answer_tokens == 0:
        reading = "not checked: the samples hold no answer token (loss_mask 1) to predict"
    elif not heads.aligned():
        reading = "the stored last states name the tokens one position off: states shifted by a position"
    elif decoding.greedy and heads.share() < HEAD_GREEDY_SHARE:
        reading = (
            "aligned (the stored rows beat the rows one position off) but short of the greedy answer: the "
            "last states are from another layer, or the answers are not the target's greedy ones (imported, "
            "sampled: then say so in the dataset's sampling)"
        )
    return {
        "answer_decoding": decoding.how,
        "head_rule": rule,
        "head_reading": reading,
        "answer_tokens": heads.answer_tokens,
        "head_share": round(heads.share(0), 4),
        "head_share_one_row_earlier": round(heads.share(-1), 4),
        "head_share_one_row_later": round(heads.share(1), 4),
    }


def check_known_sample(
    pieces: Any,
    aux_layers: list[int],
    ids: list[int],
    answer_start: int,
    states: Any,
    compute_dtype: str,
    storage_dtype: str,
    trust_remote_code: bool = False,
) -> Verdict:
    """One sample's served states [T, n_aux + 1, H] (the aux layers in `aux_layers`' order, then the last)
    against pieces of the checkpoint, by the spot check's rules: the shallowest aux layer recomputed from the
    embedding and the first decoder layers, and the head's argmax over the last states naming the answer the
    same server decoded greedily (`ids[answer_start:]`). The self-check of a server whose engine version no
    test ran, before anything of it is stored."""
    import torch

    first = min(aux_layers)
    target = ShallowTarget.load(pieces, first + 1, trust_remote_code)
    t = torch.as_tensor(ids, dtype=torch.long)
    recomputed = target.layer_outputs(t)[first + 1]
    got = Agreement.of(states[:, aux_layers.index(first)].float(), recomputed)
    rule = spot_rule(compute_dtype, storage_dtype)
    mask = torch.zeros(len(ids), dtype=torch.int8)
    mask[answer_start:] = 1
    head = head_agreement(target, t, mask, states[:, -1].float())
    failing = ([f"aux{first}"] if not rule.passes(got) else []) + ([] if head.greedy_ok() else ["last"])
    return Verdict(
        not failing,
        {
            "tokens": len(ids),
            "aux_layer_checked": first,
            **agreement_summary(got),
            "compute_dtype": compute_dtype,
            "rule": json.dumps(rule.describe()),
            **_head_summary(head, AnswerDecoding(True, "greedy (temperature 0), by the server checked")),
            "failing": json.dumps(failing),
        },
    )
