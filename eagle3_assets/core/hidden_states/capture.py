"""The target's states captured by forward hooks on the decoder layers EAGLE-3 needs, over packed rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class HiddenStateCapture:
    """Forward hooks on the decoder layers that EAGLE-3 needs; the rest of the model runs as usual."""

    def __init__(self, model: Any, aux_layers: Sequence[int]):
        self.model = model
        layers = _decoder_layers(model)
        self.num_layers = len(layers)
        self.aux_layers = list(aux_layers)
        bad = [i for i in self.aux_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"aux layers {bad} are outside the model's {self.num_layers} decoder layers")
        self.last_layer = self.num_layers - 1
        self._out: dict[int, Any] = {}
        wanted = sorted({*self.aux_layers, self.last_layer})
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in wanted]

    def _hook(self, i: int) -> Callable:
        def grab(_module: Any, _inputs: Any, output: Any) -> None:
            self._out[i] = output[0] if isinstance(output, tuple) else output

        return grab

    def forward_packed(self, rows: list[np.ndarray]) -> tuple[list[Any], Any]:
        """One packed row (samples back to back, positions restarting per sample) -> ([aux layer] [T, H] each,
        last [T, H]), still on the model's device."""
        import torch

        ids = np.concatenate(rows)
        positions = np.concatenate([np.arange(len(r)) for r in rows])
        device = _input_device(self.model)
        self._out.clear()
        with torch.inference_mode():
            # No attention mask and no cache: transformers reads the packing from position_ids
            # (block-diagonal).
            _base_model(self.model)(
                input_ids=torch.from_numpy(ids.astype(np.int64))[None].to(device),
                position_ids=torch.from_numpy(positions.astype(np.int64))[None].to(device),
                use_cache=False,
            )
        # Concatenation happens later, on the writer thread, off the forward's critical path.
        return [self._out[i][0] for i in self.aux_layers], self._out[self.last_layer][0]

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _decoder_layers(model: Any) -> Any:
    base = _base_model(model)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find its decoder layers")
    return layers


def _base_model(model: Any) -> Any:
    return getattr(model, "model", model)


def _input_device(model: Any) -> Any:
    emb = _base_model(model).get_input_embeddings()
    return emb.weight.device


PACKING_COSINE = 0.999


def packing_is_exact(capture: HiddenStateCapture, vocab_size: int) -> tuple[bool, float]:
    """Two short samples forwarded packed (positions restarting, no mask) against each forwarded alone. A
    model whose attention ignores the packed boundaries (some trust_remote_code models build their own causal
    mask) lets the second sample see the first: its states then differ, and extraction must not pack for that
    model."""
    import torch

    rng = np.random.default_rng(0)
    a = rng.integers(10, min(vocab_size, 30_000), 9).astype(np.int32)
    b = rng.integers(10, min(vocab_size, 30_000), 7).astype(np.int32)
    aux_ab, last_ab = capture.forward_packed([a, b])
    packed = torch.cat([*aux_ab, last_ab], dim=-1).float()
    alone = []
    for x in (a, b):
        aux, last = capture.forward_packed([x])
        alone.append(torch.cat([*aux, last], dim=-1).float())
    sim = float(torch.nn.functional.cosine_similarity(packed, torch.cat(alone), dim=-1).min())
    return sim >= PACKING_COSINE, sim
