"""The extraction backend for vLLM servers running `extract_hidden_states` with a hidden-states connector.

One request per sample: `/v1/completions` with the sample's ids as the prompt, one generated token,
`return_token_ids` (the server's `prompt_token_ids` must equal what was sent: a server that re-tokenized or
cut the prompt would store states for other tokens) and `kv_transfer_params.save_hidden_states` (the project's
connector writes only for requests that ask). The answer names a safetensors file (`hidden_states` [T, n_ids,
H], `token_ids` [T]) that is complete once its `.lock` can be locked shared. The backend waits for that, reads
it, checks it, removes it (a 10M-token partition must not leave terabytes behind) and returns the states as
the answer's payload. A file that is missing, late, truncated or holds other ids is a retried fault, never a
sample.

Engine versions: before it extracts, the backend asks every replica for its vLLM version (`GET /version`).
On a version no test of this project ran (`cpu_build.TESTED_VLLM_VERSIONS`) it logs a warning naming it and
the tested ones, and checks one known sample from that replica against pieces of the checkpoint
(`self_check.py`); only a failed check refuses (`SelfCheckFailed`, nothing extracted). Each answer names the
version that wrote its file (the connector's `kv_transfer_params.vllm_version`): one from a version neither
tested nor checked in this run (an upgraded replica behind the same address) is a retried fault, never a
sample.

Replicas: `base_urls` are data-parallel servers; each request goes to the one with the fewest requests in
flight. `max_concurrency` bounds the requests at the servers; the engine keeps up to twice as many going, so
that waiting for a file (the server writes it after it answers) never leaves a server slot idle. Request ids
carry the partition (`e3.<partition>.<sample hash>`), so files whose answers never arrived (a cut connection)
are removed when the run ends, and those a killed run left behind when the next one starts (`sweep_orphans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_assets.config import VllmExtractionConfig
from eagle3_assets.core.generation.protocol import (
    Completion,
    CompletionRequest,
    ErrorKind,
    InferenceError,
    describe,
)
from eagle3_assets.core.hidden_states.fp8 import QuantizedStates

from ..inference.http import HttpSession, get_json, make_session, post_json
from .cpu_build import TESTED_VLLM_VERSIONS, is_tested
from .self_check import SelfCheckFailed, ServedSelfCheck, describe_verdict

OPT_IN = "save_hidden_states"  # the connector's switch (plugin/eagle3_hidden_states_connector.py)
VERSION_KEY = "vllm_version"  # the connector names its engine's version in each answer's kv_transfer_params


def request_prefix(partition: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in partition)
    return f"e3.{safe}."


class VllmHiddenStates:
    name = "vllm"
    wants_prompt_ids = True
    served = None  # the states of the served target: nothing is stored as an answer

    def __init__(
        self,
        cfg: VllmExtractionConfig,
        partition: str,
        n_layer_ids: int,
        self_check: ServedSelfCheck | None = None,
        tested_versions: tuple[str, ...] = TESTED_VLLM_VERSIONS,
        log: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.bases = [u.rstrip("/") for u in cfg.base_urls]
        self.model = cfg.model or ""
        self.prefix = request_prefix(partition)
        self.n_layer_ids = n_layer_ids  # aux layers + the last one: what each file must hold per token
        self._in_flight = dict.fromkeys(self.bases, 0)
        self._session: HttpSession | None = None
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._locks = LockWatcher()
        self._started_wall = time.time()
        self._swept: set[str] = set()
        self.files_read = 0
        self.file_bytes = 0
        self.file_wait_s = 0.0
        self.self_check = self_check  # None: a replica on an untested version is refused, nothing checks it
        self.tested_versions = tuple(tested_versions)
        self.log = log
        self.versions: dict[str, str | None] = {}  # replica -> the vLLM version it reported
        self.checked: dict[str, Any] = {}  # untested version -> the self-check's metadata (passed)

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._started_wall = time.time()
        self._sweep_once(
            Path(self.cfg.storage_path)
        )  # what a killed earlier run left, where this process sees it
        if self._session is None:
            self._session = make_session(self.cfg.request_timeout_s)
        try:
            if not self.model:
                problems = await self.preflight()
                if problems:
                    raise InferenceError(ErrorKind.BAD_REQUEST, "; ".join(problems))
            await self.verify_engines()
        except BaseException:
            await self.close()
            raise

    async def preflight(self) -> list[str]:
        """Every replica answers /v1/models and serves the same model (the configured one, if named)."""
        problems: list[str] = []
        served: set[str] = set()
        async with make_session(30) as session:
            for base in self.bases:
                try:
                    status, body = await get_json(session, f"{base}/models")
                except Exception as e:
                    problems.append(
                        f"cannot reach vLLM at {base} ({type(e).__name__}: {e}); start it (`eagle3 "
                        "vllm-serve` prints the command) or fix hidden_states.vllm.base_urls"
                    )
                    continue
                ids = [
                    str(m["id"]) for m in (body or {}).get("data", []) if isinstance(m, dict) and m.get("id")
                ]
                if status != 200 or not ids:
                    problems.append(
                        f"{base}/models answered HTTP {status} with no model; is this a vLLM server?"
                    )
                    continue
                if self.cfg.model and self.cfg.model not in ids:
                    problems.append(f"{base} serves {ids}, not hidden_states.vllm.model {self.cfg.model!r}")
                served.update(ids)
        if not problems and not self.cfg.model:
            if len(served) != 1:
                problems.append(f"the servers serve {sorted(served)}: name one in hidden_states.vllm.model")
            else:
                self.model = served.pop()
        return problems

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        # Answers that never reached us (a connection cut after the server wrote the file) left files: nothing
        # of this partition is in flight once the run ends (one run per partition at a time), so all of them
        # go.
        for folder in {*self._swept, self.cfg.storage_path}:
            sweep_orphans(Path(folder), self.prefix, time.time() + 1)

    # -- one sample -----------------------------------------------------------------------------------------
    def _pick(self) -> str:
        return min(self.bases, key=lambda b: self._in_flight[b])

    async def complete(self, request: CompletionRequest) -> Completion:
        assert self._session is not None, "start() was not called"
        return (await self._extract_on(self._pick(), request))[0]

    async def _extract_on(
        self, base: str, request: CompletionRequest, verified_only: bool = True
    ) -> tuple[Completion, str | None]:
        """One sample through `base`: its states as the answer's payload, and the vLLM version the connector
        named. `verified_only`: an answer from a version neither tested nor self-checked is a fault."""
        assert self._session is not None, "start() was not called"
        ids = request.prompt_ids or []
        tag = hashlib.blake2b(request.id.encode(), digest_size=8).hexdigest()
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
            "request_id": f"{self.prefix}{tag}.{uuid.uuid4().hex[:8]}",
            "kv_transfer_params": {OPT_IN: True},
        }
        started = time.monotonic()
        async with self._slots:  # at the servers: max_concurrency; waiting for files does not hold a slot
            self._in_flight[base] += 1
            try:
                body = await post_json(self._session, f"{base}/completions", payload)
            finally:
                self._in_flight[base] -= 1
        latency = time.monotonic() - started
        got = body.get("prompt_token_ids")
        if got is None and body.get("choices"):
            got = body["choices"][0].get("prompt_token_ids")
        params = body.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        version = params.get(VERSION_KEY)
        if not path:
            raise InferenceError(
                ErrorKind.SERVER,
                f"{base} returned no kv_transfer_params.hidden_states_path: is it started with the "
                f"extract_hidden_states method and the eagle3 connector? ({describe(body, 200)})",
                status=200,
            )
        if got != ids:
            _remove(path)
            raise InferenceError(
                ErrorKind.SERVER,
                f"the server's prompt_token_ids differ from the {len(ids)} ids sent "
                f"({'none returned' if got is None else f'{len(got)} ids'}); not stored",
                status=200,
            )
        if verified_only and version is not None and not self._verified(str(version)):
            _remove(path)
            raise InferenceError(
                ErrorKind.SERVER,
                f"{base} answered from vLLM {version}, which no test ran and this run did not self-check "
                f"(the replica reported {self.versions.get(base)} before extracting); not stored",
                status=200,
            )
        self._sweep_once(Path(path).parent)
        t0 = time.monotonic()
        states = await self._read(path, ids)
        self.file_wait_s += time.monotonic() - t0
        usage = body.get("usage") or {}
        completion = Completion(
            content="",
            finish_reason="stop",
            prompt_tokens=int(usage.get("prompt_tokens") or len(ids)),
            completion_tokens=int(usage.get("completion_tokens") or 1),
            model=self.model,
            provider=base,
            request_id=str(body.get("id")) if body.get("id") else None,
            latency_s=latency,
            payload=states,
        )
        return completion, None if version is None else str(version)

    # -- the engines' versions ------------------------------------------------------------------------------
    def _verified(self, version: str | None) -> bool:
        """A version a test ran, or one whose self-check passed in this run."""
        return is_tested(version, self.tested_versions) or (version or "").split("+")[0] in self.checked

    async def served_version(self, base: str) -> str | None:
        """The vLLM version a replica reports at `GET /version` (vLLM's own endpoint); None where it reports
        none."""
        assert self._session is not None
        root = base.removesuffix("/v1")
        try:
            status, body = await get_json(self._session, f"{root}/version")
        except Exception:
            return None
        if status != 200 or not isinstance(body, dict) or not body.get("version"):
            return None
        return str(body["version"])

    async def verify_engines(self) -> None:
        """Every replica's vLLM version; on one no test ran, a warning and the self-check of one known sample
        from that replica, which must pass before anything is extracted (`SelfCheckFailed` otherwise)."""
        tested = ", ".join(self.tested_versions) or "none"
        for base in self.bases:
            version = self.versions[base] = await self.served_version(base)
            if self._verified(version):
                self.log(f"{base} serves vLLM {version}, a version this project's tests ran")
                continue
            named = f"vLLM {version}" if version else "a vLLM that reports no version at GET /version"
            self.log(
                f"WARNING: {base} serves {named}, which no test of this project ran (tested: {tested}); "
                "checking one known sample from it against pieces of the checkpoint before extracting"
            )
            if self.self_check is None:
                raise SelfCheckFailed(
                    f"{base} serves {named}, which no test of this project ran (tested: {tested}), and no "
                    "self-check is configured to verify it; serve a tested version"
                )
            verdict, reported = await self._self_check(base, self.self_check)
            version = version or reported
            if not verdict.passed:
                failed = ", ".join(json.loads(verdict.metadata["failing"]))
                instead = (
                    f"serve a tested version (vllm=={self.tested_versions[0]}) or "
                    if tested != "none"
                    else ""
                )
                raise SelfCheckFailed(
                    f"{base} serves {named}, which no test of this project ran (tested: {tested}), and its "
                    "states of a known sample disagree with the checkpoint recomputed here "
                    f"({failed} failed: {describe_verdict(verdict)}). Nothing was extracted: {instead}fix "
                    "the server (its layer ids, its connector)"
                )
            self.checked[(version or "unknown").split("+")[0]] = verdict.metadata
            named = f"vLLM {version}" if version else named
            self.log(f"{base}: {named} passed the self-check: {describe_verdict(verdict)}")

    async def _self_check(self, base: str, check: ServedSelfCheck) -> tuple[Any, str | None]:
        """The known text continued greedily by `base`, its ids extracted through `base` like any sample, and
        the states checked against the checkpoint's pieces (in a thread)."""
        from eagle3_assets.core.target_model.pieces import CheckpointError

        assert self._session is not None
        body = await post_json(self._session, f"{base}/completions", check.generation(self.model))
        choice = (body.get("choices") or [{}])[0]
        prompt = body.get("prompt_token_ids") or choice.get("prompt_token_ids") or []
        answer = choice.get("token_ids") or []
        if not prompt or not answer:
            raise SelfCheckFailed(
                f"{base} returned no token ids for the self-check's sample: {describe(body, 200)}"
            )
        ids = [int(i) for i in [*prompt, *answer]]
        request = CompletionRequest(id="self-check", messages=[], max_tokens=1, prompt_ids=ids)
        done, reported = await self._extract_on(base, request, verified_only=False)
        try:
            verdict = await asyncio.to_thread(check.verdict, ids, len(prompt), done.payload)
        except CheckpointError as e:
            raise SelfCheckFailed(
                f"the self-check of {base} cannot run here: {e}. Put the target's checkpoint on this "
                "machine (only the embedding, the first decoder layers, the final norm and the head are "
                "read) or serve a tested version"
            ) from e
        return verdict, reported

    async def _read(self, path: str, ids: list[int]) -> Any:
        """Wait until the writer releases the file's lock, then load and check it (in a thread), then remove
        it."""
        state = await self._locks.wait(path, self.cfg.file_timeout_s)
        if state not in ("locked", "present"):
            _remove(path)
            raise InferenceError(
                ErrorKind.SERVER,
                f"the hidden-states file {path} was not complete {self.cfg.file_timeout_s:.0f} s after the "
                f"answer ({'no lock file' if state == 'missing' else 'still being written'}); is "
                "hidden_states.vllm.storage_path the server's shared_storage_path, on a volume this process "
                "sees at the same path?",
            )
        try:
            states, size = await asyncio.to_thread(_load_checked, path, ids, self.n_layer_ids)
        finally:
            _remove(path)
        self.files_read += 1
        self.file_bytes += size
        return states

    def _sweep_once(self, folder: Path) -> None:
        """Files of this partition that a killed earlier run left behind (their request ids carry the
        partition), removed the first time this run sees the folder."""
        key = str(folder)
        if key in self._swept:
            return
        self._swept.add(key)
        sweep_orphans(folder, self.prefix, self._started_wall)


class LockWatcher:
    """Waits for many connector files at once. The server writes a file in the engine step after the answer
    (tens of milliseconds on a GPU, a second on a busy CPU), so dozens wait at a time: one thread hop per tick
    looks at every pending lock, where a hop per file per poll cost more CPU than reading the files (and on a
    machine whose cores the server computes on, the client's CPU is taken from the server). The tick follows
    the waits (a tenth of their running mean, 5-50 ms): a file is seen at most a tenth of its wait late, and a
    file waits without holding a server slot, so that costs no server time."""

    def __init__(self, min_tick_s: float = 0.005, max_tick_s: float = 0.05):
        self.min_tick_s, self.max_tick_s = min_tick_s, max_tick_s
        self.mean_wait_s = 0.0
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._last: dict[str, str] = {}
        self._task: asyncio.Task | None = None

    @property
    def tick_s(self) -> float:
        return min(self.max_tick_s, max(self.min_tick_s, self.mean_wait_s / 10))

    async def wait(self, path: str, timeout_s: float) -> str:
        """'locked' (the writer let go) or 'present' (a file without a lock file); on timeout the last state
        seen: 'busy' (still locked) or 'missing'."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[path] = future
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch())
        started = time.monotonic()
        try:
            state = await asyncio.wait_for(future, timeout_s)
            self.mean_wait_s += 0.1 * (time.monotonic() - started - self.mean_wait_s)
            return state
        except TimeoutError:
            return self._last.get(path, "missing")
        finally:
            self._waiting.pop(path, None)
            self._last.pop(path, None)

    async def _watch(self) -> None:
        while self._waiting:
            paths = list(self._waiting)
            states = await asyncio.to_thread(_lock_states, paths)
            for path, state in zip(paths, states, strict=True):
                self._last[path] = state
                future = self._waiting.get(path)
                if state in ("locked", "present") and future is not None and not future.done():
                    future.set_result(state)
            await asyncio.sleep(self.tick_s)


def _lock_states(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        state = _try_shared_lock(path + ".lock")
        if state == "missing" and os.path.exists(path):
            state = "present"  # a connector without the lock protocol: the file is there
        out.append(state)
    return out


def sweep_orphans(folder: Path, prefix: str, before: float) -> int:
    """Remove this partition's connector files (and locks) last written before `before` (seconds since
    epoch)."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(f"cmpl-{prefix}"):
            continue
        try:
            if entry.stat().st_mtime < before:
                os.unlink(entry.path)
                removed += 1
        except OSError:
            pass
    return removed


def leftover_files(folder: Path, prefix: str) -> int:
    """Connector files of this partition still on disk (0 after a finished run)."""
    try:
        return sum(1 for e in os.scandir(folder) if e.name.startswith(f"cmpl-{prefix}"))
    except OSError:
        return 0


def _try_shared_lock(lock: str) -> str:
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return "missing"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return "locked"
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return "busy"
        raise
    finally:
        os.close(fd)  # the lock only said the write finished; nothing rewrites a finished file


def _load_checked(path: str, ids: list[int], n_layer_ids: int) -> tuple[Any, int]:
    from safetensors.torch import load_file

    try:
        size = os.path.getsize(path)
        data = load_file(path, device="cpu")
    except FileNotFoundError:
        raise InferenceError(ErrorKind.SERVER, f"the hidden-states file {path} does not exist") from None
    except Exception as e:  # truncated or not safetensors
        raise InferenceError(
            ErrorKind.SERVER, f"the hidden-states file {path} is unreadable ({type(e).__name__}: {e})"
        ) from None
    states, token_ids = data.get("hidden_states"), data.get("token_ids")
    if states is None or token_ids is None:
        raise InferenceError(
            ErrorKind.SERVER, f"{path} holds {sorted(data)}, not hidden_states and token_ids"
        )
    if token_ids.tolist() != ids:
        raise InferenceError(ErrorKind.SERVER, f"{path} holds the states of other token ids; not stored")
    if states.ndim != 3 or states.shape[0] != len(ids) or states.shape[1] != n_layer_ids:
        raise InferenceError(
            ErrorKind.SERVER,
            f"{path} has hidden_states of shape {list(states.shape)}, expected [{len(ids)}, {n_layer_ids}, "
            "H]: the server's eagle_aux_hidden_state_layer_ids differ from hidden_states.aux_layers",
        )
    if "hidden_states_scales" in data:
        return _quantized(path, states, data["hidden_states_scales"]), size
    return states, size


def _quantized(path: str, values: Any, scales: Any) -> QuantizedStates:
    """A file the connector wrote in FP8: its scales one per token and layer, the server's dtype from its
    metadata."""
    from safetensors import safe_open

    t, n, _ = values.shape
    if tuple(scales.shape) not in ((t, n, 1), (t, n)):
        raise InferenceError(
            ErrorKind.SERVER, f"{path} has hidden_states_scales of shape {list(scales.shape)}"
        )
    with safe_open(path, framework="pt") as f:
        source = (f.metadata() or {}).get("source_dtype", "")
    return QuantizedStates(values, scales.reshape(t, n).float(), source or "unknown")


def _remove(path: str) -> None:
    for p in (path, path + ".lock"):
        with contextlib.suppress(OSError):
            os.unlink(p)
