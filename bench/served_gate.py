"""The acceptance gate served by vLLM against the gate in this process, on one demo partition (B3).

Builds the partition as `make demo` does (the embedded target answers B3's prompts, hidden states in process),
then runs the gate twice, each in a process of its own: `acceptance.engine: transformers` (the target in the
step, this project's speculative loop) and `acceptance.engine: vllm` with `vllm.cpu: true` (the step starts
vLLM's CPU build with each draft as EAGLE-3 and reads its counters). Both skip the source-answers arm (the
served one takes those states from hidden-states servers, which this partition did not use), so they do the
same work.

Reported: wall time of each (and the ratio served / in-process), the step process's peak RSS under each engine
(the served step holds the draft and the target's embedding; the vLLM servers' own memory is reported beside
it), and the acceptance lengths each engine measured on the same prompts.

`python -m bench served_gate` (`--quick`: 12 prompts, 60 training steps, 32 new tokens).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .acceptance import _acceptance_lengths, _partition

ENGINES = ("transformers", "vllm")


def _child(config: str, engine: str, quick: bool) -> None:
    """Runs in its own process: one gate, then its report and this process's peak RSS on stdout."""
    from eagle3_assets.assets.acceptance import gate_engines
    from eagle3_assets.config import load_config
    from eagle3_assets.core.acceptance.gate import run_gate
    from eagle3_assets.core.storage.layout import DatasetLayout
    from resources import Target

    cfg = load_config(config)
    update = {"engine": engine, "compare_source_answers": False}
    if quick:
        update |= {"train_steps": 60, "max_new_tokens": 32}
    vllm = cfg.acceptance.vllm.model_copy(update={"cpu": True})
    cfg = cfg.model_copy(update={"acceptance": cfg.acceptance.model_copy(update={**update, "vllm": vllm})})
    layout = DatasetLayout(cfg.storage_root, "B3")
    chat = Target(cfg).chat_tokenizer()
    import psutil
    import torch  # noqa: F401  (imported by both engines: part of the base, not of the gate)
    import transformers  # noqa: F401

    base_mb = psutil.Process().memory_info().rss / 2**20  # imports and the tokenizer: what every step holds
    t0 = time.perf_counter()
    report = run_gate(
        layout, cfg.acceptance, gate_engines(cfg, layout, chat, log=lambda m: None), chat, log=print
    )
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "wall_s": wall,
        "peak_rss_mb": peak_kib / 1024,
        "base_rss_mb": base_mb,
        "report": report.to_json(),
    }
    print("RESULT " + json.dumps(result))


def _servers_peak(pid: int, stop: threading.Event, out: list[float]) -> None:
    """Peak summed RSS of the child's descendants (the vLLM server it starts: API server, engine core)."""
    import psutil

    peak = 0.0
    while not stop.is_set():
        try:
            kids = psutil.Process(pid).children(recursive=True)
            peak = max(peak, sum(k.memory_info().rss for k in kids if k.is_running()) / 2**20)
        except psutil.Error:
            pass
        stop.wait(0.5)
    out.append(peak)


def _measure(config: Path, engine: str, quick: bool) -> dict:
    args = [sys.executable, "-m", "bench.served_gate", "--child", str(config), engine]
    proc = subprocess.Popen([*args, *(["--quick"] if quick else [])], stdout=subprocess.PIPE, text=True)
    stop, peak = threading.Event(), []
    watcher = threading.Thread(target=_servers_peak, args=(proc.pid, stop, peak), daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    stop.set()
    watcher.join()
    if proc.returncode:
        raise RuntimeError(f"the {engine} gate failed ({proc.returncode}):\n{out[-3000:]}")
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["servers_peak_rss_mb"] = peak[0] if peak else 0.0
    return result


def run(quick: bool = False) -> dict:
    from eagle3_assets.core.acceptance.gate_report import GateReport

    with tempfile.TemporaryDirectory() as tmp:
        _, path = _partition(Path(tmp), 12 if quick else 1000)
        runs = {e: _measure(path, e, quick) for e in ENGINES}
    rows = {}
    for e, r in runs.items():
        rep = GateReport.model_validate(r["report"])
        rows[e] = {
            "wall_s": round(r["wall_s"], 1),
            "step_peak_rss_mb": round(r["peak_rss_mb"]),
            "step_base_rss_mb": round(r["base_rss_mb"]),
            "gate_rss_increment_mb": round(r["peak_rss_mb"] - r["base_rss_mb"]),
            "servers_peak_rss_mb": round(r["servers_peak_rss_mb"]),
            "acceptance_length": _acceptance_lengths(rep),
            "greedy_check": f"{rep.greedy_check.equal}/{rep.greedy_check.prompts}",
            "seconds": rep.seconds,
        }
    ratio = rows["vllm"]["wall_s"] / rows["transformers"]["wall_s"]
    print(
        f"{'engine':14} {'wall s':>8} {'step RSS MB':>12} {'of it the gate':>15} {'servers MB':>11} "
        f"{'train':>6} {'heldout':>8} {'untrained':>9}"
    )
    for e, r in rows.items():
        a = r["acceptance_length"]
        print(
            f"{e:14} {r['wall_s']:>8.1f} {r['step_peak_rss_mb']:>12} {r['gate_rss_increment_mb']:>15} "
            f"{r['servers_peak_rss_mb']:>11} {a['train']:>6.2f} {a['heldout']:>8.2f} {a['untrained']:>9.2f}"
        )
    print(f"served gate / in-process gate, wall: {ratio:.2f}x")
    return {"engines": rows, "served_over_in_process_wall": round(ratio, 2)}


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], "--quick" in sys.argv)
