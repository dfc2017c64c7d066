"""The project config: contract keys, overrides, and errors that name the key."""

from __future__ import annotations

import pytest
import yaml

from eagle3_assets.config import DOCS_CONFIG, DOCS_CONFIG_REFERENCE, ConfigError, load_config

from .support.projects import REPO, make_project, user_rows


def test_shipped_config_defines_b1_to_b8_with_contract_defaults():
    cfg = load_config(REPO / "eagle3.yaml")
    assert list(cfg.datasets) == [f"B{i}" for i in range(1, 9)]
    assert cfg.backend == "local"
    assert cfg.backends.openrouter.max_concurrency == 2000
    assert cfg.backends.openrouter.api_key_env == "OPENROUTER_API_KEY"
    assert {d.format for d in cfg.datasets.values()} == {"messages", "sharegpt", "instruction"}
    for d in cfg.datasets.values():
        assert cfg.resolve_path(d.source).exists()
        assert d.budget_tokens == 10_000_000


def test_unknown_key_is_named(tmp_path):
    path = make_project(tmp_path, {"B1": {"rows": user_rows(["hi"])}})
    raw = yaml.safe_load(path.read_text())
    raw["datasets"]["B1"]["budget_tokns"] = 5
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"unknown key 'datasets\.B1\.budget_tokns'"):
        load_config(path)


def test_unknown_top_level_key_and_bad_value_are_named(tmp_path):
    path = make_project(tmp_path, {"B1": {"rows": user_rows(["hi"])}}, storrage={"root": "x"})
    with pytest.raises(ConfigError, match="unknown key 'storrage'"):
        load_config(path)
    path = make_project(tmp_path, {"B1": {"rows": user_rows(["hi"]), "format": "alpaca"}})
    with pytest.raises(ConfigError, match=r"key 'datasets\.B1\.format'"):
        load_config(path)


def test_env_overrides(tmp_path, monkeypatch):
    path = make_project(tmp_path, {"B1": {"rows": user_rows(["hi"])}})
    monkeypatch.setenv("EAGLE3_CONFIG", str(path))
    monkeypatch.setenv("EAGLE3_BACKEND", "openrouter")
    cfg = load_config()
    assert cfg.backend == "openrouter"
    assert cfg.storage_root == tmp_path / "data"  # relative to the config file
    monkeypatch.setenv("EAGLE3_BACKEND", "vllm")
    with pytest.raises(ConfigError, match="EAGLE3_BACKEND='vllm'"):
        load_config()


def test_missing_file_and_bad_partition_key(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    path = make_project(tmp_path, {"B 1": {"rows": user_rows(["hi"])}})
    with pytest.raises(ConfigError, match="partition key"):
        load_config(path)


def test_object_store_roots_are_accepted_and_credentials_kept_out_of_the_file(tmp_path):
    storage = {"root": "s3://bucket/eagle3", "options": {"endpoint": "http://127.0.0.1:9000", "region": "x"}}
    cfg = load_config(make_project(tmp_path, {"B1": {"rows": user_rows(["hi"])}}, storage=storage))
    assert cfg.storage_is_remote and cfg.storage_root.name.startswith("s3-bucket")  # the local working copies
    storage["options"]["aws_secret_access_key"] = "oops"
    with pytest.raises(ConfigError, match="environment"):
        load_config(make_project(tmp_path, {"B1": {"rows": user_rows(["hi"])}}, storage=storage))


def test_errors_name_the_documentation_page_not_a_document_users_lack(tmp_path):
    path = make_project(tmp_path, {"B1": {"rows": user_rows(["x"])}}, storage={"root": "data", "rooot": 1})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert DOCS_CONFIG_REFERENCE in str(e.value) and "design" not in str(e.value)
    assert (REPO / DOCS_CONFIG_REFERENCE).is_file()  # the page that lists every key ships with the code
    secrets = {"root": "data", "options": {"secret_key": "x"}}
    with pytest.raises(ConfigError, match=DOCS_CONFIG):
        load_config(make_project(tmp_path, {"B1": {"rows": user_rows(["x"])}}, storage=secrets))


def test_the_key_goes_over_plain_http_only_to_loopback_or_when_allowed(tmp_path):
    def cfg(**openrouter):
        return make_project(tmp_path, {"B1": {"rows": user_rows(["x"])}}, backends={"openrouter": openrouter})

    with pytest.raises(ConfigError, match="allow_insecure_http"):
        load_config(cfg(base_url="http://10.1.2.3:8000/v1"))
    assert load_config(cfg(base_url="http://10.1.2.3:8000/v1", allow_insecure_http=True))
    assert load_config(cfg(base_url="http://127.0.0.1:8000/v1"))
    assert load_config(cfg(base_url="http://localhost:8000/v1"))
    assert load_config(cfg(base_url="https://openrouter.ai/api/v1"))


def test_remote_code_from_the_hub_must_be_pinned(tmp_path):
    from eagle3_assets.config import TargetConfig
    from eagle3_assets.core.target.loading import pin_problems

    hub = TargetConfig(tokenizer="moonshotai/Kimi-K2.5", model="moonshotai/Kimi-K2.5", trust_remote_code=True)
    assert "target.revision" in pin_problems(hub, tmp_path)[0]
    assert pin_problems(hub.model_copy(update={"revision": "4a1b2c3d"}), tmp_path) == []
    assert pin_problems(hub.model_copy(update={"trust_remote_code": False}), tmp_path) == []
    local = tmp_path / "kimi"
    local.mkdir()
    here = TargetConfig(tokenizer=str(local), model="builtin:smollm2", trust_remote_code=True)
    assert pin_problems(here, tmp_path) == []  # a local copy is what you reviewed
