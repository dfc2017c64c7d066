"""The served gate's pieces that need no real vLLM: the engine's counters read from its Prometheus page and
turned into the report's figures, the server command for a draft, and failures that name the server's log (a
server that does not start, one that dies mid-part). The real engine runs in tests/test_served_chain.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import sys
import textwrap
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from eagle3_assets.config import ProjectConfig
from eagle3_assets.core.acceptance.measure import PartMeasure, PromptSet, SpecCounters, greedy_differences
from resources.vllm.acceptance import ServedAcceptanceError, VllmMeasurer, read_counters
from resources.vllm.server import ServeSpec

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 21.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 84.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 16.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 14.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="3"} 10.0
vllm:prompt_tokens_total{engine="0",model_name="target"} 500.0
"""


def test_the_engines_counters_give_the_reports_figures():
    c = read_counters(METRICS)
    assert c == SpecCounters(21, 84, 60, (20, 16, 14, 10))
    part = PartMeasure.from_counters(c.minus(SpecCounters(1, 4, 0, (0, 0, 0, 0))), 4, ["a", "b"], 70)
    assert part.acceptance_length == round(1 + 60 / 20, 4)
    # Conditional: position i over the drafts accepted through i - 1.
    assert part.per_position == [1.0, 0.8, 0.875, round(10 / 14, 4)]
    assert part.counters["num_drafts"] == 20 and part.prompt_ids == ["a", "b"] and part.n_prompts == 2


def test_a_page_without_speculative_counters_reads_as_zero():
    assert read_counters("vllm:prompt_tokens_total 5.0\n") == SpecCounters()


def test_greedy_differences_name_the_first_token_that_differs():
    ps = PromptSet(["x", "y"], [[1], [2]])
    out = asdict(greedy_differences(ps, [[5, 6, 7], [8, 9]], [[5, 6, 7], [8, 4]]))
    assert out == {
        "prompts": 2,
        "equal": 1,
        "differences": {"y": {"first_difference": 1, "drafted_tokens": 2, "plain_tokens": 2}},
    }


def test_the_draft_server_command_serves_the_draft_as_eagle3_without_the_connector():
    spec = ServeSpec("/m", [], 0, "/tmp/x", mode="eagle3", draft_model="/d", num_speculative_tokens=4)
    argv = spec.argv("py")
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}
    assert "--kv-transfer-config" not in argv
    plain = ServeSpec("/m", [], 0, "/tmp/x", mode="plain").argv("py")
    assert "--speculative-config" not in plain and "--kv-transfer-config" not in plain


def _project(tmp_path, python: str) -> ProjectConfig:
    return ProjectConfig.model_validate(
        {
            "datasets": {"B1": {"source": "x.jsonl", "format": "messages"}},
            "acceptance": {
                "engine": "vllm",
                "max_new_tokens": 4,
                "vllm": {"python": python, "start_timeout_s": 60, "tensor_parallel_size": 1},
            },
            "base_dir": str(tmp_path),
        }
    )


def _script(tmp_path, body: str) -> str:
    """An executable that stands in for the server's interpreter: `<it> -m vllm... --port N ...`."""
    server = tmp_path / "fake_server.py"
    server.write_text(textwrap.dedent(body))
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} {server} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_server_that_does_not_start_names_its_log(tmp_path):
    python = _script(tmp_path, "import sys\nprint('no such model: boom')\nsys.exit(3)\n")
    measurer = VllmMeasurer(_project(tmp_path, python), [2], tmp_path / "work", log=lambda m: None)
    with pytest.raises(ServedAcceptanceError, match=r"did not start \(log: .*vllm-acceptance-.*\.log\)") as e:
        measurer.greedy(PromptSet(["a"], [[1, 2]]))
    assert "boom" in str(e.value)


FAKE_SERVER = """
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
served = []

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"data": [{"id": "target"}]} if self.path.endswith("/models") else {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        served.append(body)
        if len(served) > 1:  # the warm-up answered; this is a measured request
            ON_MEASURED
        self._send({"choices": [{"token_ids": [1]}]})

HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake_server(on_measured: str) -> str:
    """A stand-in vLLM server that answers the warm-up and runs `on_measured` (one line) on a measured
    request."""
    return FAKE_SERVER.replace("ON_MEASURED", on_measured)


# The first measured request kills the server.
DYING = fake_server('print("engine core died: out of memory", flush=True); os._exit(9)')


def test_a_server_that_dies_mid_part_names_its_log_and_is_stopped(tmp_path):
    measurer = VllmMeasurer(
        _project(tmp_path, _script(tmp_path, DYING)), [2], tmp_path / "work", log=lambda m: None
    )
    with pytest.raises(ServedAcceptanceError, match=r"died \(exit .*; log: .*\.log\)") as e:
        measurer.greedy(PromptSet(["a"], [[1, 2]]))
    assert "out of memory" in str(e.value)


def test_terminate_mid_part_stops_the_server_the_step_started(tmp_path):
    """Dagster's Terminate is a SIGINT in the step's process: the server (its whole process group) goes with
    it."""
    pid_file = tmp_path / "server.pid"
    # A measured request is a thinking target's answer, minutes long.
    server = fake_server(f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    measurer = VllmMeasurer(
        _project(tmp_path, _script(tmp_path, server)), [2], tmp_path / "work", log=lambda m: None
    )

    def interrupt_when_serving() -> None:
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_serving, daemon=True).start()
    with python_sigint_handler(), pytest.raises(KeyboardInterrupt):
        measurer.greedy(PromptSet(["a"], [[1, 2]]))
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the acceptance server outlived the terminated step"


@contextlib.contextmanager
def python_sigint_handler():
    """SIGINT raising KeyboardInterrupt, as Dagster's own handler raises in a step. A process started in the
    background by a non-interactive shell (`nohup make test &`) inherits SIGINT ignored, and Python then keeps
    it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(FileNotFoundError):  # a zombie waiting for its parent counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False
