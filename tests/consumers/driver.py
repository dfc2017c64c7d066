"""What the three drivers share (each runs as a script in its framework's environment, this folder on its path):
offline settings set before the framework is imported, and one JSON line out, whatever happens."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

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


def report(main: Callable[[], dict]) -> None:
    """Run `main` and print its result, or the error with its traceback, as the last line of stdout."""
    try:
        result = main()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(result, default=str))
    sys.exit(0)
