"""The rules behind the hidden_states checks, as plain functions over the stored shards (testable without Dagster).

Wrong hidden states waste GPU-days before anyone notices (states silently wrong under chunked prefill, a library
upgrade that wrote zero files, ids shifted by one), so a partition's states pass only when: every token row has a
sample; the ids and loss mask stored beside the states are tokens.parquet's; every value is finite; every shard
describes the same extraction (model, revision, tokenizer, layers, dtype) with consistent shapes; and a few samples
recomputed by an independent path — a plain forward with `output_hidden_states`, not the extraction's hooks and
packing — agree with what is stored.

For a served target (`hidden_states.engine: vllm`, or one that does not fit the checking machine) the recomputation
uses pieces of the checkpoint only (`spot_check_pieces`): the shallowest aux layer recomputed from the embedding
and the first decoder layers, and the stored last states checked against the head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from ..report.validation import Verdict
from .fp8 import STATE_TENSORS, dequantize, is_fp8, scale_problems, scales_name
from .shards import finished_shards, input_hash
from .spot_rules import SPOT_COSINE, SPOT_RULES, Agreement, SpotRule, rules_metadata, spot_rule

__all__ = ["SPOT_COSINE", "SPOT_RULES"]  # the rules live in spot_rules; callers read them here too

# The rules by compute and storage dtype, and why: spot_rules.py.
FINITE_CHUNK_ROWS = 65_536


def coverage(tokens: pl.DataFrame, index: pl.DataFrame, skipped: dict[str, str]) -> Verdict:
    """Every token row has a sample (or a recorded reason it was skipped), and no sample is left over."""
    want = set(tokens["id"].to_list())
    have = set(index["id"].to_list())
    missing = sorted(want - have - set(skipped))
    extra = sorted(have - want)
    return Verdict(
        not missing and not extra and (bool(have) or not want),
        {
            "token_rows": len(want),
            "samples": len(have),
            "missing": len(missing),
            "skipped_too_long": len(set(skipped) & want),
            "not_in_tokens": len(extra),
            "examples": json.dumps((missing or extra)[:5]),
        },
    )


def ids_match(folder: Path, tokens: pl.DataFrame | pl.LazyFrame) -> Verdict:
    """The input_ids and loss_mask stored in each shard are exactly tokens.parquet's rows for those ids.

    Compared through a 64-bit hash per row and column (polars' hash of the list, the same function on both sides):
    tokens.parquet is reduced to its hashes by the streaming engine and each shard is hashed on its own, so memory
    holds hashes, not the partition's ids (200,000 rows of 2,500 ids would not fit as Python lists)."""
    from safetensors import safe_open

    want = (
        tokens.lazy()
        .select("id", *_list_hashes(pl.col("input_ids"), pl.col("loss_mask")))
        .collect(engine="streaming")
    )
    by_id = {sid: (a, m) for sid, a, m in want.iter_rows()}
    checked = bad = 0
    examples: list[str] = []
    for name, meta in finished_shards(folder).items():
        with safe_open(str(folder / name), framework="np") as f:
            ids, mask, cu = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("cu_seqlens")
        samples = meta["samples"]
        offsets = pa.array(np.asarray(cu[: len(samples) + 1], dtype=np.int64))
        stored = pl.DataFrame(
            {
                "input_ids": pl.from_arrow(
                    pa.LargeListArray.from_arrays(offsets, pa.array(ids.astype(np.int32)))
                ),
                "loss_mask": pl.from_arrow(
                    pa.LargeListArray.from_arrays(offsets, pa.array(mask.astype(np.int8)))
                ),
            }
        ).select(*_list_hashes(pl.col("input_ids"), pl.col("loss_mask")))
        for pos, ((sid, _n, h), got) in enumerate(zip(samples, stored.iter_rows(), strict=True)):
            checked += 1
            a, b = int(cu[pos]), int(cu[pos + 1])
            ok = by_id.get(sid) == got and h == input_hash(ids[a:b])
            if not ok:
                bad += 1
                if len(examples) < 5:
                    examples.append(sid)
    return Verdict(
        bad == 0, {"samples_checked": checked, "mismatched": bad, "examples": json.dumps(examples)}
    )


def _list_hashes(ids: pl.Expr, mask: pl.Expr) -> list[pl.Expr]:
    return [
        ids.cast(pl.List(pl.Int32)).hash(seed=11).alias("ids_hash"),
        mask.cast(pl.List(pl.Int8)).hash(seed=11).alias("mask_hash"),
    ]


def finite(folder: Path) -> Verdict:
    """No NaN or Inf anywhere in the stored states, read as a trainer reads them (FP8: dequantized, so a scale of
    Inf or NaN shows), and no FP8 scale that quantization never writes (zero, negative, non-finite: a zero scale
    silently zeroes its token). A slice at a time: memory stays bounded."""
    from safetensors import safe_open

    bad: dict[str, int] = {}
    bad_scales: dict[str, int] = {}
    values = 0
    for name in finished_shards(folder):
        with safe_open(str(folder / name), framework="pt") as f:
            keys = set(f.keys())
            for key in STATE_TENSORS:
                scales = f.get_slice(scales_name(key)) if scales_name(key) in keys else None
                n_values, n_bad, n_scales = _scan(f.get_slice(key), scales)
                values += n_values
                if n_bad:
                    bad[f"{name}:{key}"] = n_bad
                if n_scales:
                    bad_scales[f"{name}:{scales_name(key)}"] = n_scales
    return Verdict(
        not bad and not bad_scales,
        {
            "values": values,
            "non_finite": sum(bad.values()),
            "where": json.dumps(bad),
            "bad_scales": sum(bad_scales.values()),
            "bad_scales_where": json.dumps(bad_scales),
        },
    )


def _scan(view: Any, scales: Any) -> tuple[int, int, int]:
    """(values, non-finite values, bad scales) of one stored tensor, dequantized where it has scales."""
    import torch

    values = non_finite = wrong = 0
    rows = view.get_shape()[0]
    for a in range(0, rows, FINITE_CHUNK_ROWS):
        t = view[a : a + FINITE_CHUNK_ROWS]
        if scales is not None:
            s = scales[a : a + FINITE_CHUNK_ROWS]
            wrong += scale_problems(s)
            t = dequantize(t, s)
        values += t.numel()
        non_finite += int((~torch.isfinite(t)).sum())
    return values, non_finite, wrong


def consistent(folder: Path, expected: dict[str, str]) -> Verdict:
    """Every shard describes the same extraction as the config asks for, and its tensors have matching shapes."""
    from safetensors import safe_open

    problems: list[str] = []
    shards = finished_shards(folder)
    for name, meta in shards.items():
        for key, want in expected.items():
            if str(meta.get(key, "")) != str(want):
                problems.append(f"{name}: {key} is {meta.get(key)!r}, expected {want!r}")
        with safe_open(str(folder / name), framework="pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        n = len(meta["samples"])
        tokens = sum(s[1] for s in meta["samples"])
        hidden = int(meta.get("hidden_size", 0))
        n_aux = len(json.loads(meta.get("aux_layers", "[]")))
        want_shapes = {
            "input_ids": [tokens],
            "loss_mask": [tokens],
            "cu_seqlens": [n + 1],
            "aux_hidden_states": [tokens, n_aux * hidden],
            "last_hidden_state": [tokens, hidden],
        }
        if is_fp8(meta.get("dtype", "")):
            want_shapes[scales_name("aux_hidden_states")] = [tokens, n_aux]
            want_shapes[scales_name("last_hidden_state")] = [tokens, 1]
        for key, shape in want_shapes.items():
            if shapes.get(key) != shape:
                problems.append(f"{name}: {key} has shape {shapes.get(key)}, expected {shape}")
        problems += [f"{name}: {p}" for p in _stored_dtypes(folder / name, meta.get("dtype", ""))]
    return Verdict(
        bool(shards) and not problems,
        {"shards": len(shards), "problems": len(problems), "details": json.dumps(problems[:10])},
    )


SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}


def _stored_dtypes(path: Path, dtype: str) -> list[str]:
    """The states are stored in the dtype the metadata names (and FP8 scales in float32)."""
    from safetensors import safe_open

    want = {k: SAFETENSORS_DTYPES.get(dtype, dtype) for k in STATE_TENSORS}
    if is_fp8(dtype):
        want.update({scales_name(k): "F32" for k in STATE_TENSORS})
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        got = {k: f.get_slice(k).get_dtype() for k in want if k in keys}
    return [
        f"{k} is stored as {got[k]}, the metadata's dtype {dtype} says {w}"
        for k, w in want.items()
        if got.get(k, w) != w
    ]


def spot_check(folder: Path, model: Any, sample_ids: list[str]) -> Verdict:
    """Recompute a few samples with a plain fp32 forward (`output_hidden_states`, one sample per forward, no
    packing) and compare with what is stored: aux layer i against hidden_states[i + 1], the stored last state
    through the model's own final norm against hidden_states[L]; held to the rule of the dtype the extraction
    computed in and the shards store (`spot_rules`). FP8 shards also compare the stored last state with the last
    decoder layer's own output (a hook of this check's), since the final norm hides a wrong per-token scale."""
    from .shards import HiddenStatesReader

    reader = HiddenStatesReader(folder)
    worst = Agreement(1.0, 1.0, 0.0, 0.0)
    failing: list[str] = []
    details: dict[str, list[float]] = {}
    rules: dict[str, SpotRule] = {}
    compute_dtypes = set()
    for sid in sample_ids:
        how = StoredExtraction.of(folder, reader._where[sid][0])
        compute_dtypes.add(how.compute_dtype)
        rules[how.rule_key] = how.rule
        for name, got in _recomputed_pairs(model, reader.sample(sid), how):
            details[f"{sid}:{name}"] = [round(got.min_cosine, 6), round(got.median_cosine, 6)]
            if how.rule.norm_every_token is not None:
                details[f"{sid}:{name}"] += [round(got.max_norm_dev, 5), round(got.median_norm_dev, 5)]
            worst = _worst(worst, got)
            if not how.rule.passes(got):
                failing.append(f"{sid}:{name}")
    return Verdict(
        bool(sample_ids) and not failing,
        {
            "samples": len(sample_ids),
            **_agreement_summary(worst),
            "compute_dtype": ", ".join(sorted(compute_dtypes)),
            **rules_metadata(rules),
            "failing": json.dumps(failing[:10]),
            "per_tensor_min_median": json.dumps(details),
        },
    )


def _recomputed_pairs(
    model: Any, stored: dict[str, Any], how: StoredExtraction
) -> list[tuple[str, Agreement]]:
    """Each stored tensor's agreement with one plain fp32 forward of the sample."""
    import torch

    base = getattr(model, "model", model)
    device = base.get_input_embeddings().weight.device
    ids = stored["input_ids"].to(torch.long)[None].to(device)
    grabbed: dict[str, Any] = {}
    layers = getattr(base, "layers", None)
    hook = None
    if is_fp8(how.storage_dtype) and layers is not None:
        hook = layers[-1].register_forward_hook(
            lambda _m, _i, out: grabbed.__setitem__("last", out[0] if isinstance(out, tuple) else out)
        )
    try:
        with torch.inference_mode():
            hs = base(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        if hook is not None:
            hook.remove()
    with torch.inference_mode():
        hidden = hs[0].shape[-1]
        aux = stored["aux_hidden_states"].float().to(device)
        out = [
            (f"aux{layer}", Agreement.of(aux[:, k * hidden : (k + 1) * hidden], hs[layer + 1][0]))
            for k, layer in enumerate(how.aux_layers)
        ]
        norm = getattr(base, "norm", None) or (lambda x: x)
        last = stored["last_hidden_state"].to(device, dtype=hs[-1].dtype)
        out.append(("last", _direction_only(Agreement.of(norm(last), hs[-1][0]))))
        if "last" in grabbed:
            out.append(("last_before_norm", Agreement.of(last, grabbed["last"][0])))
    return out


def _direction_only(a: Agreement) -> Agreement:
    """Through the final norm a token's magnitude is gone: only its direction counts."""
    return Agreement(a.min_cosine, a.median_cosine, 0.0, 0.0)


def _worst(a: Agreement, b: Agreement) -> Agreement:
    return Agreement(
        min(a.min_cosine, b.min_cosine),
        min(a.median_cosine, b.median_cosine),
        max(a.max_norm_dev, b.max_norm_dev),
        max(a.median_norm_dev, b.median_norm_dev),
    )


def _agreement_summary(worst: Agreement) -> dict[str, Any]:
    return {
        "min_token_cosine": round(worst.min_cosine, 6),
        "min_median_token_cosine": round(worst.median_cosine, 6),
        "max_token_norm_deviation": round(worst.max_norm_dev, 6),
        "max_median_token_norm_deviation": round(worst.median_norm_dev, 6),
    }


# -- the spot check of a served target: pieces of the checkpoint, never the whole target -----------------------
# The last states through the final norm and the head predict the answer's next tokens. For answers the target
# decoded greedily, the head's argmax at row t is input_ids[t + 1] at nearly every answer token: what falls short is
# a near tie the generating engine's kernels or dtype decided the other way, and the end-of-turn token an answer cut
# at max_tokens gets from the template. States one position off predict the token before or after instead.
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
    """The target cut after its first decoder layers (read from the checkpoint by tensor name), its final norm and
    head kept apart: the cut's own outputs are then decoder-layer outputs (no norm after the last one), and the
    norm and head score the stored last states."""

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
    """The positions of the sample's last answer (its final run of loss_mask 1, never position 0): the turn the
    target generated; a row's earlier assistant turns may be the source's (train_all_assistant_turns)."""
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


@dataclass(frozen=True)
class StoredExtraction:
    """What a sample's shard says about how its states were made: the aux layers and the compute dtype."""

    aux_layers: list[int]
    compute_dtype: str
    storage_dtype: str = "bfloat16"

    @classmethod
    def of(cls, folder: Path, shard: str) -> StoredExtraction:
        from .shards import read_shard_metadata

        meta = read_shard_metadata(folder / shard)
        # shards written before the key: fp32 compute on CPU
        compute = meta.get("compute_dtype") or "float32"
        return cls(json.loads(meta["aux_layers"]), compute, meta.get("dtype") or "bfloat16")

    @property
    def first(self) -> int:
        return min(self.aux_layers)

    @property
    def rule(self) -> SpotRule:
        return spot_rule(self.compute_dtype, self.storage_dtype)

    @property
    def rule_key(self) -> str:
        """The compute dtype, and the storage dtype where it sets its own rule (FP8)."""
        return (
            f"{self.compute_dtype} -> {self.storage_dtype}"
            if is_fp8(self.storage_dtype)
            else self.compute_dtype
        )

    def first_block(self, aux: Any, hidden: int) -> Any:
        k = self.aux_layers.index(self.first)
        return aux[:, k * hidden : (k + 1) * hidden].float()


def spot_check_pieces(
    folder: Path,
    pieces: Any,
    sample_ids: list[str],
    decoding: AnswerDecoding = AnswerDecoding(True, "greedy (temperature 0)"),
    trust_remote_code: bool = False,
) -> Verdict:
    """The spot check with pieces of the checkpoint only (`core.target.pieces.CheckpointPieces`), for a target
    served elsewhere: the shallowest aux layer recomputed from the embedding and the first decoder layers (held to
    `SPOT_RULES` like the whole forward), and the stored last states through the final norm and the head, whose
    argmax must name the greedy answer's next tokens (`HeadAgreement`). A layer off by one or states shifted by a
    position fail either part. The deeper aux layers would need most of the target: they are not recomputed, and
    the metadata says so."""
    from .shards import HiddenStatesReader

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
        worst = _worst(worst, got)
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
        "recomputed_with": f"pieces of the checkpoint: the embedding, decoder layers 0-{n_layers - 1}, the final "
        "norm and the head, read by tensor name (never the whole target)",
        "aux_layers_checked": json.dumps(checked),
        "aux_layers_not_recomputed": json.dumps(others),
        "not_recomputed_because": "the deeper aux layers need most of the target; the consistency checks (the "
        "layers every shard names, shapes, ids, finite values) stand for them",
    }


def _aux_summary(made: dict[str, StoredExtraction], worst: Agreement) -> dict[str, Any]:
    return {
        **_agreement_summary(worst),
        "compute_dtype": ", ".join(sorted({m.compute_dtype for m in made.values()})),
        **rules_metadata({m.rule_key: m.rule for m in made.values()}),
    }


def _head_summary(heads: HeadAgreement, decoding: AnswerDecoding) -> dict[str, Any]:
    if decoding.greedy:
        rule = (
            f"per sample, the head's argmax over the stored last states (through the final norm) names at least "
            f"{HEAD_GREEDY_SHARE:.0%} of the answer's next tokens (or misses at most {HEAD_FREE_MISMATCHES})"
        )
    else:
        rule = (
            "the argmax rule does not apply to sampled answers; alignment only: over every sample, the stored "
            "rows name more answer tokens than the same rows one position earlier or later"
        )
    reading = "aligned: the stored last states name the answer's next tokens"
    if heads.answer_tokens == 0:
        reading = "not checked: the samples hold no answer token (loss_mask 1) to predict"
    elif not heads.aligned():
        reading = "the stored last states name the tokens one position off: states shifted by a position"
    elif decoding.greedy and heads.share() < HEAD_GREEDY_SHARE:
        reading = (
            "aligned (the stored rows beat the rows one position off) but short of the greedy answer: the last "
            "states are from another layer, or the answers are not the target's greedy ones (imported, sampled: "
            "then say so in the dataset's sampling)"
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


def spot_sample_ids(index: pl.DataFrame, n: int = 3) -> list[str]:
    """A few samples across the length range (shortest, median, longest), deterministic."""
    if index.height == 0:
        return []
    ordered = index.sort(["n_tokens", "id"])["id"].to_list()
    picks = {ordered[0], ordered[len(ordered) // 2], ordered[-1]}
    return sorted(picks)[:n]
