"""What the three drivers share (each runs as a script in its framework's environment, this folder on its
path): offline settings set before the framework is imported, and one JSON line out, whatever happens."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # SpecForge and Model-Optimizer compile regions with torch.compile: minutes of autotuning on a CPU.
    "TORCHDYNAMO_DISABLE": "1",
}


def offline() -> None:
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)


def bf16_native() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): elsewhere torch's bf16 GEMM is a scalar
    fallback loop, and one Model-Optimizer training step under bf16 autocast ran for over 30 minutes on an
    AVX2 CPU."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def training_precision() -> tuple[str, Callable[[], Any], Callable[[Any], Any]]:
    """(compute dtype, autocast context, batch cast) for a few training steps on CPU. The frameworks' recipes
    train under bf16 autocast, and so do the drivers where the CPU has bf16 arithmetic; elsewhere they train
    in fp32, with the stored bf16 states cast up (what is checked is that the framework reads the export and
    trains on it)."""
    import torch

    if bf16_native():
        return "bfloat16", lambda: torch.autocast("cpu", dtype=torch.bfloat16), lambda value: value

    def up(value: Any) -> Any:  # a batch nests its tensors in dicts (Model-Optimizer's base model outputs)
        if isinstance(value, dict):
            return {k: up(v) for k, v in value.items()}
        return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return "float32", nullcontext, up


def report(main: Callable[[], dict]) -> None:
    """Run `main` and print its result, or the error with its traceback, as the last line of stdout."""
    try:
        result = main()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(result, default=str))
    sys.exit(0)
