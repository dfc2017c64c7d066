"""The exact vLLM server command for the configured target: one server (or one replica of many) that generates
answers with their token ids and extracts the auxiliary hidden states EAGLE-3 trains on.

What is easy to get wrong and is therefore computed here, never typed by hand:
- vLLM counts `eagle_aux_hidden_state_layer_ids` as `output_hidden_states` indices (0 = the embeddings), so
  this project's aux layers (0-based decoder outputs) are shifted by one, and the last layer's output before
  the final norm is id L;
- the connector: the project's (`plugin/eagle3_hidden_states_connector.py`, opt-in writes, runs on CPU) loaded
  through `kv_connector_module_path`, with the folder it writes to (which the extraction must be able to read:
  the same path on a shared volume);
- `--max-model-len` one more than the longest sample extracted (`hidden_states.max_seq_len`): the request
  generates one token after the prompt.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle3_assets.core.hidden_states.layer_ids import output_hidden_states_ids
from eagle3_assets.core.storage.proxy import urlopen

PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"
CONNECTOR_MODULE = "eagle3_hidden_states_connector"
CONNECTOR_CLASS = "Eagle3HiddenStatesConnector"


def vllm_layer_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """This project's aux layers (decoder outputs, 0-based) in vLLM's convention, then the last layer (id
    L)."""
    return [*output_hidden_states_ids(aux_layers), num_layers]


@dataclass
class ServeSpec:
    """One server of the target. `mode` says what it serves beside generation: `extract` the hidden states
    (the extraction's servers), `eagle3` a draft (`draft_model`, k = `num_speculative_tokens`: the acceptance
    step's own server), `plain` nothing (greedy answers of the target alone)."""

    model: str  # a folder or a hub id, as the server loads it
    aux_layers: list[int]
    num_layers: int
    storage_path: str  # where the connector writes (shared with the extraction)
    mode: Literal["extract", "eagle3", "plain"] = "extract"
    draft_model: str | None = None  # mode eagle3: the draft's folder (config.json + model.safetensors)
    num_speculative_tokens: int = 1
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int = 1  # a server spread over nodes (multiprocessing backend): the same command on every node
    node_rank: int = 0  # ranks above 0 run headless (no API server), joining rank 0 at master_addr
    master_addr: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    enforce_eager: bool = False
    cpu: bool = False  # vLLM's CPU build (tests, laptops)
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    extra_args: list[str] = field(default_factory=list)
    storage_dtype: str = (
        "bfloat16"  # hidden_states.storage_dtype: float8_e4m3fn makes the connector write FP8
    )

    @property
    def layer_ids(self) -> list[int]:
        return vllm_layer_ids(self.aux_layers, self.num_layers)

    def speculative_config(self) -> dict | None:
        if self.mode == "plain":
            return None
        if self.mode == "eagle3":
            if not self.draft_model:
                raise ValueError("an eagle3 server needs draft_model (the draft's folder)")
            return {
                "method": "eagle3",
                "model": self.draft_model,
                "num_speculative_tokens": self.num_speculative_tokens,
            }
        return {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}},
        }

    def kv_transfer_config(self) -> dict | None:
        if self.mode != "extract":
            return None
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": self.storage_path,
                **({"storage_dtype": self.storage_dtype} if self.storage_dtype == "float8_e4m3fn" else {}),
            },
        }

    def argv(self, python: str = "python") -> list[str]:
        """The server command (the console script `vllm serve` is the same server where it works; the CPU
        build's does not, its distribution being named `vllm-cpu`)."""
        args = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
        ]  # fmt: skip
        for flag, value in (
            ("--speculative-config", self.speculative_config()),
            ("--kv-transfer-config", self.kv_transfer_config()),
        ):
            if value is not None:
                args += [flag, json.dumps(value, separators=(",", ":"))]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            args += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.data_parallel_size > 1:
            args += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.nnodes > 1:
            args += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank)]
            if self.master_addr:
                args += ["--master-addr", self.master_addr]
            if self.node_rank > 0:
                args.append("--headless")
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        if self.revision:
            args += ["--revision", self.revision]
        if self.enforce_eager or self.cpu:
            args.append("--enforce-eager")  # CPU: ready in ~1.5 min instead of ~3 with torch.compile
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """What the server's environment needs beside the caller's: the connector on the import path."""
        path = os.environ.get("PYTHONPATH", "")
        env = {"PYTHONPATH": f"{PLUGIN_DIR}{os.pathsep}{path}" if path else str(PLUGIN_DIR)}
        if self.cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        return env

    def shell(self, python: str = "python") -> str:
        """One copy-pasteable line: environment, then the command."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env().items())
        return f"{env} {shlex.join(self.argv(python))}"


@dataclass
class RunningServer:
    """A server this process started (tests, benchmarks): its URL, connector folder, process and log, and the
    vLLM version it reports."""

    base_url: str  # .../v1
    storage: Path
    spec: ServeSpec
    process: subprocess.Popen
    log: Path
    version: str | None = None  # GET /version, once it answers

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """The whole session the server leads (`launch` starts it in its own): the API server, its engine core
        and workers. Terminating the API server alone left `VLLM::Worker` processes behind when it did not
        shut down within the wait."""
        self._signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        self._signal(signal.SIGKILL)  # what is left of the group (a worker that outlived its parent)
        self.process.wait()

    def _signal(self, sig: int) -> None:
        """To the process group the server leads; to the process alone where it leads none (the tests'
        stand-in for a server started by hand), a no-op once it has exited."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            self.process.send_signal(sig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Run first in the server's process, then replaced by vLLM (execv keeps the setting): the kernel sends the
# server SIGTERM when the thread that started it dies, however it dies (Linux). vLLM's shutdown then ends its
# engine and workers. A wrapper, not `preexec_fn`: nothing runs between fork and exec in a threaded process.
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "sys.platform.startswith('linux') and ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def launch(
    spec: ServeSpec,
    python: str,
    log: Path,
    env: dict[str, str],
    timeout_s: float = 600,
    die_with_parent: bool = False,
) -> RunningServer:
    """Start the server, wait until it answers /v1/models, and spend its first (slow) request on a warm-up.
    `die_with_parent`: the server is told to end with the calling thread (a step's server must never outlive
    the step; only a caller on its process's main thread should ask)."""
    Path(spec.storage_path).mkdir(parents=True, exist_ok=True)
    argv = spec.argv(python)
    if die_with_parent:
        argv = [python, "-c", DIE_WITH_PARENT, *argv]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, **spec.env()},
            cwd=log.parent,
            start_new_session=True,
        )
    url = f"http://{spec.host}:{spec.port}/v1"
    server = RunningServer(url, Path(spec.storage_path), spec, proc, log)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode} (log: {log}):\n{server.log_tail()}")
            try:
                with urlopen(f"{url}/models", timeout=2) as r:
                    if r.status == 200:
                        models = json.loads(r.read())["data"]
                        _warm_up(url, models[0]["id"])
                        server.version = served_version(url)
                        return server
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM did not start in {timeout_s:.0f} s (log: {log}):\n{server.log_tail()}")
    except BaseException:
        server.stop()  # with its engine core and workers, whatever stopped the start
        raise


def served_version(base_url: str, timeout_s: float = 10) -> str | None:
    """The vLLM version a server reports at `GET /version` (vLLM's own endpoint); None where it answers
    none."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        with urlopen(f"{root}/version", timeout=timeout_s) as r:
            return str(json.loads(r.read())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def installed_version(python: str) -> str | None:
    """The vLLM version installed for an interpreter (distribution `vllm`, or `vllm-cpu` for the CPU
    build), read from its metadata without importing vLLM; None where there is none or it does not run."""
    probe = (
        "import importlib.metadata as m\n"
        "for d in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(m.version(d)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = done.stdout.strip().splitlines()
    return out[-1] if done.returncode == 0 and out else None


def _warm_up(url: str, model: str) -> None:
    """The first request after start takes ~20 s on CPU (kernels, caches)."""
    body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
    with urlopen(req, timeout=300) as r:
        r.read()
