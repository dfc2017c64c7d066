"""FP8 storage of hidden states: float8_e4m3fn values with one float32 scale per token and per layer.

Why per token and per layer: a few tokens (the first of each sample) carry activations orders of magnitude
above the rest, and the layers differ in scale too; one scale per tensor would flush most tokens to FP8's
subnormals. Each (token, layer) block is scaled so that its largest magnitude lands on FP8's largest value
(448), so every block uses the format's full range; stored is `x / scale` rounded to e4m3 (3 mantissa bits: a
relative rounding error of at most 2^-4 per value) and `scale`; dequantized = `q.float().view(T, n, -1) *
scales[..., None]`.

This is also hs-connectors' FP8 recipe (`scale = amax / finfo(float8_e4m3fn).max` per token), so the
speculators export can keep the bytes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALES_SUFFIX = "_scales"
STATE_TENSORS = ("aux_hidden_states", "last_hidden_state")
# What FP8 shards say about their scales (metadata key `scales`).
FP8_SCALES = "<name>_scales float32 [T, n], per token and layer: x.float().view(T, n, -1) * scales[..., None]"


@dataclass(frozen=True)
class QuantizedStates:
    """A sample's states as a server's connector wrote them in FP8: values [t, n, H] float8, scales [t, n]
    float32, and the dtype the server computed in."""

    values: Any
    scales: Any
    source_dtype: str

    @property
    def shape(self) -> Any:
        return self.values.shape

    def dequantized(self) -> Any:
        """[t, n, H] float32."""
        return self.values.float() * self.scales.float()[..., None]


def is_fp8(storage_dtype: str) -> bool:
    return storage_dtype == FP8


def scales_name(tensor: str) -> str:
    return tensor + SCALES_SUFFIX


def quantize(x: Any, n_blocks: int = 1) -> tuple[Any, Any]:
    """[T, n·H] states (any float dtype, any device) -> (float8_e4m3fn [T, n·H], float32 scales [T, n]), on
    x's device. A block of zeros gets scale 1 (it dequantizes to zeros; a stored zero scale is always a
    fault)."""
    import torch

    t = x.shape[0]
    blocks = x.float().reshape(t, n_blocks, -1)
    amax = blocks.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scales[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scales.contiguous()


def dequantize(q: Any, scales: Any, dtype: Any = None) -> Any:
    """The contract's reading: `q.float().view(T, n, -1) * scales[..., None]`, back to [T, n·H] (float32, or
    `dtype`)."""
    t, n = scales.shape[0], scales.shape[-1]
    out = (q.float().reshape(t, n, -1) * scales.float()[..., None]).reshape(q.shape)
    return out if dtype is None else out.to(dtype)


def quantize_layers(layers: list[Any]) -> tuple[Any, Any]:
    """One forward's captured layers ([T, H] each, on the model's device) -> (float8 [T, n·H], scales [T, n])
    on the host: quantized where they were computed, so only a byte per value crosses to the host."""
    import torch

    parts = [quantize(x) for x in layers]
    q = torch.cat([p[0] for p in parts], dim=-1)
    scales = torch.cat([p[1] for p in parts], dim=-1)
    return q.to("cpu"), scales.to("cpu")


def scale_problems(scales: Any) -> int:
    """How many stored scales no quantization writes: zero, negative, NaN or infinite."""
    import torch

    s = scales.float()
    return int((~torch.isfinite(s) | (s <= 0)).sum())


def payload_bytes_per_token(hidden_size: int, n_blocks: int, storage_dtype: str, dtype_bytes: int) -> int:
    """Bytes one token's states of `n_blocks` layers take in a shard: the values, plus a float32 scale per
    layer in FP8."""
    if is_fp8(storage_dtype):
        return n_blocks * (hidden_size + 4)
    return n_blocks * hidden_size * dtype_bytes
