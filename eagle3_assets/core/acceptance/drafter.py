"""A small EAGLE-3 draft head, its training-time test and its checkpoint, written here for the acceptance
gate.

Why not speculators' own model: speculators 0.9.0 pins transformers <= 5.19 while this platform runs 5.24 (it
needs `transformers serve` and the GGUF loader of that line), so it cannot share the process that holds the
target; and its `Trainer` moves the model to an accelerator, so the gate would need one. (Its Eagle3 model
itself trains on CPU with `--loss-implementation eager` in its own environment:
tests/test_trainers_read_exports.py.) The head is small (one decoder layer), so it is written here in plain
torch, in the layout SGLang and SpecForge load (`LlamaForCausalLMEagle3`: `fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`), so a drafter that passes the gate can be served as is; SpecForge's
`AutoDraftModel.from_pretrained` loads it with every stored tensor used (same test).

The architecture, as EAGLE-3 defines it:
- the target's three aux states at a position t are fused, fc: 3H -> H;
- one decoder layer sees [norm(embedding of token t+1); norm(fused state t)] (2H wide) in its attention, the
  fused state is the residual, and its output d_t predicts token t+2 over a reduced draft vocabulary;
- the target's embedding is frozen; `d2t[i]` is the offset from draft id i to its target id, `t2d` marks the
  target ids the draft vocabulary holds.

Training-time test (TTT): step 0 feeds the target's states; step j > 0 feeds the draft's own outputs of step j
- 1 at the same rows with the tokens one further on, so the draft learns from the states it will really see
when it drafts several tokens in a row. At step j, row t (position t + j) attends to the step-0 keys of rows
<= t of its sample and to its own chain (the keys of steps 1..j at row t), exactly the keys it has at
inference.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..hidden_states.draft_format import (
    VOCAB_MAPPING_FILE,
    DraftShape,
    draft_config,
    vocab_mapping,
)
from ..hidden_states.layer_ids import decoder_output_ids
from .simulated import implied_acceptance_length


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (the Llama half-split form) of x [heads, T, d] at integer positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@dataclass
class StepKV:
    """Keys and values of one TTT step ([kv_heads, T, d]), rotated at their positions."""

    k: torch.Tensor
    v: torch.Tensor


class DraftAttention(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(2 * s.hidden_size, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, StepKV]:
        """Queries [heads, T, d] and this step's keys/values for x [T, 2H]."""
        s = self.s
        t = x.shape[0]
        q = self.q_proj(x).view(t, s.num_attention_heads, s.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(t, s.num_key_value_heads, s.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(t, s.num_key_value_heads, s.head_dim).transpose(0, 1)
        return _rotate(q, positions, s.rope_theta), StepKV(_rotate(k, positions, s.rope_theta), v)

    def attend(
        self, q: torch.Tensor, ctx: StepKV, ctx_mask: torch.Tensor, chain: Sequence[StepKV]
    ) -> torch.Tensor:
        """q [heads, Tq, d] over the context keys (mask [Tq, Tk], True = visible) and, per query row, its own
        chain keys (each [kv_heads, Tq, d]: row i sees only row i). Returns [Tq, H]."""
        s = self.s
        rep = s.num_attention_heads // s.num_key_value_heads
        scale = 1.0 / math.sqrt(s.head_dim)
        kc = ctx.k.repeat_interleave(rep, 0)
        vc = ctx.v.repeat_interleave(rep, 0)
        scores = [(q @ kc.transpose(1, 2) * scale).masked_fill(~ctx_mask, float("-inf"))]
        for kv in chain:
            scores.append(((q * kv.k.repeat_interleave(rep, 0)).sum(-1) * scale)[..., None])
        w = torch.softmax(torch.cat(scores, -1), -1)
        tk = kc.shape[1]
        out = w[..., :tk] @ vc
        for i, kv in enumerate(chain):
            out = out + w[..., tk + i : tk + i + 1] * kv.v.repeat_interleave(rep, 0)
        return self.o_proj(out.transpose(0, 1).reshape(q.shape[1], -1))


class DraftMLP(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = DraftAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = DraftMLP(s)

    def inputs(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = hidden + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """The draft head. `embed_tokens` is the target's embedding, frozen."""

    # Buffers (register_buffer), named here for the type checker.
    draft_to_target: torch.Tensor
    target_to_draft: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, s: DraftShape, embedding: torch.Tensor, draft_ids: torch.Tensor):
        super().__init__()
        self.s = s
        self.embed_tokens = nn.Embedding.from_pretrained(embedding.detach().float().clone(), freeze=True)
        self.fc = nn.Linear(3 * s.hidden_size, s.hidden_size, bias=False)
        self.midlayer = DraftLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        ids = draft_ids.to(torch.long)
        d2t, t2d = vocab_mapping(ids, s.vocab_size)
        self.register_buffer("draft_to_target", ids, persistent=False)
        self.register_buffer("d2t", d2t, persistent=True)
        self.register_buffer("t2d", t2d, persistent=True)
        target_to_draft = torch.full((s.vocab_size,), -1, dtype=torch.long)
        target_to_draft[ids] = torch.arange(len(ids))
        self.register_buffer("target_to_draft", target_to_draft, persistent=False)

    def step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx_mask: torch.Tensor,
        past: StepKV | None = None,
        chain: Sequence[StepKV] | None = None,
    ) -> tuple[torch.Tensor, StepKV]:
        """One pass of the layer over rows [T] (tokens, input states [T, H]) -> (output states [T, H], the
        rows' keys/values).

        chain None, a step-0 pass: the context is `past` (earlier rows, if any) then these rows' own keys,
        visible under ctx_mask [T, T_past + T]. chain a list, a later step: the context is `past` (the step-0
        keys) under ctx_mask, and each row also sees its own chain (the keys of its earlier steps, then its
        own key)."""
        layer = self.midlayer
        x = layer.inputs(self.embed_tokens(tokens), hidden)
        q, kv = layer.self_attn.project(x, positions)
        if chain is None:
            ctx = kv if past is None else StepKV(torch.cat([past.k, kv.k], 1), torch.cat([past.v, kv.v], 1))
            attn = layer.self_attn.attend(q, ctx, ctx_mask, [])
        else:
            assert past is not None
            attn = layer.self_attn.attend(q, past, ctx_mask, [*chain, kv])
        return layer.finish(hidden, attn), kv

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(states))

    def to_target(self, draft_token: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_token]


@dataclass
class TrainSample:
    """One conversation: ids [T], loss mask [T], the target's fused-input aux states [T, 3H]."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor


def _pack(samples: Sequence[TrainSample], steps: int) -> dict[str, Any]:
    """A packed batch: rows t of every sample that have a token t+1 (a step-0 input), with per step j the
    input token (t+1+j), the label (t+2+j), whether it counts (in the sample and under the loss mask) and
    whether the row is still needed (it counts at step j or later: later steps run only on those rows)."""
    cols: dict[str, list[torch.Tensor]] = {"aux": [], "pos": [], "seg": []}
    per_step: list[dict[str, list[torch.Tensor]]] = [
        {"tok": [], "label": [], "counts": []} for _ in range(steps)
    ]
    for n_s, s in enumerate(samples):
        ids, mask = s.input_ids, s.loss_mask
        length = len(ids)
        n = length - 1
        cols["aux"].append(s.aux[:n])
        cols["pos"].append(torch.arange(n))
        cols["seg"].append(torch.full((n,), n_s))
        for j in range(steps):
            idx = torch.arange(n) + 1 + j
            lidx = idx + 1
            per_step[j]["tok"].append(torch.where(idx < length, ids[idx.clamp(max=length - 1)], 0))
            per_step[j]["label"].append(torch.where(lidx < length, ids[lidx.clamp(max=length - 1)], 0))
            per_step[j]["counts"].append((lidx < length) & (mask[lidx.clamp(max=length - 1)] > 0))
    out: dict[str, Any] = {k: torch.cat(v) for k, v in cols.items()}
    out["steps"] = [{k: torch.cat(v) for k, v in d.items()} for d in per_step]
    needed = torch.zeros_like(out["steps"][0]["counts"])
    for j in reversed(range(steps)):
        needed = needed | out["steps"][j]["counts"]
        out["steps"][j]["needed"] = needed.clone()
    return out


@dataclass
class StepOutput:
    """One TTT step over a packed batch: the rows it ran on, their output states, labels (draft ids, -1
    outside the draft vocabulary) and which of them count in the loss."""

    step: int
    rows: torch.Tensor
    states: torch.Tensor
    target: torch.Tensor
    counted: torch.Tensor


def ttt_forward(model: Eagle3Draft, samples: Sequence[TrainSample], steps: int) -> Iterator[StepOutput]:
    """The training-time test over a packed batch. Step 0 runs on every row with the target's states; step j >
    0 on the rows a label at step j or later still needs (the answer, not the prompt), with the draft's own
    outputs of step j - 1 at the same rows, at positions t + j, seeing the step-0 keys of its sample up to row
    t and its own chain."""
    b = _pack(samples, steps)
    pos, seg = b["pos"], b["seg"]
    visible = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    rows = torch.arange(len(pos))
    hidden = model.fc(b["aux"])
    ctx: StepKV | None = None
    chain: list[StepKV] = []
    for j in range(steps):
        st = b["steps"][j]
        if j:
            keep = torch.nonzero(st["needed"][rows]).flatten()
            if not len(keep):
                return
            hidden, rows = hidden[keep], rows[keep]
            chain = [StepKV(kv.k[:, keep], kv.v[:, keep]) for kv in chain]
        out, kv = model.step(
            st["tok"][rows].long(), hidden, pos[rows] + j, visible[rows], ctx, None if ctx is None else chain
        )
        if ctx is None:
            ctx = kv
        else:
            chain.append(kv)
        target = model.target_to_draft[st["label"][rows].long()]
        yield StepOutput(j, rows, out, target, st["counts"][rows] & (target >= 0))
        hidden = out


def ttt_loss(
    model: Eagle3Draft, samples: Sequence[TrainSample], steps: int
) -> tuple[torch.Tensor, list[float]]:
    """The mean over TTT steps of the cross-entropy of token t+2+j at row t, counted only where its loss-mask
    value is 1 and the token is in the draft vocabulary; and each step's accuracy on the counted rows."""
    total = torch.zeros(())
    accs: list[float] = []
    for o in ttt_forward(model, samples, steps):
        if o.counted.any():  # the head only where a label counts (prompt rows feed attention, not the loss)
            logits = model.logits(o.states[o.counted])
            total = total + F.cross_entropy(logits, o.target[o.counted])
            accs.append(float((logits.argmax(-1) == o.target[o.counted]).float().mean()))
        else:
            accs.append(float("nan"))
    return total / steps, accs


def batches(
    samples: Sequence[TrainSample], max_tokens: int, rng: np.random.Generator
) -> list[list[TrainSample]]:
    """Shuffled packs of samples up to max_tokens each (a longer sample is a pack of its own)."""
    order = rng.permutation(len(samples))
    packs: list[list[TrainSample]] = [[]]
    size = 0
    for i in order:
        s = samples[int(i)]
        if packs[-1] and size + len(s.input_ids) > max_tokens:
            packs.append([])
            size = 0
        packs[-1].append(s)
        size += len(s.input_ids)
    return [p for p in packs if p]


@dataclass
class TrainStats:
    steps: int
    tokens_seen: int
    first_loss: float
    final_loss: float
    final_step_accuracy: list[float]
    seconds: float


def train(
    model: Eagle3Draft,
    samples: Sequence[TrainSample],
    *,
    optimizer_steps: int,
    ttt_steps: int,
    lr: float,
    max_batch_tokens: int,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> TrainStats:
    """A fixed budget of optimizer steps (AdamW, cosine decay after a short warm-up) over shuffled packs."""
    import time

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, optimizer_steps // 20)

    def rate(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, optimizer_steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    t0 = time.perf_counter()
    packs: list[list[TrainSample]] = []
    first = final = float("nan")
    accs: list[float] = []
    seen = 0
    model.train()
    for i in range(optimizer_steps):
        if not packs:
            packs = batches(samples, max_batch_tokens, rng)
        pack = packs.pop()
        loss, accs = ttt_loss(model, pack, ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        seen += sum(len(s.input_ids) for s in pack)
        final = float(loss.detach())
        if i == 0:
            first = final
        if (i + 1) % max(1, optimizer_steps // 5) == 0:
            log(
                f"acceptance: draft training step {i + 1}/{optimizer_steps}: loss {final:.3f}, "
                f"step accuracy {', '.join(f'{a:.2f}' for a in accs)} (implied acceptance length "
                f"{implied_acceptance_length(accs):.2f})"
            )
    model.eval()
    return TrainStats(optimizer_steps, seen, first, final, accs, time.perf_counter() - t0)


@torch.no_grad()
def step_accuracy(
    model: Eagle3Draft, samples: Sequence[TrainSample], steps: int, max_batch_tokens: int
) -> list[float]:
    """Each TTT step's accuracy over every counted position of `samples` (teacher-forced, no gradient),
    in packs of up to `max_batch_tokens`; NaN for a step with no counted position."""
    was_training = model.training
    model.eval()
    right, counted = [0] * steps, [0] * steps
    for pack in batches(samples, max_batch_tokens, np.random.default_rng(0)):
        for o in ttt_forward(model, pack, steps):
            if o.counted.any():
                logits = model.logits(o.states[o.counted])
                right[o.step] += int((logits.argmax(-1) == o.target[o.counted]).sum())
                counted[o.step] += int(o.counted.sum())
    model.train(was_training)
    return [r / c if c else float("nan") for r, c in zip(right, counted, strict=True)]


SGLANG_CONFIG = "config.sglang.json"  # the same draft's config with the layer ids as SGLang reads them


def save_checkpoint(model: Eagle3Draft, folder: Path, layer_ids: list[int], target: str) -> None:
    """config.json + model.safetensors as vLLM serves an EAGLE-3 draft (`LlamaForCausalLMEagle3`, the tensors
    SpecForge writes), and its vocabulary maps as SpecForge's `vocab_mapping.pt`, so that SpecForge can
    warm-start from it without deriving other maps (which would leave the trained `lm_head` rows pointing at
    other tokens).

    `layer_ids` are `output_hidden_states` indices (id k: the input of decoder layer k), which is how vLLM
    reads `eagle_aux_hidden_state_layer_ids`; SGLang adds one to each id it reads, so the same list would feed
    it other layers: `config.sglang.json` beside it carries SGLang's list (serve the folder with it as
    config.json)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    s = model.s
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    torch.save({"d2t": state["d2t"], "t2d": state["t2d"]}, folder / VOCAB_MAPPING_FILE)
    for name, ids in (("config.json", list(layer_ids)), (SGLANG_CONFIG, decoder_output_ids(layer_ids))):
        config = draft_config(s, ids, "float32")
        config["eagle3_assets"] = {
            "target": target,
            "shape": asdict(s),
            "output_hidden_states_ids": list(layer_ids),
        }
        (folder / name).write_text(json.dumps(config, indent=2) + "\n")


def load_checkpoint(folder: Path, embedding: torch.Tensor) -> Eagle3Draft:
    """A draft saved by save_checkpoint (the target's embedding is not in the file: it is the target's)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    shape = DraftShape(**config["eagle3_assets"]["shape"])
    state = load_file(str(folder / "model.safetensors"))
    ids = state["d2t"] + torch.arange(len(state["d2t"]))
    model = Eagle3Draft(shape, embedding, ids)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k != "embed_tokens.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{folder}: not a draft of this layout (missing {missing}, unexpected {result.unexpected_keys})"
        )
    return model.eval()
