"""The OpenAI-compatible backend against a real server: `transformers serve` on loopback with the embedded
model, streamed and not. Greedy decoding on one server must give the same answers both ways, so the streamed
answer is reassembled exactly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from eagle3_assets.config import OpenRouterConfig
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.run import generate_responses
from resources.inference.openrouter import OpenRouterBackend

from .support.engine_runs import KEY, KEY_ENV, dataset, make_plan, stored

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_model(smollm2_dir):
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--device", "cpu", str(smollm2_dir)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "transformers serve did not start"
            time.sleep(0.5)
        yield base, str(smollm2_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_streamed_and_plain_answers_from_a_real_openai_compatible_server(
    tmp_path, chat, served_model, monkeypatch
):
    base, model = served_model
    monkeypatch.setenv(KEY_ENV, KEY)
    texts = ["What is 2 + 2?", "Name a colour.", "Say hello in French."]
    answers = {}
    for stream in (True, False):
        layout = dataset(tmp_path / ("s" if stream else "p"), texts)
        cfg = OpenRouterConfig(
            base_url=base, api_key_env=KEY_ENV, model=model, reasoning=None, stream=stream, max_concurrency=4
        )
        plan = make_plan(layout.key, 24, 10**9)
        summary = generate_responses(
            layout,
            plan,
            OpenRouterBackend(cfg, chat),
            chat,
            EngineSettings(max_concurrency=4),
            log=lambda m: None,
        )
        responses, failures = stored(layout)
        assert failures.height == 0, failures.to_dicts()
        assert responses.height == 3 and summary.report.succeeded == 3
        assert (responses["completion_tokens"] > 0).all() and not responses["usage_estimated"].any()
        assert set(responses["finish_reason"]) <= {"stop", "length"}
        answers[stream] = dict(zip(responses["id"], responses["content"], strict=True))
    assert all(answers[True].values())
    assert answers[True] == answers[False]  # the same greedy answers, streamed or not
