"""Model-Optimizer: `{i}-{id}.pt` with `input_ids` [S], `hidden_states` [S, H] after the final norm,
`aux_hidden_states` [S, 3H], `loss_mask` [S], `conversation_id`. It reads every `*.pt` under the folder as a
sample, so nothing else in this export ends in `.pt`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..final_norm import load_final_norm
from .base import ExportFormat, ExportJob, ExportSample


class ModelOpt(ExportFormat):
    name = "modelopt"
    consumer_max_len = 2048
    layer_convention = "outputs of decoder layers, 0-based (forward hooks)"

    def write(self, samples: Iterator[ExportSample], job: ExportJob) -> dict[str, Any]:
        norm = load_final_norm(job.folder)
        import torch

        for s in samples:
            # The index keeps names unique where ids differ only in characters a file name cannot hold.
            safe = f"{s.index:07d}-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in s.id)[:100]
            t = s.tensors
            torch.save(
                {
                    "input_ids": t["input_ids"],
                    "hidden_states": norm(t["last_hidden_state"]).contiguous(),
                    "aux_hidden_states": t["aux_hidden_states"].contiguous(),
                    "loss_mask": t["loss_mask"],
                    "conversation_id": s.id,
                },
                job.work / f"{safe}.pt",
            )
        return {}

    def train_command(self, job: ExportJob, limit: int) -> str:
        ids = self.layer_ids(job.source.aux_layers)
        return (
            "./launch_train.sh --config ../../modelopt_recipes/general/speculative_decoding/eagle3.yaml "
            f"model.model_name_or_path={job.target.path} data.offline_data_path={job.out} "
            f"training.output_dir=./checkpoints training.training_seq_len={limit} "
            "training.answer_only_loss=true "
            "'eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids="
            f"[{','.join(map(str, ids))}]'  "
            "# in examples/speculative_decoding of a Model-Optimizer checkout"
        )
