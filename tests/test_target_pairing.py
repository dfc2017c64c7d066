"""Preflight: target.tokenizer and target.model belong together (the model's config files against the
tokenizer, and every hidden-states vLLM server's /tokenize against ours), and the shipped Kimi-K2.5 recipe.

The "Kimi" tokenizer here is the stand-in (tests/support/kimi_standin: Kimi's special ids and slow tiktoken
shape over another vocabulary) and the "Kimi-shaped" checkpoints are config files written here in Kimi-K2.5's
layout (ids under text_config, an eos list): they prove the pairing checks on a target of that shape, not on
Moonshot's real files."""

from __future__ import annotations

import json
import secrets
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eagle3_assets.config import ProjectConfig, TargetConfig, load_config
from eagle3_assets.core.target_model import pairing
from eagle3_assets.core.target_model.loading import load_tokenizer, pin_problems
from eagle3_assets.core.target_model.pairing import PAIRING_FIX, SERVER_FIX, model_pairing, pairing_preflight

from .support.fake_servers import FakeOpenRouter
from .support.kimi_standin import build_kimi_standin
from .support.projects import REPO, make_project

KEY_ENV = "EAGLE3_TEST_PAIRING_KEY"


@pytest.fixture(autouse=True)
def own_records(tmp_path, monkeypatch):
    """Remembered passes in a folder of the test's own: a verdict from another test never answers (the
    embedded model stays in the shared cache)."""
    monkeypatch.setattr(pairing, "cache_root", lambda: tmp_path / "cache")


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    return build_kimi_standin(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def kimi_tok(kimi_dir):
    return load_tokenizer(str(kimi_dir), True, None)


def kimi_shaped_checkpoint(folder: Path, kimi_tok, **text_config) -> Path:
    """A multimodal config in Kimi-K2.5's shape (ids under text_config, eos a list in generation_config.json)
    for the stand-in's ids: [BOS], [EOS], <|im_end|>, [PAD]."""
    ids = {t: kimi_tok.convert_tokens_to_ids(t) for t in ("[BOS]", "[EOS]", "<|im_end|>", "[PAD]")}
    text = {
        "vocab_size": kimi_tok.vocab_size,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["[EOS]"],
        "pad_token_id": ids["[PAD]"],
        **text_config,
    }
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text, "vision_config": {}}
    (folder / "config.json").write_text(json.dumps(config))
    generation = {"eos_token_id": [ids["[EOS]"], ids["<|im_end|>"]]}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_smollm2_tokenizer_and_smollm2_model_pass(tmp_path):
    cfg = load_config(
        make_project(tmp_path, {"B1": {"rows": [{"messages": [{"role": "user", "content": "hi"}]}]}})
    )
    assert cfg.target.tokenizer == cfg.target.model == "builtin:smollm2"
    report = pairing_preflight(cfg)
    assert report.problems == [] and report.warnings == []


def test_the_kimi_standin_tokenizer_on_the_smollm2_model_is_refused_naming_sizes_and_ids(kimi_dir, kimi_tok):
    target = TargetConfig(tokenizer=str(kimi_dir), model="builtin:smollm2", trust_remote_code=True)
    report = model_pairing(target, kimi_dir)
    [problem] = report.problems
    top = max(kimi_tok.get_vocab().values())
    assert "do not belong together" in problem and PAIRING_FIX in problem
    assert f"the tokenizer's ids reach {top}" in problem and "49152 embedding rows" in problem
    # SmolLM2's bos 1 and eos 2 against the stand-in's [BOS] and [EOS]
    assert "bos_token_id: 1," in problem and f"'[BOS]' (id {kimi_tok.bos_token_id})" in problem
    assert "eos_token_id: 2," in problem and f"'[EOS]' (id {kimi_tok.eos_token_id})" in problem


def test_a_kimi_shaped_config_passes_with_its_tokenizer_eos_list_and_text_config_included(
    tmp_path, kimi_dir, kimi_tok
):
    """Kimi's config ends sequences with [EOS] while its template ends a turn with <|im_end|>: both are
    control tokens of the tokenizer, so both pass; the ids are read from text_config."""
    model = kimi_shaped_checkpoint(tmp_path / "kimi-model", kimi_tok)
    target = TargetConfig(tokenizer=str(kimi_dir), model=str(model), trust_remote_code=True)
    assert model_pairing(target, tmp_path).problems == []
    # a model with padding rows beyond the tokenizer's ids is fine too
    padded = kimi_shaped_checkpoint(tmp_path / "padded", kimi_tok, vocab_size=kimi_tok.vocab_size + 256)
    report = model_pairing(target.model_copy(update={"model": str(padded)}), tmp_path)
    assert report.problems == [] and report.warnings == []


def test_an_ordinary_token_as_the_models_eos_is_refused_and_a_pad_one_only_warned(
    tmp_path, kimi_dir, kimi_tok
):
    ordinary = kimi_tok.convert_tokens_to_ids("hello")
    assert ordinary not in kimi_tok.all_special_ids
    model = kimi_shaped_checkpoint(tmp_path / "m", kimi_tok, eos_token_id=ordinary, pad_token_id=ordinary)
    report = model_pairing(
        TargetConfig(tokenizer=str(kimi_dir), model=str(model), trust_remote_code=True), tmp_path
    )
    [problem] = report.problems
    assert f"config.json text_config.eos_token_id: {ordinary}, an ordinary text token" in problem
    assert "'hello'" in problem
    assert any("pad_token_id" in w for w in report.warnings) and "pad_token_id" not in problem


def test_the_smollm2_tokenizer_on_a_kimi_shaped_model_is_refused(tmp_path, kimi_tok):
    """The other way round the vocabulary fits (more rows than ids) but the config's ids are past the
    tokenizer's last id."""
    model = kimi_shaped_checkpoint(tmp_path / "kimi-model", kimi_tok)
    [problem] = model_pairing(TargetConfig(model=str(model)), tmp_path).problems
    assert f"bos_token_id: {kimi_tok.bos_token_id}, past the tokenizer's last id 49151" in problem


def test_a_model_config_not_on_this_machine_is_a_could_not_check_warning_never_a_pass(tmp_path, monkeypatch):
    empty = tmp_path / "no-config"
    empty.mkdir()
    for model, why in (
        (str(empty), "has no config.json"),
        ("eagle3-tests/not-in-any-cache", "not in the Hugging Face cache"),
    ):
        report = model_pairing(TargetConfig(model=model), tmp_path)
        [warning] = report.warnings
        assert report.problems == [] and warning.startswith("could not check") and why in warning


def test_a_model_config_in_the_hub_cache_is_read_at_the_pinned_revision_without_downloading(
    tmp_path, monkeypatch, kimi_dir, kimi_tok
):
    """The hub cache's layout: snapshots/<sha>/config.json. Another revision is not on this machine."""
    from huggingface_hub import constants

    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--eagle3-tests--kimi-shaped"
    kimi_shaped_checkpoint(repo / "snapshots" / sha, kimi_tok, vocab_size=49152)  # too few rows: refused
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    target = TargetConfig(
        tokenizer=str(kimi_dir), model="eagle3-tests/kimi-shaped", trust_remote_code=True, revision=sha
    )
    [problem] = model_pairing(target, tmp_path).problems
    assert "49152 embedding rows (config.json text_config.vocab_size)" in problem
    other = model_pairing(target.model_copy(update={"revision": "f" * 40}), tmp_path)
    assert other.problems == [] and other.warnings[0].startswith("could not check")


def test_a_remembered_pass_is_keyed_by_the_models_config_so_an_edit_is_judged_again(
    tmp_path, smollm2_dir, monkeypatch
):
    model = tmp_path / "smol-model"
    model.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, model / name)
    target = TargetConfig(model=str(model))
    assert model_pairing(target, tmp_path).problems == []
    # remembered: a later check loads no tokenizer
    monkeypatch.setattr(pairing, "load_tokenizer", lambda *a: pytest.fail("the pass was not remembered"))
    assert model_pairing(target, tmp_path).problems == []
    monkeypatch.undo()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 32000}))
    [problem] = model_pairing(target, tmp_path).problems
    assert "32000 embedding rows" in problem


# -- vLLM servers
# ---------------------------------------------------------------------------------------------
class FakeTokenize:
    """A vLLM-shaped /tokenize on 127.0.0.1: `answer(body)` gives the ids; every request is kept."""

    def __init__(self, answer):
        self.requests: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                tokens = answer(body)
                data = json.dumps({"count": len(tokens), "max_model_len": 8192, "tokens": tokens}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def smol_answer(tok):
    """What a vLLM server of SmolLM2 answers: the prompt's ids, or the rendered chat's."""

    def answer(body):
        if "messages" in body:
            text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens")))["input_ids"]

    return answer


def served_config(tmp_path, base_urls: list[str]) -> ProjectConfig:
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    hidden = {"engine": "vllm", "vllm": {"base_urls": base_urls, "model": "smol"}}
    return load_config(make_project(tmp_path, {"B1": {"rows": rows}}, hidden_states=hidden))


def test_a_server_with_the_same_tokenizer_passes(tmp_path, smol_tok):
    with FakeTokenize(smol_answer(smol_tok)) as server:
        report = pairing_preflight(served_config(tmp_path, [server.base_url]))
    assert report.problems == [] and report.warnings == []
    paths = [path for path, _ in server.requests]
    assert paths == ["/tokenize", "/tokenize"]  # at the server's root, beside /v1
    prompt, chat = (body for _, body in server.requests)
    assert prompt["model"] == "smol" and prompt["add_special_tokens"] is False and "prompt" in prompt
    assert chat["messages"] and chat["add_generation_prompt"] is True


def test_a_server_with_another_tokenizer_is_refused_with_both_id_lists(tmp_path, smol_tok, kimi_tok):
    def kimi_answer(body):
        return kimi_tok(body.get("prompt", "x"), add_special_tokens=False)["input_ids"]

    with FakeTokenize(kimi_answer) as server:
        report = pairing_preflight(served_config(tmp_path, [server.base_url]))
    [problem] = report.problems
    [(_, body)] = server.requests  # once the text differs, the chat form is not asked
    ours = smol_tok(body["prompt"], add_special_tokens=False)["input_ids"]
    theirs = kimi_tok(body["prompt"], add_special_tokens=False)["input_ids"]
    assert str(ours) in problem and str(theirs) in problem and SERVER_FIX in problem
    assert server.base_url.removesuffix("/v1") in problem


def test_a_server_whose_chat_template_differs_is_a_warning(tmp_path, smol_tok):
    same = smol_answer(smol_tok)

    def other_template(body):
        return [*same(body), 2] if "messages" in body else same(body)

    with FakeTokenize(other_template) as server:
        report = pairing_preflight(served_config(tmp_path, [server.base_url]))
    assert report.problems == []
    assert any("chat template differs" in w for w in report.warnings)


def test_a_server_not_reachable_is_a_warning_not_a_pass(tmp_path, smol_tok):
    with FakeTokenize(smol_answer(smol_tok)) as up:
        down = FakeTokenize(lambda body: [])  # bound, then closed: nothing listens there
        down.server.server_close()
        report = pairing_preflight(served_config(tmp_path, [up.base_url, down.base_url]))
    assert report.problems == []
    [warning] = report.warnings
    assert warning.startswith("could not check the tokenizer of the vLLM server")
    assert down.base_url.removesuffix("/v1") in warning


# -- where preflight runs -----------------------------------------------------------------------------------
# SmolLM2's tokenizer (which passes its own preflight) on a Kimi-shaped model
def test_eagle3_preflight_reports_a_mismatch(tmp_path, kimi_tok, capsys):
    from eagle3_assets.cli import main

    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    target = {"model": str(kimi_shaped_checkpoint(tmp_path / "kimi-model", kimi_tok))}
    config = make_project(tmp_path, {"B1": {"rows": rows}}, target=target)
    assert main(["--config", str(config), "preflight"]) == 1
    out = capsys.readouterr().out
    assert "preflight failed" in out and "do not belong together" in out and PAIRING_FIX in out


def test_the_responses_step_refuses_a_mismatch_before_any_request(tmp_path, kimi_tok, monkeypatch):
    import dagster as dg

    from eagle3_assets.definitions import build_definitions

    key = "k-" + secrets.token_hex(8)
    monkeypatch.setenv(KEY_ENV, key)
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    with FakeOpenRouter(key=key) as server:
        config = make_project(
            tmp_path,
            {"B1": {"rows": rows}},
            backend="openrouter",
            backends={"openrouter": {"base_url": server.base_url, "api_key_env": KEY_ENV}},
            target={"model": str(kimi_shaped_checkpoint(tmp_path / "kimi-model", kimi_tok))},
        )
        defs = build_definitions(load_config(config), str(config))
        job = defs.resolve_implicit_global_asset_job_def()
        with dg.instance_for_test() as instance:
            result = job.execute_in_process(
                partition_key="B1",
                instance=instance,
                asset_selection=[dg.AssetKey("prompts"), dg.AssetKey("responses")],
                raise_on_error=False,
            )
        hits = list(server.hits)
    assert not result.success and hits == []
    failures = " ".join(str(e.event_specific_data.error) for e in result.all_events if e.is_step_failure)
    assert "nothing was sent" in failures and "do not belong together" in failures


# -- the shipped recipe ------------------------------------------------------------------------------------
def test_the_kimi_recipe_makes_the_documented_choices_and_refuses_its_placeholder_revision():
    path = REPO / "configs" / "kimi-k2.5.yaml"
    cfg = load_config(path)
    assert cfg.backend == "openrouter"
    router = cfg.backends.openrouter
    assert router.model == "moonshotai/kimi-k2.5" and router.reasoning and router.reasoning["enabled"]
    assert router.provider["allow_fallbacks"] is False and router.provider["order"]
    assert cfg.target.tokenizer == cfg.target.model == "moonshotai/Kimi-K2.5" and cfg.target.trust_remote_code
    assert cfg.hidden_states.engine == "vllm" and cfg.acceptance.engine == "vllm"
    assert cfg.acceptance.vllm.tensor_parallel_size == 8
    served = cfg.hidden_states.vllm  # each extraction step starts its own server on a whole node
    assert served.managed and served.replicas >= 2 and served.tensor_parallel_size == 8
    assert cfg.storage_is_remote and not any("secret" in k or "key" in k for k in cfg.storage.options)
    assert [*cfg.datasets] == [f"B{i}" for i in range(1, 9)]
    for key, ds in cfg.datasets.items():
        assert ds.max_tokens >= 16384 and ds.budget_usd and ds.budget_tokens, key
        assert cfg.resolve_path(ds.source).resolve() == REPO / "prompts" / f"{key}.jsonl"
    [problem] = pin_problems(cfg.target, cfg.base_dir)
    assert cfg.target.revision in problem and "replace it with the commit hash" in problem


def test_placeholder_revisions_are_refused_and_commit_hashes_kept(tmp_path):
    hub = TargetConfig(tokenizer="moonshotai/Kimi-K2.5", model="moonshotai/Kimi-K2.5", trust_remote_code=True)
    for placeholder in ("REPLACE-WITH-A-COMMIT-SHA", "<sha>", "your-commit-here", "TODO"):
        [problem] = pin_problems(hub.model_copy(update={"revision": placeholder}), tmp_path)
        assert "placeholder" in problem and "replace it with the commit hash" in problem
    assert pin_problems(hub.model_copy(update={"revision": "a" * 40}), tmp_path) == []
    # without remote code a placeholder still names a revision that does not exist on the hub
    plain = hub.model_copy(update={"trust_remote_code": False, "revision": "REPLACE-WITH-A-COMMIT-SHA"})
    assert pin_problems(plain, tmp_path)
    # local folders: the revision is not used
    local = tmp_path / "copy"
    local.mkdir()
    here = TargetConfig(tokenizer=str(local), model=str(local), trust_remote_code=True, revision="REPLACE-ME")
    assert pin_problems(here, tmp_path) == []
