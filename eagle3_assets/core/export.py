"""Export packed hidden-state shards to the per-sample layouts the training frameworks read.

- speculators (vllm-project/speculators, current format): an HF Arrow dataset (`load_from_disk`) with `input_ids`,
  `loss_mask`, `seq_len`, plus `hidden_states/hs_{i}.safetensors` holding `hidden_states` [S, 4, H] (the three aux
  layers, then the last layer before the final norm, in the model's dtype) and `token_ids` [S] int64.
- SpecForge (sgl-project/SpecForge offline training): `rows_{k}-{k+2000}/data_{i}.ckpt`, a `torch.save` dict with
  `input_ids` [S] int64, `loss_mask` [S] int64, `hidden_state` [1, S, H] *after* the final norm (its target head is
  the LM head alone) and `aux_hidden_state` [1, S, 3H].
- Model-Optimizer (NVIDIA, offline EAGLE-3): `{conversation_id}.pt` with `input_ids` [S], `hidden_states` [S, H] after
  the final norm, `aux_hidden_states` [S, 3H], `loss_mask` [S], `conversation_id`.

The post-norm states are computed here from the final norm's weights, saved beside the shards at extraction time.

Layer ids: `hidden_states.aux_layers` counts outputs of decoder layers, 0-based ([1, L//2-1, L-4] by default).
SpecForge (through SGLang, which captures the input of layer id + 1) and Model-Optimizer (forward hooks on layer
outputs) use that same convention; vLLM and speculators count `output_hidden_states` indices (index j is the output of
layer j - 1, 0 the embeddings), so their ids are ours + 1. Each export writes `eagle3_config.json` with
`eagle_aux_hidden_state_layer_ids` in its framework's own convention, so nobody has to guess.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .hidden_states import HiddenStatesReader

FORMATS = ("speculators", "specforge", "modelopt")
SPECFORGE_GROUP = 2000


def _final_norm(folder: Path) -> Callable[[Any], Any]:
    from safetensors import safe_open

    path = folder / "final_norm.safetensors"
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


def export(folder: Path, out: Path, fmt: str, log: Callable[[str], None] = print) -> int:
    """Write every sample of a dataset's hidden_states folder to `out` in `fmt`; returns the sample count."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    reader = HiddenStatesReader(folder)
    out.mkdir(parents=True, exist_ok=True)
    n = {"speculators": _speculators, "specforge": _specforge, "modelopt": _modelopt}[fmt](
        reader, folder, out
    )
    (out / "eagle3_config.json").write_text(json.dumps(layer_config(folder, fmt), indent=2) + "\n")
    log(f"exported {n} samples from {folder} to {out} ({fmt})")
    return n


def layer_config(folder: Path, fmt: str) -> dict[str, Any]:
    """The aux layer ids in the key and the convention `fmt` reads them in."""
    from .hidden_states import finished_shards

    metas = list(finished_shards(folder).values())
    if not metas:
        raise FileNotFoundError(f"no hidden-state shards in {folder}")
    aux = json.loads(metas[0]["aux_layers"])
    num_layers = int(metas[0]["num_layers"])
    if fmt == "speculators":
        ids = [i + 1 for i in aux]
        convention = (
            "output_hidden_states indices (id j = output of decoder layer j - 1; 0 = embeddings), as vLLM"
        )
    else:
        ids = list(aux)
        convention = "outputs of decoder layers, 0-based" + (
            " (SGLang captures the input of layer id + 1)" if fmt == "specforge" else " (forward hooks)"
        )
    last = "before the final norm" if fmt == "speculators" else "after the final norm"
    return {
        "format": fmt,
        "eagle_aux_hidden_state_layer_ids": ids,
        "layer_convention": convention,
        "num_hidden_layers": num_layers,
        "last_hidden_state": f"output of decoder layer {num_layers - 1}, {last}",
        "model": metas[0].get("model"),
        "revision": metas[0].get("revision") or None,
    }


def _speculators(reader: HiddenStatesReader, folder: Path, out: Path) -> int:
    import datasets
    import torch
    from safetensors.torch import save_file

    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": [], "id": []}
    for i, sid in enumerate(reader.ids()):  # one sample in memory at a time
        s = reader.sample(sid)
        aux, last = s["aux_hidden_states"], s["last_hidden_state"]
        t, h = last.shape
        stacked = torch.cat([aux.view(t, 3, h), last.view(t, 1, h)], dim=1).contiguous()
        save_file(
            {"hidden_states": stacked, "token_ids": s["input_ids"].long()},
            str(hs_dir / f"hs_{i}.safetensors"),
        )
        rows["input_ids"].append(s["input_ids"].long().tolist())
        rows["loss_mask"].append(s["loss_mask"].long().tolist())
        rows["seq_len"].append(int(t))
        rows["id"].append(sid)
    # The Arrow dataset goes beside hidden_states/ (save_to_disk writes its own files, it does not clear the folder).
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(rows).save_to_disk(str(out))
    (out / "eagle3_assets_export.json").write_text(
        json.dumps({"format": "speculators", "source": str(folder), "samples": len(rows["id"])})
    )
    return len(rows["id"])


def _specforge(reader: HiddenStatesReader, folder: Path, out: Path) -> int:
    import torch

    norm = _final_norm(folder)
    for i, sid in enumerate(reader.ids()):
        s = reader.sample(sid)
        group = i // SPECFORGE_GROUP * SPECFORGE_GROUP
        path = out / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{i}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "input_ids": s["input_ids"].long(),
                "loss_mask": s["loss_mask"].long(),
                "hidden_state": norm(s["last_hidden_state"]).unsqueeze(0).contiguous(),
                "aux_hidden_state": s["aux_hidden_states"].unsqueeze(0).contiguous(),
            },
            path,
        )
    return len(reader)


def _modelopt(reader: HiddenStatesReader, folder: Path, out: Path) -> int:
    import torch

    norm = _final_norm(folder)
    for i, sid in enumerate(reader.ids()):
        s = reader.sample(sid)
        # The index keeps names unique where ids differ only in characters a file name cannot hold.
        safe = f"{i:07d}-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in sid)[:100]
        torch.save(
            {
                "input_ids": s["input_ids"].long(),
                "hidden_states": norm(s["last_hidden_state"]).contiguous(),
                "aux_hidden_states": s["aux_hidden_states"].contiguous(),
                "loss_mask": s["loss_mask"].long(),
                "conversation_id": sid,
            },
            out / f"{safe}.pt",
        )
    return len(reader)
