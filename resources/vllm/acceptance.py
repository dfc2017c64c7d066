"""The acceptance gate measured by vLLM: the step starts vLLM serving the target with a draft as EAGLE-3 (on
the step's own GPUs, or on the CPU build), decodes each part's prompts greedily, and reads the engine's own
speculative-decoding counters (`/metrics`: `vllm:spec_decode_*`) before and after each part. The target never
enters this process: it is the engine users deploy drafts with that says how many draft tokens it accepts.

One server per draft (vLLM loads its draft at start): the untrained draft, the trained one, the source-answers
one, and the target alone (no draft) for the greedy-equality check. Each server's whole process group is
stopped when its measurement ends, whatever ends it (an error, the run's termination).
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_assets.config import AcceptanceConfig, ProjectConfig, VllmExtractionConfig
from eagle3_assets.core.acceptance.measure import Measured, PartMeasure, PromptSet, SpecCounters
from eagle3_assets.core.storage.proxy import urlopen
from eagle3_assets.core.target_model.loading import resolve

from .managed import (
    ManagedServerError,
    extraction_spec,
    server_dtype,
    started,
    tensor_parallel,
)
from .self_check import ServedSelfCheck
from .server import RunningServer, ServeSpec, free_port

SERVED_NAME = "target"
WAIT_TICK_S = 0.5
_METRIC = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")
_POSITION = re.compile(r'position="(\d+)"')


class ServedAcceptanceError(ManagedServerError):
    """The acceptance server failed to start, died or answered wrongly; the message names its log."""


def read_counters(metrics_text: str) -> SpecCounters:
    """The speculative-decoding counters of a Prometheus `/metrics` page, summed over engines."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in metrics_text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name, labels, value = (
            m.group(1).removeprefix("vllm:spec_decode_"),
            m.group(2) or "",
            float(m.group(3)),
        )
        if name == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        elif name in totals:
            totals[name] += value
    positions = tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecCounters(
        int(totals["num_drafts"]),
        int(totals["num_draft_tokens"]),
        int(totals["num_accepted_tokens"]),
        positions,
    )


class VllmMeasurer:
    """`DraftMeasurer` on vLLM: a server per draft, the engine's counters per part."""

    engine = "vllm"

    def __init__(
        self,
        project: ProjectConfig,
        stop_ids: Sequence[int],
        workdir: Path,
        log: Callable[[str], None] = print,
    ):
        self.project = project
        self.settings: AcceptanceConfig = project.acceptance
        self.stop_ids = sorted(stop_ids)
        self.workdir = Path(workdir)
        self.log = log
        self.device = "vllm (cpu)" if self.settings.vllm.cpu else "vllm (gpu)"

    # -- the two questions the gate asks ---------------------------------------------------------------------
    def measure(self, draft: Any, folder: Path, parts: Mapping[str, PromptSet]) -> dict[str, Measured]:
        k = self.settings.draft_tokens
        with self.serving(list(parts.values()), folder) as server:
            out = {}
            for name, ps in parts.items():
                before = self._counters(server)
                outputs = self._generate(server, ps)
                counted = self._counters(server).minus(before)
                if counted.num_drafts == 0:
                    raise ServedAcceptanceError(
                        f"vLLM counted no speculative drafts over {len(ps.ids)} prompts: is the draft served "
                        f"as EAGLE-3? (log: {server.log})"
                    )
                new = sum(len(o) for o in outputs)
                out[name] = Measured(PartMeasure.from_counters(counted, k, ps.ids, new), outputs)
            return out

    def greedy(self, prompts: PromptSet) -> list[list[int]]:
        if not prompts.ids:
            return []
        with self.serving([prompts], None) as server:
            return self._generate(server, prompts)

    # -- the server ------------------------------------------------------------------------------------------
    def spec(self, draft: Path | None, longest_prompt: int) -> ServeSpec:
        """The server of the target, with the draft as EAGLE-3 (or alone), sized for the prompts measured."""
        s, v, t = self.settings, self.settings.vllm, self.project.target
        return ServeSpec(
            model=resolve(t.model, self.project.base_dir),
            aux_layers=[],
            num_layers=0,
            storage_path=str(self.workdir),
            mode="eagle3" if draft is not None else "plain",
            draft_model=str(draft) if draft is not None else None,
            num_speculative_tokens=s.draft_tokens,
            served_model_name=SERVED_NAME,
            port=free_port(),
            dtype=server_dtype(v),
            max_model_len=v.max_model_len or longest_prompt + s.max_new_tokens + s.draft_tokens + 8,
            tensor_parallel_size=tensor_parallel(v),
            pipeline_parallel_size=v.pipeline_parallel_size,
            trust_remote_code=t.trust_remote_code,
            revision=t.revision,
            cpu=v.cpu,
            kv_cache_gib=v.kv_cache_gib,
            extra_args=list(v.extra_args),
        )

    @contextlib.contextmanager
    def serving(self, parts: Sequence[PromptSet], draft: Path | None) -> Iterator[RunningServer]:
        """A started server; its whole process group stopped on the way out, whatever ends the block. Its log
        stays on this machine only when the block failed."""
        longest = max((len(p) for ps in parts for p in ps.prompts), default=16)
        what = f"the draft {draft}" if draft is not None else "the target alone (no draft)"
        with started(
            self.spec(draft, longest),
            self.settings.vllm,
            self.workdir,
            f"acceptance: {what}",
            self.log,
            error=ServedAcceptanceError,
            log_prefix="vllm-acceptance-",
        ) as server:
            yield server

    # -- requests --------------------------------------------------------------------------------------------
    def _generate(self, server: RunningServer, prompts: PromptSet) -> list[list[int]]:
        pool = ThreadPoolExecutor(self.settings.vllm.max_concurrency)
        futures = [pool.submit(self._complete, server, p) for p in prompts.prompts]
        try:
            pending = set(futures)
            while pending:
                # Never an unbounded wait: a stop signal that lands on another thread (Dagster's Terminate is
                # sent from one) is handled only when this thread runs again.
                done, pending = wait(pending, timeout=WAIT_TICK_S, return_when=FIRST_EXCEPTION)
                for f in done:
                    f.result()  # the first failure ends the part
        except BaseException:
            # Terminated (or failed) mid-part: no waiting here for answers that may take minutes; the server
            # is stopped next (`serving`), which ends the requests still in flight.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return [f.result() for f in futures]

    def _complete(self, server: RunningServer, prompt: list[int]) -> list[int]:
        body = {
            "model": SERVED_NAME,
            "prompt": list(prompt),
            "max_tokens": self.settings.max_new_tokens,
            "temperature": 0.0,
            "stop_token_ids": self.stop_ids,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        answer = self._post(server, "/completions", body)
        ids = (answer.get("choices") or [{}])[0].get("token_ids")
        if ids is None:
            raise ServedAcceptanceError(
                f"vLLM returned no token_ids (log: {server.log}): {str(answer)[:300]}"
            )
        return [int(i) for i in ids]

    def _post(self, server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            server.base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urlopen(req, timeout=self.settings.vllm.request_timeout_s) as r:
                return json.loads(r.read())
        except (OSError, urllib.error.HTTPError, ValueError) as e:
            raise self._failure(server, f"POST {path}: {type(e).__name__}: {e}") from e

    def _counters(self, server: RunningServer) -> SpecCounters:
        root = server.base_url.removesuffix("/v1")
        try:
            with urlopen(f"{root}/metrics", timeout=60) as r:
                return read_counters(r.read().decode())
        except OSError as e:
            raise self._failure(server, f"GET /metrics: {type(e).__name__}: {e}") from e

    @staticmethod
    def _failure(server: RunningServer, what: str) -> ServedAcceptanceError:
        import subprocess

        with contextlib.suppress(subprocess.TimeoutExpired):  # a dying server: give its exit a moment to show
            server.process.wait(2)
        if server.process.poll() is not None:
            return ServedAcceptanceError(
                f"the acceptance vLLM server died (exit {server.process.returncode}; log: {server.log}):\n"
                f"{server.log_tail(2000)}"
            )
        return ServedAcceptanceError(
            f"the acceptance vLLM server failed a request, {what} (log: {server.log})"
        )


class VllmFeatures:
    """`FeatureSource` for the source-answers arm: the source answers' aux states, extracted as the
    partition's own were (vLLM's `extract_hidden_states`), by an extraction server this step starts on its own
    devices (`acceptance.vllm`) after its measurements, never by servers another stage or a person runs. The
    server is stopped as soon as the states are read."""

    def __init__(
        self, project: ProjectConfig, partition: str, n_aux: int, workdir: Path, log: Callable[[str], None]
    ):
        self.project = project
        self.partition = partition
        self.n_aux = n_aux
        self.workdir = Path(workdir)
        self.log = log

    def aux_states(self, samples: Sequence[np.ndarray]) -> list[Any]:
        from eagle3_assets.core.generation.stopping import run_loop

        a = self.project.acceptance.vllm
        self.workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="connector-", dir=self.workdir) as files:
            spec = extraction_spec(
                self.project,
                files,
                port=free_port(),
                dtype=server_dtype(a),
                tensor_parallel_size=tensor_parallel(a),
                pipeline_parallel_size=a.pipeline_parallel_size,
                cpu=a.cpu,
                kv_cache_gib=a.kv_cache_gib,
                extra_args=list(a.extra_args),
            )
            what = f"acceptance: the source answers' states ({len(samples)} samples)"
            with started(spec, a, self.workdir, what, self.log, error=ServedAcceptanceError) as server:
                cfg = self.project.hidden_states.vllm.model_copy(
                    update={"base_urls": [server.base_url], "storage_path": files, "model": None}
                )
                return run_loop(self._extract(cfg, samples))

    async def _extract(self, cfg: VllmExtractionConfig, samples: Sequence[np.ndarray]) -> list[Any]:
        import asyncio

        from eagle3_assets.core.generation.protocol import CompletionRequest

        from .extraction import VllmHiddenStates

        backend = VllmHiddenStates(
            cfg,
            f"{self.partition}-acceptance",
            self.n_aux + 1,
            ServedSelfCheck.of(self.project),  # a server on a version no test ran is checked first
            log=self.log,
        )
        await backend.start()
        try:
            requests = [
                CompletionRequest(
                    id=f"source-{i}", messages=[], max_tokens=1, prompt_ids=[int(x) for x in ids]
                )
                for i, ids in enumerate(samples)
            ]
            done = await asyncio.gather(*(backend.complete(r) for r in requests))
        finally:
            await backend.close()
        out = []
        for c in done:
            states = c.payload  # [T, n_aux + 1, H]
            out.append(states[:, : self.n_aux].reshape(states.shape[0], -1).float())
        return out
