"""load_tokenizer remembers the class AutoTokenizer picked for a local folder: a later process loads the same
tokenizer without reading the model config (which imports torch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_assets.core.target import loading as target
from eagle3_assets.core.target.loading import (
    _class_record_key,
    _class_record_path,
    _recorded_class,
    load_tokenizer,
)

from .conftest import REPO

PROBE = r"""
import json, sys
from eagle3_assets.core.target.chat import ChatTokenizer
from eagle3_assets.core.target.loading import load_tokenizer
tok = load_tokenizer(sys.argv[1])
chat = ChatTokenizer(tok)
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: 1 2 3\n\n  <|im_end|> x"}]
print(json.dumps({
    "torch_imported": "torch" in sys.modules,
    "class": f"{type(tok).__module__}:{type(tok).__qualname__}",
    "fingerprint": chat.fingerprint(),
    "render": chat.render(msgs, add_generation_prompt=True),
    "ids": tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False),
    "backend": tok.backend_tokenizer.to_str(),
    "special": {k: str(v) for k, v in tok.special_tokens_map.items()},
}))
"""


@pytest.fixture()
def tokenizer_folder(tmp_path, smollm2_dir, monkeypatch) -> Path:
    """The embedded model's tokenizer files (no weights) in a folder of their own, with a cache of its own."""
    folder = tmp_path / "tok"
    folder.mkdir()
    for f in smollm2_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, folder / f.name)
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    return folder


def _probe(folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(folder)], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_loads_the_remembered_class_without_torch(tokenizer_folder):
    # AutoTokenizer: reads the config (which imports torch in transformers 5) and records the class.
    first = _probe(tokenizer_folder)
    key = _class_record_key(str(tokenizer_folder), False, None)
    assert key and _class_record_path(key).exists()
    second = _probe(tokenizer_folder)
    assert not second["torch_imported"]
    # The same tokenizer: class, vocabulary and pipeline, special tokens, template, ids, fingerprint.
    assert second == {**first, "torch_imported": False}


def test_changed_files_or_remote_code_are_not_remembered(tokenizer_folder):
    ref = str(tokenizer_folder)
    load_tokenizer.cache_clear()
    load_tokenizer(ref)
    key = _class_record_key(ref, False, None)
    assert _recorded_class(key) is not None
    # Other options or an edited file are another key: AutoTokenizer decides again.
    assert _class_record_key(ref, True, None) != key
    assert _class_record_key(ref, False, "abc123") != key
    cfg = tokenizer_folder / "tokenizer_config.json"
    spec = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**spec, "model_max_length": 4096}))
    assert _class_record_key(ref, False, None) not in (None, key)
    # A tokenizer with remote code is never remembered (its class is not transformers' own).
    cfg.write_text(json.dumps({**spec, "auto_map": {"AutoTokenizer": [None, "tok.Custom"]}}))
    assert _class_record_key(ref, False, None) is None
    # Nor a hub id.
    assert _class_record_key("HuggingFaceTB/SmolLM2-135M-Instruct", False, None) is None


@pytest.mark.parametrize(
    "record",
    [
        "not json",
        '{"class": "transformers.no_such_module:Nope"}',
        '{"class": "os:system"}',  # only transformers' own classes are ever loaded from a record
        '{"other": 1}',
        "[1]",
    ],
)
def test_a_bad_record_falls_back_to_autotokenizer_and_is_rewritten(tokenizer_folder, record):
    ref = str(tokenizer_folder)
    key = _class_record_key(ref, False, None)
    path = _class_record_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record)
    assert _recorded_class(key) is None
    load_tokenizer.cache_clear()
    tok = load_tokenizer(ref)
    assert type(tok).__name__ == "TokenizersBackend" and len(tok) == 49152
    assert _recorded_class(key) is type(tok)


def test_an_unwritable_cache_only_costs_the_shortcut(tokenizer_folder, monkeypatch):
    monkeypatch.setattr(target, "_class_record_path", lambda key: Path("/proc/no-such-dir") / f"{key}.json")
    load_tokenizer.cache_clear()
    tok = load_tokenizer(str(tokenizer_folder))
    assert len(tok) == 49152
    load_tokenizer.cache_clear()
