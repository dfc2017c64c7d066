"""SpecForge: `rows_{k}-{k+2000}/data_{i}.ckpt`, a `torch.save` dict with `input_ids` [S] int64, `loss_mask`
[S] int64, `hidden_state` [1, S, H] *after* the final norm (its target head is the LM head alone) and
`aux_hidden_state` [1, S, 3H]; `vocab_mapping/vocab_mapping.pt` (`d2t`, `t2d` for `draft_vocab_size`
tokens, where SpecForge's own preparation writes them), the matching draft `draft_config.json`, and
`specforge_train.yaml`, a run config for `specforge train --config`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..final_norm import load_final_norm
from .base import ExportFormat, ExportJob, ExportSample, write_json

SPECFORGE_GROUP = 2000  # samples per rows_* folder, as SpecForge's preparation groups them
SPECFORGE_RUN = "specforge_train.yaml"


class SpecForge(ExportFormat):
    name = "specforge"
    consumer_max_len = 2048
    layer_convention = "outputs of decoder layers, 0-based (SGLang captures the input of layer id + 1)"

    def write(self, samples: Iterator[ExportSample], job: ExportJob) -> dict[str, Any]:
        import torch

        norm = load_final_norm(job.folder)
        for s in samples:
            group = s.index // SPECFORGE_GROUP * SPECFORGE_GROUP
            path = job.work / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{s.index}.ckpt"
            path.parent.mkdir(parents=True, exist_ok=True)
            t = s.tensors
            torch.save(
                {
                    "input_ids": t["input_ids"],
                    "loss_mask": t["loss_mask"],
                    "hidden_state": norm(t["last_hidden_state"]).unsqueeze(0).contiguous(),
                    "aux_hidden_state": t["aux_hidden_states"].unsqueeze(0).contiguous(),
                },
                path,
            )
        return self.side_files(job)

    def side_files(self, job: ExportJob) -> dict[str, Any]:
        """The vocabulary maps where SpecForge's preparation writes them, a draft config of the same
        vocabulary for this target, and a run config that trains from this folder."""
        import torch

        from ..draft_format import DraftShape, build_draft_vocab, draft_config, vocab_mapping

        work, target = job.work, job.target
        shape = DraftShape.from_target(target.config, job.draft_vocab_size)
        chosen = build_draft_vocab(job.freq, shape.vocab_size, shape.draft_vocab_size, fill=True)
        d2t, t2d = vocab_mapping(chosen, shape.vocab_size)
        (work / "vocab_mapping").mkdir()
        torch.save({"d2t": d2t, "t2d": t2d}, work / "vocab_mapping" / "vocab_mapping.pt")
        aux = self.layer_ids(job.source.aux_layers)
        write_json(draft_config(shape, aux, "bfloat16"), work / "draft_config.json")
        _write_run_config(job, aux)
        return {
            "vocab_mapping": "vocab_mapping/vocab_mapping.pt",
            "draft_config": "draft_config.json",
            "run_config": SPECFORGE_RUN,
            "draft_vocab_size": shape.draft_vocab_size,
            "target_weight_index": target.weight_index,
        }

    def train_command(self, job: ExportJob, limit: int) -> str:
        return f"specforge train --config {job.out / SPECFORGE_RUN}"


def _write_run_config(job: ExportJob, aux: list[int]) -> None:
    """`specforge_train.yaml`: SpecForge's offline EAGLE-3 training from this export, as it lies at `out`."""
    import yaml

    out, target = job.out, job.target
    run = {
        "model": {
            "target_model_path": target.path,
            "draft_model_config": str(out / "draft_config.json"),
            "vocab_mapping_path": str(out / "vocab_mapping" / "vocab_mapping.pt"),
            "lm_head_key": target.lm_head_key,
            "embedding_key": target.embedding_key,
            "aux_hidden_state_layer_ids": aux,
            "torch_dtype": "bfloat16",
        },
        "data": {
            "hidden_states_path": str(out),
            "max_length": max(SpecForge.consumer_max_len, job.counts.longest),
        },
        "training": {
            "strategy": "eagle3",
            "num_epochs": 10,
            "batch_size": 1,
            "learning_rate": 1e-4,
            "max_grad_norm": 0.5,
            "ttt_length": 7,
            "seed": 0,
        },
        "run_id": f"eagle3-{out.name}",
        "output_dir": str(out.parent / f"{out.name}-specforge-run"),
    }
    (job.work / SPECFORGE_RUN).write_text(
        "# SpecForge 0.2.0 offline EAGLE-3 training from this export: specforge train --config <this file>\n"
        "# (SpecForge's target head reads the target through a *.safetensors.index.json in its folder)\n"
        + yaml.safe_dump(run, sort_keys=False)
    )
