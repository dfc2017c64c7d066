"""The project config: contract keys, overrides, and errors that name the key."""

from __future__ import annotations

import pytest
import yaml

from eagle3_assets.config import ConfigError, load_config

from .conftest import REPO, make_project, user_rows


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


def test_object_store_urls_are_refused_with_the_alternative(tmp_path):
    path = make_project(tmp_path, {"B1": {"rows": user_rows(["hi"])}}, storage={"root": "s3://bucket/eagle3"})
    with pytest.raises(ConfigError, match=r"key 'storage\.root'.*mounted shared volume"):
        load_config(path)
