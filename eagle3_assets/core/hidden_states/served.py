"""Extraction through a serving engine (vLLM's `extract_hidden_states`): the same shards, index and checks as
the in-process path, from states that running servers computed.

A target beyond one GPU (a 1T-parameter MoE such as Kimi-K2.5) cannot run in this process; a serving engine
spreads it with tensor and pipeline parallelism across GPUs and nodes, and replicas scale it out. Each sample
is one request (its `input_ids` as the prompt, one generated token); the server writes the prompt's states to
a file that the backend reads, checks and removes, and hands over as the answer's payload. The requests ride
the generation engine (its adaptive window, retries, error classes), one lane for the planned shards. Answers
land in any order; a shard is written (atomically, by the shard writer thread) as soon as all of its samples
are in, so a killed run loses only the shards still assembling, and a resumed run plans exactly those again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..generation.engine import GenerationEngine
from ..generation.engine_settings import EngineSettings
from ..generation.lanes import Lane
from ..generation.protocol import Completion, CompletionRequest, ErrorKind, InferenceBackend
from ..generation.stopping import run_loop
from .fp8 import QuantizedStates, is_fp8, quantize, scales_name
from .shards import ExtractionStats, Sample, ShardPlan, ShardWriter, write_shard


class NoBudget:
    """Extraction is paid for by the hour, not by the token: the engine's budget gate stays open."""

    def open(self, request: Any = None) -> None:
        return None

    def settle(self, *_: Any, **__: Any) -> None:
        return None

    def can_dispatch(self) -> bool:
        return True

    def spent_share(self) -> float:
        return 0.0

    def committed_share(self) -> float:
        return 0.0

    def describe(self) -> str:
        return "none (extraction)"


@dataclass
class ServedResult:
    stats: ExtractionStats
    too_long: dict[str, str] = field(default_factory=dict)  # id -> the server's reason (context length)
    # id -> last error (retryable: planned again next run)
    failed: dict[str, str] = field(default_factory=dict)
    unfinished_shards: list[str] = field(default_factory=list)


class ShardBuffer:
    """One assembling shard's states in the store dtype, laid out as the shard holds them (aux [N, n_aux·H],
    last [N, H], samples in plan order; in FP8 their scales [N, n_aux] and [N, 1] beside them). Each sample is
    converted (quantized, in FP8) into its rows as it lands, in the writer thread: the event loop never
    touches states, nothing is held at the server's precision, and the shard needs no concatenation before it
    is saved."""

    def __init__(self, plan: ShardPlan, samples: dict[str, Sample]):
        self.rows: dict[str, tuple[int, int]] = {}
        at = 0
        for sid in plan.ids:
            n = len(samples[sid].input_ids)
            self.rows[sid] = (at, at + n)
            at += n
        self.n_tokens = at
        self.arrived: set[str] = set()  # added on the event loop as answers land, before their put is queued
        self.tensors: dict[str, Any] = {}  # tensor name -> [N, ...], as the shard stores it

    def put(self, sid: str, states: Any, n_aux: int, dtype: str) -> None:
        """One sample's states [t, n_aux + 1, H] (the server's dtype, or FP8 as the connector wrote them) into
        its rows."""
        t, _, h = states.shape
        if not self.tensors:
            self.tensors = self._allocate(n_aux, h, dtype)
        a, b = self.rows[sid]
        if isinstance(states, QuantizedStates) and not is_fp8(dtype):
            states = states.dequantized()
        if is_fp8(dtype):
            if isinstance(
                states, QuantizedStates
            ):  # quantized by the server's connector: the bytes as they are
                q, scales = states.values, states.scales
            else:
                q, scales = quantize(states.reshape(t, -1), n_aux + 1)
                q = q.view(t, n_aux + 1, h)
            self.tensors["aux_hidden_states"][a:b].view(t, n_aux, h).copy_(q[:, :n_aux])
            self.tensors["last_hidden_state"][a:b].copy_(q[:, n_aux])
            self.tensors[scales_name("aux_hidden_states")][a:b].copy_(scales[:, :n_aux])
            self.tensors[scales_name("last_hidden_state")][a:b].copy_(scales[:, n_aux:])
            return
        self.tensors["aux_hidden_states"][a:b].view(t, n_aux, h).copy_(states[:, :n_aux])
        self.tensors["last_hidden_state"][a:b].copy_(states[:, n_aux])

    def _allocate(self, n_aux: int, h: int, dtype: str) -> dict[str, Any]:
        import torch

        n, store = self.n_tokens, getattr(torch, dtype)
        out = {
            "aux_hidden_states": torch.empty(n, n_aux * h, dtype=store),
            "last_hidden_state": torch.empty(n, h, dtype=store),
        }
        if is_fp8(dtype):
            out[scales_name("aux_hidden_states")] = torch.empty(n, n_aux, dtype=torch.float32)
            out[scales_name("last_hidden_state")] = torch.empty(n, 1, dtype=torch.float32)
        return out

    def kept(self, ordered: list[Sample]) -> dict[str, Any]:
        """The rows of the samples written (those that arrived, in plan order), by tensor name; only a shard
        that lost a sample (too long) is compacted."""
        if len(ordered) == len(self.rows):
            return dict(self.tensors)
        import torch

        spans = [self.rows[s.id] for s in ordered]
        return {k: torch.cat([v[a:b] for a, b in spans]) for k, v in self.tensors.items()}


class ShardAssembler:
    """The lane's sink: puts each sample's states into its shard's buffer (in the writer thread) and writes
    the shard once all of its samples are in (a sample the server refuses as too long leaves its shard; any
    other failure leaves the shard unwritten)."""

    def __init__(
        self,
        plans: list[ShardPlan],
        samples: dict[str, Sample],
        folder: Path,
        store_dtype: str,
        metadata: dict[str, str],
        n_aux: int,
        writer: ShardWriter,
    ):
        self.plans = {p.name: p for p in plans}
        self.samples = samples
        self.folder = folder
        self.store_dtype = store_dtype
        self.metadata = metadata
        self.n_aux = n_aux
        self.writer = writer
        self.shard_of = {sid: p.name for p in plans for sid in p.ids}
        self.missing = {p.name: set(p.ids) for p in plans}
        self.buffers: dict[str, ShardBuffer] = {}  # shards with at least one sample in
        self.result = ServedResult(ExtractionStats())
        self.compute_dtype: str | None = None
        self.pending = 0  # the engine's writer protocol: nothing buffered here that a flush would write

    def add_completion(self, request_id: str, c: Completion) -> None:
        states = c.payload
        shard = self.shard_of[request_id]
        buf = self.buffers.get(shard)
        if buf is None:
            buf = self.buffers[shard] = ShardBuffer(self.plans[shard], self.samples)
        buf.arrived.add(request_id)
        computed = states.source_dtype if isinstance(states, QuantizedStates) else str(states.dtype)
        self.compute_dtype = self.compute_dtype or computed.removeprefix("torch.")
        n_aux, dtype = self.n_aux, self.store_dtype
        self.writer.submit(lambda: buf.put(request_id, states, n_aux, dtype))
        self._landed(request_id)

    def add_failure(
        self, request_id: str, kind: str, message: str, attempts: int, permanent: bool, status: int | None
    ) -> None:
        if kind == ErrorKind.CONTEXT_LENGTH.value and permanent:
            self.result.too_long[request_id] = f"the server refused it as too long: {message[:300]}"
            self._landed(request_id)
        else:
            self.result.failed[request_id] = f"{kind}: {message[:300]}"

    async def flush(self) -> None:
        self.writer.raise_error()  # a shard that cannot be written stops the run (the engine's journal rule)

    def _landed(self, sid: str) -> None:
        shard = self.shard_of[sid]
        missing = self.missing[shard]
        missing.discard(sid)
        if missing:
            return
        buf = self.buffers.pop(shard, None)
        del self.missing[shard]
        if buf is None:
            return  # every sample of the shard was too long
        ordered = [self.samples[i] for i in self.plans[shard].ids if i in buf.arrived]
        meta = {**self.metadata, "compute_dtype": self.compute_dtype or ""}
        stats = self.result.stats
        stats.samples += len(ordered)
        stats.tokens += sum(len(s.input_ids) for s in ordered)
        stats.forwards += len(ordered)
        stats.shards.append(shard)
        path = self.folder / shard
        self.writer.submit(lambda: _write(path, ordered, buf, meta))

    def unfinished(self) -> list[str]:
        return sorted(self.missing)


def _write(path: Path, ordered: list[Sample], buf: ShardBuffer, meta: dict[str, str]) -> None:
    states = buf.kept(ordered)
    write_shard(path, ordered, states.pop("aux_hidden_states"), states.pop("last_hidden_state"), meta, states)


@contextlib.contextmanager
def _one_compute_thread() -> Iterator[None]:
    """This process only copies states here (memory-bound: a second thread buys little), and where the server
    computes on the same cores, torch's spinning worker threads take CPU from it. Restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def requests_for(plans: list[ShardPlan], samples: dict[str, Sample]) -> Iterator[CompletionRequest]:
    """Samples in plan order (shard by shard): shards complete roughly in turn, so few are assembling at
    once."""
    for plan in plans:
        for sid in plan.ids:
            ids = samples[sid].input_ids
            yield CompletionRequest(id=sid, messages=[], max_tokens=1, prompt_ids=ids.tolist())


def extract_served(
    backend: InferenceBackend,
    plans: list[ShardPlan],
    samples: dict[str, Sample],
    folder: Path,
    store_dtype: str,
    metadata: dict[str, str],
    n_aux: int,
    engine: EngineSettings,
    log: Callable[[str], None] = print,
) -> ServedResult:
    """Send every planned sample through `backend` and write the shards as they complete."""
    # Unbounded: a sample's put must never block the event loop behind a shard's write and fsync; what it
    # holds is bounded by the requests in flight, whose states exist either way.
    writer = ShardWriter(max_queued=0)
    assembler = ShardAssembler(plans, samples, folder, store_dtype, metadata, n_aux, writer)
    total = sum(len(p.ids) for p in plans)
    started = time.monotonic()

    runner = GenerationEngine(backend, engine, log)

    async def go() -> None:
        if runner.terminated:
            return
        await backend.start()
        try:
            lane = Lane("hidden_states", requests_for(plans, samples), total, NoBudget(), assembler)
            await runner.run([lane])
        finally:
            await backend.close()

    with _one_compute_thread():
        try:
            run_loop(go(), on_stop=runner.terminate)
        finally:
            writer.close()  # every completed shard is on disk (or the error surfaces) before this returns
    result = assembler.result
    result.stats.forward_s = time.monotonic() - started
    result.stats.bytes_written = sum((folder / n).stat().st_size for n in result.stats.shards)
    result.unfinished_shards = assembler.unfinished()
    return result
