"""Run inside the speculators environment: speculators 0.9.0's own training path over an export, on CPU.

    python read_speculators.py EXPORT TARGET --steps 3 --total-seq-len 1024 --draft-vocab-size 256

As `speculators train` (speculators/train/cli.py) does it: its flag parser, `parse_vocab_mappings`
(token_freq.pt -> d2t/t2d, what --draft-vocab-size does), `build_draft_model` from the local verifier folder,
the file hidden-states backend and `create_train_val_loaders` (ArrowDataset, packing sampler, collate,
`shift_batch`). Every sample also goes through `check_hidden_states` and `ArrowDataset.__getitem__`, and
token_freq.pt is compared with speculators' own recount. Then a few optimizer steps of its Eagle3 draft with
the eager loss: its `Trainer` moves the model to an accelerator in `__init__`, so the steps run the body of
its training loop with its own optimizers. Prints one JSON line; never imports the project.
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
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--total-seq-len", type=int, default=1024)
    p.add_argument("--draft-vocab-size", type=int, default=256)
    p.add_argument("--target-layer-ids", type=int, nargs="+", required=True)
    p.add_argument("--hidden-states-backend", default="file")  # fp8: hs-connectors' FP8Transfer
    a = p.parse_args()

    import datasets
    import torch
    from hs_connectors import HiddenStatesBackend
    from safetensors import safe_open
    from speculators.data_generation.offline import check_hidden_states
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import cli
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset, SampleUnavailable
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.trainer import Trainer, TrainerConfig
    from speculators.train.vocab_mapping import save_token_frequency_distribution
    from speculators.utils.loading import load_model_layers

    torch.manual_seed(0)
    out: dict = {}
    work = Path(tempfile.mkdtemp(prefix="read-speculators-"))
    argv = [
        "--speculator-type", "eagle3", "--verifier-name-or-path", a.target, "--data-path", a.export,
        "--target-layer-ids", *map(str, a.target_layer_ids), "--loss-implementation", "eager",
        "--draft-attn-impl", "sdpa",  # flex attention has no backward on CPU
        "--num-workers", "0", "--max-steps", str(max(a.steps, 1)), "--total-seq-len", str(a.total_seq_len),
        "--draft-vocab-size", str(a.draft_vocab_size), "--on-missing", "raise",
        "--hidden-states-backend", a.hidden_states_backend,
        "--save-path", str(work / "ckpt"), "--log-dir", str(work / "logs"),
    ]  # fmt: skip
    args = argparse.Namespace(**TrainConfig.resolve(argv).flatten())
    cli.set_seed(args.seed, args.deterministic_cuda)

    raw = datasets.load_from_disk(a.export)
    out["format_type"] = raw.format["type"]
    out["n_samples"] = n = len(raw)
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    out["transfer"] = type(transfer).__name__
    with safe_open(str(Path(a.export) / "hidden_states" / "hs_0.safetensors"), "pt") as f:
        out["stored"] = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    every = ArrowDataset(
        max_len=args.total_seq_len, datapath=a.export, transfer=transfer, on_missing="raise",
        train_ratio=1.0, split="train", hidden_states_dtype=torch.bfloat16, model=a.target,
    )  # fmt: skip
    failures: list[str] = []
    read_as: set[str] = set()
    abs_sums: list[float] = []  # what the backend hands the trainer, per sample, for the test to compare
    for i in range(n):
        try:
            hs = transfer.get_cached(i)
            check_hidden_states(hs, [int(x) for x in raw[i]["input_ids"]])
            read_as.add(str(hs["hidden_states"].dtype))
            abs_sums.append(float(hs["hidden_states"].double().abs().sum()))
            if isinstance(every[i], SampleUnavailable):
                failures.append(f"{i}: ArrowDataset says the sample is unavailable")
        except Exception as e:  # one line per sample that speculators refuses
            failures.append(f"{i}: {type(e).__name__}: {str(e)[:300]}")
    out["sample_failures"] = failures
    out["read_as"] = sorted(read_as)
    out["hidden_states_abs_sums"] = abs_sums
    if failures:  # speculators would stop here: nothing below can train on these samples
        return out

    recount = work / "token_freq.pt"
    save_token_frequency_distribution(raw, recount)
    ours = torch.load(Path(a.export) / "token_freq.pt", weights_only=True)
    out["token_freq_entries"] = len(ours)
    out["token_freq_equals_recount"] = ours == torch.load(recount, weights_only=True)

    cached = [Path(a.export) / f"{k}-{a.draft_vocab_size}.npy" for k in ("d2t", "t2d")]
    before = [c.exists() for c in cached]
    d2t, t2d, draft_vocab = cli.parse_vocab_mappings(args)
    for c, existed in zip(cached, before, strict=True):  # speculators caches the maps in the data folder
        if not existed:
            c.unlink(missing_ok=True)
    out["draft_vocab_size"] = draft_vocab
    out["d2t_from_token_freq"] = d2t is not None and int(t2d.sum()) == draft_vocab

    model_class = SpeculatorModel.registry[args.speculator_type]
    model = cli.build_draft_model(args, model_class, t2d, d2t, draft_vocab)
    layer = model.config.transformer_layer_config
    out["target_layer_ids"] = list(model.target_layer_ids)
    out["verifier_vocab"] = int(layer.vocab_size)

    # The exported last state, through the verifier's final norm and head, predicts the next answer token.
    w = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], a.target)
    head = w.get("lm_head.weight", w["embed_tokens.weight"]).float()
    norm = w["model.norm.weight"].float()
    hits = total = 0
    for i in range(n):
        hs = transfer.get_cached(i)
        last = hs["hidden_states"][:, -1].float()
        x = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + layer.rms_norm_eps) * norm
        pred = (x @ head.T).argmax(-1)
        answer = torch.as_tensor(raw[i]["loss_mask"])[1:].bool()
        hits += int((pred[:-1] == hs["token_ids"][1:])[answer].sum())
        total += int(answer.sum())
    out["target_head_top1"] = hits / max(total, 1)

    train_loader, val_loader = create_train_val_loaders(
        data_path=args.data_path, total_seq_len=args.total_seq_len, hidden_states_dtype=torch.bfloat16,
        transfer=transfer, vllm_endpoint=args.vllm_endpoint, on_missing=args.on_missing,
        verifier_name_or_path=args.verifier_name_or_path, request_timeout=args.request_timeout,
        max_retries=args.max_retries, generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
        hidden_size=layer.hidden_size, num_target_layers=len(model.target_layer_ids),
        num_workers=0, prefetch_factor=args.prefetch_factor, preprocess=shift_batch,
        train_data_ratio=args.train_data_ratio, seed=args.seed,
    )  # fmt: skip
    seen = errors = 0
    for loader in (train_loader, val_loader):
        for batch in loader:
            errors += int(batch["error_records"])
            docs = batch["document_ids"]
            seen += int(docs.max()) + 1 if bool((docs >= 0).any()) else 0
    out["loader_samples"] = seen
    out["loader_errors"] = errors

    losses: list[float] = []
    if a.steps:
        train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
        trainer = Trainer.__new__(Trainer)  # its __init__ moves the model to an accelerator
        trainer.model, trainer.train_loader, trainer.resume_from_checkpoint = model, train_loader, False
        trainer.config = TrainerConfig(
            num_epochs=args.epochs, save_path=args.save_path, lr=args.lr, resume_from_checkpoint=False,
            train_call_kwargs=train_kwargs, optimizer=args.optimizer, weight_decay=args.weight_decay,
            muon_lr=args.muon_lr, muon_momentum=args.muon_momentum, muon_weight_decay=args.muon_weight_decay,
            muon_ns_steps=args.muon_ns_steps, muon_adjust_lr_fn=args.muon_adjust_lr_fn,
            scheduler_type=args.scheduler_type, scheduler_warmup_steps=args.scheduler_warmup_steps,
            scheduler_warmup_ratio=args.scheduler_warmup_ratio,
            scheduler_total_steps=args.scheduler_total_steps,
            scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles,
            hidden_states_dtype=torch.bfloat16, max_steps=args.max_steps,
        )  # fmt: skip
        trainer.setup_optimizer()
        model.train()
        out["train_dtype"], autocast, cast = training_precision()
        epoch = 0
        while len(losses) < a.steps:
            train_loader.batch_sampler.set_epoch(epoch)
            for batch in train_loader:
                with autocast():
                    _, loss, _ = model(**cast(batch), **train_kwargs)
                trainer._optimizers_zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                trainer._optimizers_step()
                trainer._schedulers_step()
                losses.append(float(loss.detach()))
                if len(losses) == a.steps:
                    break
            epoch += 1
    out["losses"] = losses
    out["losses_finite"] = all(math.isfinite(x) for x in losses)
    return out


if __name__ == "__main__":
    report(main)
