"""Pieces of the target's checkpoint, read from its safetensors files by tensor name: what the steps after
generation need of a target that never fits this process (the embedding the draft shares, the head, the first
few decoder layers for the hidden-states spot check). Nothing here loads the whole model.

Tensors are read one by one through `safe_open` (memory-mapped): the process holds only what it asked for.
Names are found under a wrapper's prefix too (`language_model.model.embed_tokens.weight` in a multimodal
checkpoint).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any


class CheckpointError(RuntimeError):
    """The checkpoint is not on this machine, or lacks a tensor the step needs; the message names the fix."""


INDEX = "model.safetensors.index.json"


class CheckpointPieces:
    """A local safetensors checkpoint (folder with config.json and *.safetensors), read a tensor at a time."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not (self.root / "config.json").exists():
            raise CheckpointError(f"{self.root}: no config.json (not a model checkpoint folder)")

    @classmethod
    def find(cls, model_ref: str, revision: str | None = None) -> CheckpointPieces:
        """The checkpoint of a local folder or of the hub cache (never downloading: a 1T checkpoint is fetched
        by whoever provisions the machine, `huggingface-cli download`, not by a step)."""
        root = local_checkpoint(model_ref, revision)
        if root is None:
            raise CheckpointError(
                f"no local copy of {model_ref!r} (revision {revision or 'default'}) on this machine: the "
                "step reads the embedding and the head from its safetensors files. Download it first "
                "(`huggingface-cli download <repo> --revision <rev>`) or point target.model at the folder"
            )
        return cls(root)

    @cached_property
    def config(self) -> dict[str, Any]:
        return json.loads((self.root / "config.json").read_text())

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config.get("text_config") or self.config

    @cached_property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name, from the index of a sharded checkpoint or the one file's header."""
        index = self.root / INDEX
        if index.exists():
            return dict(json.loads(index.read_text())["weight_map"])
        files = sorted(self.root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.root}: no safetensors files (only safetensors checkpoints are read)"
            )
        from safetensors import safe_open

        out: dict[str, str] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                out.update(dict.fromkeys(h.keys(), f.name))
        return out

    def find_name(self, suffix: str) -> str | None:
        """The tensor whose name is `suffix` or ends with `.<suffix>` (the shortest: a wrapper's own copy is
        never preferred to the decoder's)."""
        pattern = re.compile(rf"(^|\.){re.escape(suffix)}$")
        hits = sorted((n for n in self.weight_map if pattern.search(n)), key=len)
        return hits[0] if hits else None

    def tensors(self, names: Iterable[str]) -> dict[str, Any]:
        """The named tensors, each read alone from its file."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for n in names:
            if n not in self.weight_map:
                raise CheckpointError(f"{self.root}: no tensor {n!r} in the checkpoint")
            by_file.setdefault(self.weight_map[n], []).append(n)
        out = {}
        for file, wanted in by_file.items():
            with safe_open(str(self.root / file), framework="pt") as h:
                for n in wanted:
                    out[n] = h.get_tensor(n)
        return out

    def tensor(self, suffix: str) -> Any:
        name = self.find_name(suffix)
        if name is None:
            raise CheckpointError(f"{self.root}: no tensor named like {suffix!r} in the checkpoint")
        return self.tensors([name])[name]

    def embedding(self) -> Any:
        """The input embedding [vocab, H] (the draft shares it, frozen)."""
        return self.tensor("embed_tokens.weight")

    def head(self) -> Any:
        """The output head [vocab, H]: `lm_head.weight`, or the embedding where the two are tied."""
        name = self.find_name("lm_head.weight")
        if name is not None:
            return self.tensors([name])[name]
        if self.config.get("tie_word_embeddings", self.text_config.get("tie_word_embeddings", False)):
            return self.embedding()
        raise CheckpointError(f"{self.root}: no lm_head.weight and the embeddings are not tied")

    def layer_names(self, layers: Iterable[int]) -> list[str]:
        """Every tensor of the given decoder layers (`...layers.<i>.`)."""
        wanted = set(layers)
        out = []
        for n in self.weight_map:
            m = re.search(r"(^|\.)layers\.(\d+)\.", n)
            if m and int(m.group(2)) in wanted:
                out.append(n)
        return out

    def first_layers_model(self, n_layers: int, trust_remote_code: bool = False) -> Any:
        """The target cut after its first `n_layers` decoder layers (embedding, those layers, final norm,
        head), loaded from those tensors only: a forward of it gives `output_hidden_states[0..n_layers - 1]`
        exactly as the whole model would (entry n_layers is after the final norm, as for any model's last
        entry)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(self.root), trust_remote_code=trust_remote_code)
        text = config.get_text_config()
        total = int(text.num_hidden_layers)
        if not 0 < n_layers <= total:
            raise ValueError(f"{n_layers} layers asked of a {total}-layer model")
        text.num_hidden_layers = n_layers
        for key in ("layer_types", "mlp_only_layers"):  # per-layer lists some configs carry
            value = getattr(text, key, None)
            if isinstance(value, list) and len(value) == total:
                setattr(text, key, value[:n_layers])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        names = self.layer_names(range(n_layers))
        for suffix in ("embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            name = self.find_name(suffix)
            if name is not None:
                names.append(name)
        state = self.tensors(names)
        own = set(model.state_dict())  # tied weights listed under both names
        renamed = {name: v for k, v in state.items() if (name := _match_param(k, own)) is not None}
        if "lm_head.weight" in own and "lm_head.weight" not in renamed:
            emb = next((v for k, v in renamed.items() if k.endswith("embed_tokens.weight")), None)
            if emb is not None:
                renamed["lm_head.weight"] = emb
        model.load_state_dict(renamed, strict=False, assign=True)
        missing = [k for k, p in model.named_parameters() if p.is_meta]
        if missing:
            raise CheckpointError(
                f"{self.root}: the first {n_layers} layers lack tensors the model needs: {missing[:5]}"
            )
        if any(b.is_meta for b in model.buffers()):  # rotary tables etc., recomputed off the meta device
            _rebuild_buffers(model)
        return model.float().eval()


def local_checkpoint(model_ref: str, revision: str | None) -> Path | None:
    """The checkpoint folder on this machine (a local folder, or the hub cache), never downloading."""
    if Path(model_ref).is_dir():
        return Path(model_ref)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_ref, revision=revision, local_files_only=True))
    except Exception:
        return None


def _match_param(name: str, own: set[str]) -> str | None:
    """A checkpoint tensor name as the cut model names it (a wrapper's prefix dropped where needed)."""
    if name in own:
        return name
    parts = name.split(".")
    for i in range(1, len(parts)):
        candidate = ".".join(parts[i:])
        if candidate in own:
            return candidate
        if f"model.{candidate}" in own:
            return f"model.{candidate}"
    return None


def _rebuild_buffers(model: Any) -> None:
    """Non-persistent buffers (rotary inverse frequencies) left on the meta device: their modules are built
    again on the CPU from the config (they hold no weights)."""
    import torch

    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not any(b.is_meta for b in child.buffers(recurse=False)):
                continue
            if any(True for _ in child.parameters(recurse=False)) or not hasattr(child, "config"):
                raise CheckpointError(f"cannot rebuild {type(child).__name__} off the meta device")
            with torch.device("cpu"):
                setattr(parent, child_name, type(child)(config=child.config))
