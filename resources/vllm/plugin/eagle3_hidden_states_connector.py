"""A hidden-states connector for vLLM's `extract_hidden_states` method, loaded by vLLM itself through
`kv_transfer_config.kv_connector_module_path` (this file runs inside the vLLM server, never in the project).

It implements vLLM's public KV-connector interface (`KVConnectorBase_V1`, and `SupportsHMA`: the hidden
states may sit in a cache group of their own) and uses nothing private of vLLM's: no underscored member is
read, called or overridden, and upstream's `ExampleHiddenStatesConnector` is not imported. Beside what the
interface hands it (the config and KV-cache config at construction, the KV caches, the scheduler's new and
finished requests, the metadata bound for the worker) it names four public things: `HiddenStateCacheSpec`
(how the extract_hidden_states layer's cache is told apart, by its own `get_kv_cache_spec` through the
config's forward context), the tensor-parallel rank, vLLM's logger and, on CUDA only, the GPU-sync debug guard
(optional). So it loads on any vLLM that keeps these; `resources/vllm/cpu_build.py` names the versions a test
ran, and the extraction checks one known sample against the checkpoint on any other.

Files and protocol are upstream's example connector's (what speculators' readers and this project's
extraction read): `<shared_storage_path>/<request id>.safetensors` with `hidden_states` [T, n_ids, H] (the
server's dtype) and `token_ids` [T] int64, complete once `<file>.lock` (held exclusively from the step the
request is scheduled until the write ends) can be locked shared; the answer's
`kv_transfer_params.hidden_states_path` names the file. Three departures, which the example cannot give
without overriding its private members:

1. **Opt-in writes.** A request is saved only when its `kv_transfer_params` carry `"save_hidden_states": true`
   (what eagle3-assets' extraction sends); any other request runs as if no connector were configured (its
   blocks are freed at once, nothing is written, no path is returned), so one server also generates answers.
2. **Any device.** Where the cache is on a CUDA device the states are copied to pinned host memory on a copy
   stream of their own and written by a thread once the copy's event completes (the example's asynchronous
   path); elsewhere (vLLM's CPU build) they are gathered synchronously and handed to the same writer threads.
3. **FP8 files, where asked.** With `kv_connector_extra_config.storage_dtype: float8_e4m3fn` (what `eagle3
   vllm-serve` sets for a project storing FP8) each file holds `hidden_states` as float8_e4m3fn with
   `hidden_states_scales` [T, n, 1] float32 (one scale per token and layer, hs-connectors' layout) and the
   server's dtype in the file's metadata (`source_dtype`): the server writes a quarter of fp32's bytes.

Each answer's `kv_transfer_params` also names the vLLM version that wrote the file (`vllm_version`), so the
extraction knows which engine computed every sample it stores.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import vllm
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger

OPT_IN = "save_hidden_states"
VERSION_KEY = "vllm_version"  # in each answer's kv_transfer_params
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The KV-cache layout upstream's example asks for (a token's layers together); where the attention backends
# support none such (vLLM 0.32's CPU build) vLLM picks another, and the block-size check of
# `register_kv_caches` guards the [blocks, layer ids, block size, H] views that `_gather` indexes.
LAYOUT = "LBNHC"

logger = init_logger(f"vllm.{__name__}")  # under vLLM's own handler


def _wants_save(params: dict[str, Any] | None) -> bool:
    return params is not None and bool(params.get(OPT_IN))


def _fp8_file(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The project's FP8 recipe (eagle3_assets.core.hidden_states.fp8, repeated here: this file runs in the
    server's environment): per token and layer, scale = absmax / 448 (1 for a block of zeros), values / scale
    in e4m3."""
    states = tensors["hidden_states"]
    x = states.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scales).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = {"hidden_states": q, "hidden_states_scales": scales.contiguous(), "token_ids": tensors["token_ids"]}
    return out, {"source_dtype": str(states.dtype).removeprefix("torch.")}


def _gather(cache: torch.Tensor, slots: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The cached rows of `slots` (a request's blocks, in order), cut to its tokens: [T, n_ids, H]."""
    block_size = cache.shape[2]
    return cache[slots // block_size, :, slots % block_size][:n_tokens]


def _slots(block_ids: list[int], block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * block_size).flatten()


def _is_hidden_states_spec(spec: Any) -> bool:
    try:
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec
    except ImportError:  # a vLLM that names no such spec: by the class's name
        return "HiddenState" in type(spec).__name__
    return isinstance(spec, HiddenStateCacheSpec)


def _specs_by_layer(group: Any) -> dict[str, Any]:
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)  # a group of several uniform specs
    return dict(per_layer) if isinstance(per_layer, dict) else dict.fromkeys(group.layer_names, spec)


def _hidden_states_group(kv_cache_config: Any) -> tuple[int, int | None]:
    """The KV-cache group whose block table holds the extracted hidden states, and its block size, from the
    KV-cache config the interface hands the connector: the group of the hidden-states spec where vLLM keeps
    one (the hybrid allocator, on GPUs); else the only group (the CPU build unifies every layer's spec into
    one)."""
    if kv_cache_config is None:
        raise ValueError("eagle3_hidden_states_connector needs the KV-cache config (vLLM passes it)")
    groups = list(kv_cache_config.kv_cache_groups)
    found = [
        g
        for g, group in enumerate(groups)
        if any(map(_is_hidden_states_spec, _specs_by_layer(group).values()))
    ]
    if not found and len(groups) == 1:
        found = [0]
    if len(found) != 1:
        raise ValueError(
            f"eagle3_hidden_states_connector: cannot tell the hidden-states cache group among {len(groups)} "
            "KV-cache groups; is the server started with the extract_hidden_states speculative method?"
        )
    return found[0], getattr(groups[found[0]].kv_cache_spec, "block_size", None)


def _hidden_states_layer(vllm_config: Any, kv_cache_config: Any, names: list[str]) -> str:
    """Which of the registered caches is the hidden states': the layer whose own KV-cache spec (the attention
    layers' public `get_kv_cache_spec`) is the hidden-states spec, or the one layer of the hidden-states
    group where it is a group of its own."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", None) or {}
    found = []
    for name in names:
        spec_of = getattr(context.get(name), "get_kv_cache_spec", None)
        if spec_of is not None and _is_hidden_states_spec(spec_of(vllm_config)):
            found.append(name)
    if not found:
        for group in kv_cache_config.kv_cache_groups:
            found += [n for n, spec in _specs_by_layer(group).items() if _is_hidden_states_spec(spec)]
        found = [n for n in found if n in names]
    if len(found) != 1:
        raise ValueError(
            f"eagle3_hidden_states_connector: found {found} as hidden-states cache layers among {len(names)} "
            "KV caches, one expected; is the server started with the extract_hidden_states method?"
        )
    return found[0]


@dataclass
class Save:
    """A finished request whose states the worker writes: its file, prompt ids and hidden-states blocks."""

    req_id: str
    filename: str
    token_ids: torch.Tensor
    block_ids: list[int]


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    """What the scheduler side hands the worker side each step."""

    saves: list[Save] = field(default_factory=list)
    # Requests scheduled this step that will be saved: the worker takes their files' locks before the client
    # can learn the path.
    new_files: dict[str, str] = field(default_factory=dict)


class _Copied:
    """Stands in for a CUDA event once a synchronous copy is done."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _sync_allowed() -> Iterator[None]:
    """vLLM's GPU-sync debug mode (`VLLM_GPU_SYNC_CHECK`) flags the slot copy to the device; it is deliberate,
    as in upstream's example. Where that helper does not exist there is nothing to tell."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:
        yield
        return
    with gpu_sync_allowed():
        yield


class Eagle3HiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
        self.storage_path = str(extra.get("shared_storage_path", "/tmp"))
        self.fp8 = extra.get("storage_dtype", "") == FP8
        self.use_lock = bool(extra.get("use_synchronization_lock", True))
        self.server_config = vllm_config
        self.cache_groups_config = kv_cache_config
        self.group_id, block_size = _hidden_states_group(kv_cache_config)
        self.block_size = int(block_size or vllm_config.cache_config.block_size)
        # scheduler side
        self.save_files: dict[str, str] = {}  # req_id -> file, for requests scheduled that will be saved
        self.finished_saves: dict[str, Save] = {}  # finished, for the next step's metadata
        # worker side
        self.bound_metadata: KVConnectorMetadata | None = None
        self.hs_cache: torch.Tensor | None = None
        self.tp_rank_zero = True  # set by register_kv_caches, once the parallel groups exist
        self.copy_stream: Any = None  # CUDA only, created at the first copy
        self.write_pool = ThreadPoolExecutor(
            max_workers=int(extra.get("num_writer_threads", 8)), thread_name_prefix="eagle3-hs-write"
        )
        self.held_locks: dict[str, int] = {}  # req_id -> open .lock with LOCK_EX held
        self.host_copies: dict[str, Any] = {}  # req_id -> event of its host copy
        self.pending_writes: dict[str, Future] = {}
        self.finished_ids: set[str] = set()  # finished generating, not yet reported done
        logger.info(
            "eagle3 hidden-states connector (%s) on vLLM %s writing to %s%s",
            getattr(role, "name", role),
            vllm.__version__,
            self.storage_path,
            " in FP8" if self.fp8 else "",
        )

    # -- scheduler side ------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is loaded

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = HiddenStatesMetadata(saves=list(self.finished_saves.values()))
        self.finished_saves.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            sampling = new_req.sampling_params
            extra = (sampling.extra_args or {}) if sampling is not None else {}
            if not _wants_save(extra.get("kv_transfer_params")):
                continue
            filename = os.path.join(self.storage_path, f"{new_req.req_id}.safetensors")
            self.save_files[new_req.req_id] = filename
            meta.new_files[new_req.req_id] = filename
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (the blocks stay until the worker has copied them) for a request that asked to be saved."""
        filename = self.save_files.pop(request.request_id, None)
        if filename is None or not _wants_save(request.kv_transfer_params):
            return False, None  # not saved (or aborted before it was scheduled): free the blocks now
        prompt = request.prompt_token_ids
        self.finished_saves[request.request_id] = Save(
            request.request_id,
            filename,
            torch.tensor(list(prompt) if prompt is not None else [], dtype=torch.long),
            list(block_ids),
        )
        return True, {"hidden_states_path": filename, VERSION_KEY: vllm.__version__}

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self.group_id < len(block_ids):  # never scheduled: no block table per group
            self.save_files.pop(request.request_id, None)
            return False, None
        return self.request_finished(request, block_ids[self.group_id])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return LAYOUT

    def get_finished_count(self) -> int | None:
        """Only tensor-parallel rank 0 writes, so each saved request is reported done once (the default would
        wait for every worker)."""
        return 1

    # -- worker side ---------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.bound_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.bound_metadata = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.tp_rank_zero = get_tensor_model_parallel_rank() == 0
        name = _hidden_states_layer(self.server_config, self.cache_groups_config, list(kv_caches))
        self.hs_cache = kv_caches[name]
        if self.hs_cache.shape[2] != self.block_size:  # the views are [blocks, heads, block size, H]
            raise ValueError(
                f"eagle3_hidden_states_connector: the hidden-states cache's block size is "
                f"{self.hs_cache.shape[2]}, its group says {self.block_size}: the slots read would be wrong"
            )

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        return None  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the states are cached by the extract_hidden_states layer; they are copied once finished

    def wait_for_save(self) -> None:
        """Lock the files of the requests scheduled this step: the lock exists, held, before the client can
        learn a file's path (the answer comes at the earliest after this step)."""
        meta = self.bound_metadata
        if not self.tp_rank_zero or not self.use_lock or not isinstance(meta, HiddenStatesMetadata):
            return
        for req_id, filename in meta.new_files.items():
            if req_id not in self.held_locks:
                self.held_locks[req_id] = self._lock(filename)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Start the copies of the requests the scheduler finished; report those whose copy is done (their
        blocks may then be freed: the write goes on from host memory, and the file's lock says when it is
        over)."""
        meta = self.bound_metadata
        if isinstance(meta, HiddenStatesMetadata):
            for save in meta.saves:
                self._submit(save)
        self.finished_ids.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(self.finished_ids):
            event = self.host_copies.get(req_id)
            if event is not None and not event.query():
                continue  # the copy to the host is still running
            self.host_copies.pop(req_id, None)
            self.finished_ids.discard(req_id)
            if event is not None:
                done.add(req_id)
            fd = self.held_locks.pop(req_id, None)  # a request that finished without a save (aborted)
            if fd is not None:
                os.close(fd)
        return done or None, None

    def shutdown(self) -> None:
        """Every write that started ends before the worker exits (its file complete, its lock released)."""
        self.write_pool.shutdown(wait=True)
        for fd in self.held_locks.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.held_locks.clear()

    # -- the copy and the write ----------------------------------------------------------------------------
    def _lock(self, filename: str) -> int:
        os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)
        fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _submit(self, save: Save) -> None:
        if not self.tp_rank_zero:
            return
        if self.hs_cache is None:
            raise RuntimeError("eagle3_hidden_states_connector: no hidden-states cache was registered")
        assert save.req_id not in self.pending_writes, "another write with the same request id"
        slots = _slots(save.block_ids, self.block_size)
        n = int(save.token_ids.shape[0])
        if self.hs_cache.is_cuda:
            states, copied = self._copy_async(slots, n)
        else:  # already host memory: advanced indexing copies, so the rows are ours before the blocks go
            states, copied = _gather(self.hs_cache, slots, n).contiguous(), _Copied()
        tensors = {"hidden_states": states, "token_ids": save.token_ids.clone()}
        lock_fd = self.held_locks.pop(save.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = self._lock(save.filename)
        future = self.write_pool.submit(self._write, tensors, copied, save.filename, lock_fd)
        self.host_copies[save.req_id] = copied
        self.pending_writes[save.req_id] = future
        future.add_done_callback(partial(self._written, save.req_id))

    def _copy_async(self, slots: torch.Tensor, n: int) -> tuple[torch.Tensor, Any]:
        """Gather on a copy stream of its own (after what the compute stream has written) into pinned host
        memory, without waiting: the event says when the host copy is complete."""
        cache = self.hs_cache
        assert cache is not None
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device=cache.device)
        stream = self.copy_stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(cache.device))
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            with _sync_allowed():
                on_device = slots.to(device=cache.device, non_blocking=True)
            rows = _gather(cache, on_device, n)
            host = torch.empty(rows.shape, dtype=rows.dtype, device="cpu", pin_memory=True)
            host.copy_(rows, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
        return host, copied

    def _write(
        self, tensors: dict[str, torch.Tensor], copied: Any, filename: str, lock_fd: int | None
    ) -> None:
        """A writer thread: wait for the host copy, write the file, release its lock."""
        try:
            copied.synchronize()
            if self.fp8:
                data, metadata = _fp8_file(tensors)
                save_file(data, filename, metadata=metadata)
            else:
                save_file(tensors, filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the file is complete

    def _written(self, req_id: str, future: Future) -> None:
        self.pending_writes.pop(req_id, None)
        error = future.exception()
        if error is not None:
            logger.error("eagle3 hidden-states connector: writing %s failed: %r", req_id, error)
