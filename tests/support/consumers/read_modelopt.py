"""Run inside the Model-Optimizer environment: its own offline EAGLE-3 path over an export, on CPU.

    python read_modelopt.py EXPORT TARGET --aux 1 14 26 --steps 3

As its example's `main.py` does in offline mode, with what the wheel ships: the built-in
`general/speculative_decoding/eagle3` recipe (with the overrides the export's manifest gives:
`training.answer_only_loss=true`, so the export's loss mask is used, and the aux layer ids), the target loaded
with `load_vlm_or_llm(use_offline_training=True)`, `mtsp.convert` to an EAGLE-3 model, the offline dataset
over every `*.pt` under the folder (the example's own discovery: `rglob("*.pt")`) and its collator; then a few
AdamW steps under bf16 autocast where the CPU has bf16 arithmetic (the recipe trains with `bf16: true`, which
the HF Trainer runs as autocast), in fp32 elsewhere (`driver.training_precision`). Prints one JSON line; never
imports the project.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from driver import offline, report, training_precision

offline()  # the frameworks, imported in main(), read these settings at import


def main() -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("export")
    p.add_argument("target")
    p.add_argument("--aux", type=int, nargs="+", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--train-len", type=int, default=512)
    a = p.parse_args()

    import modelopt.torch.speculative as mtsp
    import torch
    import transformers
    from modelopt.recipe import load_recipe
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    torch.manual_seed(0)
    out: dict = {}
    recipe = load_recipe(
        "general/speculative_decoding/eagle3",
        overrides=[
            f"model.model_name_or_path={a.target}",
            f"data.offline_data_path={a.export}",
            f"training.output_dir={tempfile.mkdtemp(prefix='read-modelopt-')}",
            f"training.training_seq_len={a.train_len}",
            "training.answer_only_loss=true",
            "eagle.eagle_use_torch_compile=false",
            "eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids=["
            + ",".join(map(str, a.aux))
            + "]",
        ],
    )
    out["offline"] = recipe.data.mode == "offline" and bool(recipe.eagle.eagle_offline)
    model = load_vlm_or_llm(
        a.target, use_fake_base=recipe.model.use_fake_base_for_offline, use_offline_training=True,
        dtype="auto", device_map="cpu",
    )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(a.target, model_max_length=a.train_len)
    mtsp.convert(model, [("eagle", recipe.eagle.model_dump())])
    out["aux_layer_ids"] = list(model.eagle_config.eagle_aux_hidden_state_layer_ids)
    hidden = int(model.eagle_config.hidden_size)

    files = [str(f) for f in Path(a.export).rglob("*.pt")]
    dataset = OfflineSupervisedDataset(
        files, answer_only_loss=recipe.training.answer_only_loss, tokenizer=tokenizer
    )
    collator = EagleOfflineDataCollator(train_len=a.train_len)
    head = model._base_model_lm_head
    bad, hits, total, lengths = [], 0, 0, []
    for i in range(len(dataset)):
        s = dataset[i]
        n = s["input_ids"].shape[0]
        lengths.append(int(n))
        shapes_ok = (
            s["input_ids"].dtype == torch.long
            and tuple(s["base_model_hidden_states"].shape) == (n, hidden)
            and tuple(s["aux_hidden_states"].shape) == (n, hidden * len(a.aux))
            and tuple(s["loss_mask"].shape) == (n,)
        )
        if not shapes_ok:
            bad.append(i)
        with torch.no_grad():  # the stored last state is post-norm: the LM head alone predicts the next token
            pred = head(s["base_model_hidden_states"][:-1].to(head.weight.dtype)).argmax(-1)
        answer = s["loss_mask"][1:].bool()
        hits += int((pred == s["input_ids"][1:])[answer].sum())
        total += int(answer.sum())
    out["n_samples"] = len(dataset)
    out["bad_samples"] = bad
    out["longest"] = max(lengths, default=0)
    out["lm_head_top1"] = hits / max(total, 1)
    batches = [
        collator([dataset[j] for j in range(i, min(i + 2, len(dataset)))]) for i in range(0, len(dataset), 2)
    ]

    model.train()
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    out["train_dtype"], autocast, cast = training_precision()
    losses = []
    for step in range(a.steps):
        with autocast():
            loss = model(**cast(batches[step % len(batches)])).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    out["losses"] = losses
    out["losses_finite"] = bool(losses) and all(math.isfinite(x) for x in losses)
    return out


if __name__ == "__main__":
    report(main)
