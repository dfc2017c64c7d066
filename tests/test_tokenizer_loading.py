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

from eagle3_assets.core.target_model import loading as target
from eagle3_assets.core.target_model.loading import (
    _class_record_path,
    _recorded_class,
    load_tokenizer,
    tokenizer_files_key,
)

from .support.engine_runs import KEY, KEY_ENV
from .support.fake_servers import FakeOpenRouter
from .support.projects import REPO, make_project

PROBE = r"""
import json, sys
from eagle3_assets.core.target_model.chat import ChatTokenizer
from eagle3_assets.core.target_model.loading import load_tokenizer
tok = load_tokenizer(sys.argv[1])
chat = ChatTokenizer(tok)
msgs = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Count: 1 2 3\n\n  <|im_end|> x"},
]
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


def _run_probe(script: str, *args: object) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), KEY_ENV: KEY}
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_loads_the_remembered_class_without_torch(tokenizer_folder):
    # AutoTokenizer: reads the config (which imports torch in transformers 5) and records the class.
    first = _run_probe(PROBE, tokenizer_folder)
    key = tokenizer_files_key(str(tokenizer_folder), False, None)
    assert key and _class_record_path(key).exists()
    second = _run_probe(PROBE, tokenizer_folder)
    assert not second["torch_imported"]
    # The same tokenizer: class, vocabulary and pipeline, special tokens, template, ids, fingerprint.
    assert second == {**first, "torch_imported": False}


def test_changed_files_or_remote_code_are_not_remembered(tokenizer_folder):
    ref = str(tokenizer_folder)
    load_tokenizer.cache_clear()
    load_tokenizer(ref)
    key = tokenizer_files_key(ref, False, None)
    assert _recorded_class(key) is not None
    # Other options or an edited file are another key: AutoTokenizer decides again.
    assert tokenizer_files_key(ref, True, None) != key
    assert tokenizer_files_key(ref, False, "abc123") != key
    cfg = tokenizer_folder / "tokenizer_config.json"
    spec = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**spec, "model_max_length": 4096}))
    assert tokenizer_files_key(ref, False, None) not in (None, key)
    # A tokenizer with remote code is never remembered (its class is not transformers' own).
    cfg.write_text(json.dumps({**spec, "auto_map": {"AutoTokenizer": [None, "tok.Custom"]}}))
    assert tokenizer_files_key(ref, False, None) is None
    # Nor a hub id.
    assert tokenizer_files_key("HuggingFaceTB/SmolLM2-135M-Instruct", False, None) is None


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
    key = tokenizer_files_key(ref, False, None)
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


PREFLIGHT = r"""
import json, sys
from eagle3_assets.config import load_config
from resources import Target
problems = Target(load_config(sys.argv[1])).problems()
print(json.dumps({"problems": problems, "loaded": "transformers" in sys.modules}))
"""


def test_a_passed_preflight_is_remembered_until_the_files_or_settings_change(tokenizer_folder, tmp_path):
    def project(**target) -> Path:
        root = tmp_path / f"p{len(list(tmp_path.glob('p*')))}"
        return make_project(root, {"B1": {"rows": [{"messages": [{"role": "user", "content": "hi"}]}]}},
                            target={"tokenizer": str(tokenizer_folder), "model": str(tokenizer_folder),
                                    **target})  # fmt: skip

    config = project()
    assert _run_probe(PREFLIGHT, config) == {"problems": [], "loaded": True}
    # A later process: the same files, settings and rules passed, so no tokenizer is loaded.
    assert _run_probe(PREFLIGHT, config) == {"problems": [], "loaded": False}
    # Other template settings are asked again.
    assert _run_probe(PREFLIGHT, project(chat_template_kwargs={"x": 1}))["loaded"]
    # A failing target is never remembered: it fails, loading the tokenizer, every time.
    wrong = project(end_of_turn_id=5)
    for _ in range(2):
        verdict = _run_probe(PREFLIGHT, wrong)
        assert verdict["loaded"] and "end_of_turn_id 5" in verdict["problems"][0]
    # An edited tokenizer file is another key: asked again.
    cfg = tokenizer_folder / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_max_length": 4096}))
    assert _run_probe(PREFLIGHT, config) == {"problems": [], "loaded": True}


GENERATE = r"""
import json, sys
from pathlib import Path
from eagle3_assets.core.target_model.chat import ChatRecipe, DeferredChat
from tests.support.engine_runs import dataset, run, stored

class Server:
    base_url = sys.argv[2]

chat = DeferredChat(ChatRecipe(sys.argv[1]))
layout = dataset(Path(sys.argv[3]), sys.argv[4:])
run(layout, Server, chat, concurrency=4, stream=True)
loaded = "transformers" in sys.modules
responses, failures = stored(layout)
print(json.dumps({
    "loaded": loaded,
    "answers": responses.height,
    "failures": failures.height,
    "counts": [
        (
            r["completion_tokens"],
            r["counted_completion_tokens"],
            chat.count_tokens((r["reasoning"] or "") + r["content"]),
        )
        for r in responses.iter_rows(named=True)
    ],
}))
"""


def test_a_step_that_sends_text_counts_every_answer_with_the_tokenizer_it_loads_while_the_first_are_out(
    tokenizer_folder, tmp_path
):
    """The responses step's tokenizer is deferred, then loaded in a worker thread when the run starts, so the
    first requests do not wait for it; every answer is counted with it, with usage or without (the budget
    charges the larger count), never as 0."""
    with FakeOpenRouter(key=KEY) as server:
        plain = _run_probe(GENERATE, tokenizer_folder, server.base_url, tmp_path / "a", "hello", "world")
        counted = _run_probe(
            GENERATE, tokenizer_folder, server.base_url, tmp_path / "b", "no usage [[nousage]]"
        )
    assert plain["loaded"] and plain["answers"] == 2 and plain["failures"] == 0
    assert all(ours == recounted > 0 for _, ours, recounted in plain["counts"])
    assert counted["loaded"] and counted["answers"] == 1 and counted["failures"] == 0
    [(stored_tokens, ours, recounted)] = counted["counts"]
    assert stored_tokens == ours == recounted > 0  # no usage: our count is the charge
