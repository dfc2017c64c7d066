"""The in-process engine of the acceptance gate: the target in this process, a speculative loop of this
project's own (for targets that fit the step; `acceptance.engine: transformers`).

Greedy speculative decoding with k draft tokens per target forward. The features are the target's own
`output_hidden_states` at the ids the speculators export declares (an independent path from the extraction
hooks), the draft's own states carry its later steps (EAGLE-3's chain), and the target verifies all k drafts
in one forward with its KV cache. Acceptance length = tokens produced per verifying forward (accepted + 1);
per-position rates are conditional (position i counted only where 1..i-1 were accepted).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .measure import Measured, PartMeasure, PromptSet


class SpeculativeDecoder:
    """Greedy speculative decoding of the target with an EAGLE-3 draft, counting accepted drafts per
    forward."""

    def __init__(self, model: Any, feature_ids: Sequence[int], stop_ids: set[int], device: str):
        self.model = model
        self.feature_ids = list(feature_ids)
        self.stop_ids = stop_ids
        self.device = device
        # transformers 5.24 renamed `past_key_values` to `cache`; older versions know only the first.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def _target(self, ids: list[int], cache: Any) -> tuple[Any, Any]:
        import torch

        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            **{self._cache_arg: cache},
            use_cache=True,
            output_hidden_states=True,
        )
        hs = out.hidden_states
        feats = torch.cat([hs[j][0] for j in self.feature_ids], -1).float()
        return out.logits[0].argmax(-1), feats

    def decode(self, draft: Any, prompt: list[int], k: int, max_new: int) -> tuple[list[int], list[int]]:
        """Accepted drafts per verifying forward, and the tokens generated (exactly the target's greedy
        answer, whatever the draft proposes: the draft only changes how many forwards it takes)."""
        import torch
        from transformers import DynamicCache

        from .drafter import StepKV

        cache = DynamicCache()
        with torch.no_grad():
            nxt, feats = self._target(prompt, cache)
            tokens = [*prompt, int(nxt[-1])]
            n_new = 1
            # Draft rows 0..p-1: row t holds token t+1 and the target's state at t.
            rows = torch.arange(len(prompt), device=self.device)
            ctx: StepKV | None = None
            last, ctx = self._extend(draft, tokens, feats, rows, ctx)
            rounds: list[int] = []
            while n_new < max_new and tokens[-1] not in self.stop_ids:
                n = len(tokens) - 2  # the last draft row
                drafts = self._draft(draft, last, ctx, tokens[-1], n, k)
                verify, feats = self._target([tokens[-1], *drafts], cache)
                accepted = 0
                while accepted < k and int(verify[accepted]) == drafts[accepted]:
                    accepted += 1
                new = [*drafts[:accepted], int(verify[accepted])]
                rounds.append(accepted)
                for i, t in enumerate(new):  # stop at an end of turn inside what was accepted
                    if t in self.stop_ids:
                        new = new[: i + 1]
                        break
                tokens.extend(new)
                n_new += len(new)
                extra = cache.get_seq_length() - (len(tokens) - 1)  # the rejected drafts' positions
                if extra > 0:
                    cache.crop(-extra)
                rows = torch.arange(n + 1, n + 1 + len(new), device=self.device)
                last, ctx = self._extend(draft, tokens, feats[: len(new)], rows, ctx)
        return rounds, tokens[len(prompt) :]

    def _extend(self, draft: Any, tokens: list[int], feats: Any, rows: Any, ctx: Any) -> tuple[Any, Any]:
        """Step-0 rows for the new positions (token t+1, target state t), appended to the draft's context."""
        import torch

        from .drafter import StepKV

        toks = torch.tensor([tokens[int(t) + 1] for t in rows], device=self.device)
        past = 0 if ctx is None else ctx.k.shape[1]
        n = len(rows)
        mask = torch.ones(n, past + n, dtype=torch.bool, device=self.device)
        mask[:, past:] = torch.tril(mask[:, past:])
        out, kv = draft.step(toks, draft.fc(feats), rows, mask, ctx)
        ctx = kv if ctx is None else StepKV(torch.cat([ctx.k, kv.k], 1), torch.cat([ctx.v, kv.v], 1))
        return out[-1:], ctx

    def _draft(self, draft: Any, last: Any, ctx: Any, bonus: int, n: int, k: int) -> list[int]:
        """k draft tokens after `bonus` (the token at row n + 1): step 0's output, then the chain."""
        import torch

        out = last
        y = int(draft.to_target(draft.logits(out).argmax(-1))[0])
        drafts = [y]
        chain: list[Any] = []
        mask = torch.ones(1, ctx.k.shape[1], dtype=torch.bool, device=self.device)
        for j in range(1, k):
            out, kv = draft.step(
                torch.tensor([y], device=self.device),
                out,
                torch.tensor([n + j], device=self.device),
                mask,
                ctx,
                chain,
            )
            chain.append(kv)
            y = int(draft.to_target(draft.logits(out).argmax(-1))[0])
            drafts.append(y)
        return drafts


class InProcessMeasurer:
    """`DraftMeasurer` with the target in this process."""

    engine = "transformers"

    def __init__(self, decoder: SpeculativeDecoder, k: int, max_new: int):
        self.decoder = decoder
        self.k = k
        self.max_new = max_new
        self.device = decoder.device

    def measure(self, draft: Any, folder: Path, parts: Mapping[str, PromptSet]) -> dict[str, Measured]:
        draft = draft.to(self.decoder.device).eval()
        out = {}
        for name, ps in parts.items():
            rounds: list[int] = []
            outputs = []
            for p in ps.prompts:
                r, generated = self.decoder.decode(draft, p, self.k, self.max_new)
                rounds.extend(r)
                outputs.append(generated[: self.max_new])  # a last accepted run may pass max_new
            new = sum(len(o) for o in outputs)
            out[name] = Measured(PartMeasure.from_rounds(rounds, self.k, ps.ids, new), outputs)
        return out

    def greedy(self, prompts: PromptSet) -> list[list[int]]:
        import torch

        model, stop = self.decoder.model, sorted(self.decoder.stop_ids)
        out = []
        with torch.no_grad():
            for p in prompts.prompts:
                ids = torch.tensor([p], device=self.decoder.device)
                gen = model.generate(ids, max_new_tokens=self.max_new, do_sample=False, eos_token_id=stop)
                out.append(gen[0, len(p) :].tolist())
        return out


class InProcessFeatures:
    """`FeatureSource` from a forward of the target in this process."""

    def __init__(self, model: Any, feature_ids: Sequence[int], device: str):
        self.model = model
        self.feature_ids = list(feature_ids)
        self.device = device

    def aux_states(self, samples: Sequence[np.ndarray]) -> list[Any]:
        import torch

        out = []
        for ids in samples:
            x = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None].to(self.device)
            with torch.no_grad():
                hs = self.model(input_ids=x, output_hidden_states=True).hidden_states
            out.append(torch.cat([hs[j][0] for j in self.feature_ids], -1).float().cpu())
        return out
