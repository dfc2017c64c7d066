"""The target's final norm beside the shards: the stored last states are before it, and exports for frameworks
that want post-norm states apply it without loading the model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..storage.files import atomic_write
from ..storage.layout import FINAL_NORM
from ..target_model.pieces import local_checkpoint
from .capture import _base_model


def save_final_norm(model: Any, folder: Path) -> None:
    """The final norm's weights, so exports for frameworks that want post-norm last states need no model."""
    from safetensors.torch import save_file

    norm = getattr(_base_model(model), "norm", None)
    if norm is None or not hasattr(norm, "weight"):
        return
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    weight = norm.weight.detach().to("cpu").float().contiguous()
    path = folder / FINAL_NORM
    atomic_write(
        path,
        lambda tmp: save_file(
            {"weight": weight}, str(tmp), metadata={"kind": type(norm).__name__, "eps": str(eps)}
        ),
    )


def save_final_norm_from_checkpoint(model_ref: str, folder: Path, revision: str | None = None) -> bool:
    """The final norm read from the target's checkpoint files, without loading the model (a served target may
    be far larger than this process); False when no local copy of the checkpoint is found."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    root = local_checkpoint(model_ref, revision)
    if root is None:
        return False
    config = json.loads((root / "config.json").read_text()) if (root / "config.json").exists() else {}
    text = config.get("text_config") or config
    eps = float(text.get("rms_norm_eps", text.get("layer_norm_eps", 1e-6)))
    kind = "RMSNorm" if "rms_norm_eps" in text else "LayerNorm"
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").exists():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            names = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        return False
    # The decoder's final norm: `model.norm.weight`, under a wrapper's prefix for multimodal targets
    # (`language_model.model.norm.weight`); never a layer's own norm.
    keys = sorted((k for k in names if re.search(r"(^|\.)model\.norm\.weight$", k)), key=len)
    if not keys or not (root / names[keys[0]]).exists():
        return False
    with safe_open(str(root / names[keys[0]]), framework="pt") as f:
        weight = f.get_tensor(keys[0]).float().contiguous()
    atomic_write(
        folder / FINAL_NORM,
        lambda tmp: save_file({"weight": weight}, str(tmp), metadata={"kind": kind, "eps": str(eps)}),
    )
    return True


def load_final_norm(folder: Path) -> Callable[[Any], Any]:
    """The final norm saved beside the shards, as a function over last states (post-norm exports apply it)."""
    from safetensors import safe_open

    path = folder / FINAL_NORM
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; re-materialise hidden_states (it is written with the shards)"
        )
    with safe_open(str(path), framework="pt") as f:
        weight = f.get_tensor("weight")
        meta = f.metadata() or {}
    eps = float(meta.get("eps", 1e-6))
    if "rms" not in meta.get("kind", "RMSNorm").lower():
        raise ValueError(
            f"final norm {meta.get('kind')} is not an RMSNorm; post-norm export is not supported"
        )

    def rms_norm(x: Any) -> Any:
        import torch

        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * h).to(x.dtype)

    return rms_norm
