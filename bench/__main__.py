"""`make bench` / `python -m bench
[engine|limits|backfill|multiturn|storage|tokens|hidden|vllm|acceptance|served_gate] [--quick]`: run
benchmarks and print ratio tables."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

SUITES = {
    "engine": "bench.engine_throughput",
    "limits": "bench.limits",
    "backfill": "bench.backfill",
    "multiturn": "bench.multiturn",
    "storage": "bench.storage",
    "tokens": "bench.tokens_throughput",
    "hidden": "bench.hidden_states_throughput",
    "vllm": "bench.vllm_hidden_states",
    "acceptance": "bench.acceptance",
    "served_gate": "bench.served_gate",
}
RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench")
    p.add_argument("suites", nargs="*", choices=[*SUITES, []], default=[])
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = p.parse_args(argv)
    names = args.suites or list(SUITES)
    RESULTS.mkdir(exist_ok=True)
    for name in names:
        module = importlib.import_module(SUITES[name])
        print(f"\n=== {name} ===", flush=True)
        result = module.run(quick=args.quick)
        out = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"(saved {out.relative_to(RESULTS.parent.parent)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
