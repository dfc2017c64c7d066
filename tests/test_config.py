"""The project config: contract keys, overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eagle3_assets.config import DOCS_CONFIG, DOCS_CONFIG_REFERENCE, ConfigError, load_config

from .support.projects import REPO, make_project, user_rows, write_jsonl


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
    from eagle3_assets.core.target_model.loading import pin_problems

    hub = TargetConfig(tokenizer="moonshotai/Kimi-K2.5", model="moonshotai/Kimi-K2.5", trust_remote_code=True)
    assert "target.revision" in pin_problems(hub, tmp_path)[0]
    assert pin_problems(hub.model_copy(update={"revision": "4a1b2c3d"}), tmp_path) == []
    assert pin_problems(hub.model_copy(update={"trust_remote_code": False}), tmp_path) == []
    local = tmp_path / "kimi"
    local.mkdir()
    here = TargetConfig(tokenizer=str(local), model="builtin:smollm2", trust_remote_code=True)
    assert pin_problems(here, tmp_path) == []  # a local copy is what you reviewed


HOSTILE_KEYS = [
    "..",
    ".",
    "a/b",
    "../x",
    "/etc",
    "/tmp/x",
    "C:\\x",
    "a\\b",
    ".hidden",
    "-x",
    "B1\n",
    "a b",
    "a\x00b",
    "a..b",
    "a...b",
    "x" * 65,
    "data_value",
    "",
]


def _config_with_key(root: Path, key: str, storage_root: str) -> Path:
    """A config whose one dataset has the hostile `key`; its source is a safe path whatever the key (a helper
    that names the file after the key would write outside the test's folder)."""
    write_jsonl(root / "prompts" / "ok.jsonl", user_rows(["hi"]))
    cfg = {
        "storage": {"root": storage_root},
        "datasets": {key: {"source": "prompts/ok.jsonl", "format": "messages"}},
    }
    path = root / "eagle3.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("storage_root", ["data", "s3://bucket/eagle3"])
@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=repr)
def test_dataset_keys_that_could_leave_the_root_are_refused_at_load(tmp_path, key, storage_root):
    """A key is a folder under storage.root (a local folder or an object-store prefix): `..` would put the
    partition in the root's parent, an absolute path anywhere; each is refused at load, naming the key."""
    with pytest.raises(ConfigError) as e:
        load_config(_config_with_key(tmp_path, key, storage_root))
    assert "datasets" in str(e.value) and f"dataset key {key!r}" in str(e.value)


def test_keys_differing_only_in_case_are_refused_and_ordinary_keys_load(tmp_path):
    path = make_project(tmp_path, {"b1": {"rows": user_rows(["x"])}, "B1": {"rows": user_rows(["y"])}})
    with pytest.raises(ConfigError, match="only in case"):
        load_config(path)
    keys = ["B1", "alpaca-gpt4.v2", "x_1", "7", "a" * 64]
    cfg = load_config(make_project(tmp_path, {k: {"rows": user_rows(["x"])} for k in keys}))
    assert list(cfg.datasets) == keys


def test_every_key_the_rule_accepts_is_a_dagster_partition_key_and_a_folder_inside_the_root(tmp_path):
    """The rule is stricter than Dagster's (which refuses `...`, `,`, `|`, brackets and control characters):
    whatever it accepts makes a valid StaticPartitionsDefinition and a folder strictly inside the root."""
    import dagster as dg

    from eagle3_assets.config import dataset_key_problem
    from eagle3_assets.core.storage.layout import DatasetLayout

    candidates = [*HOSTILE_KEYS, "B1", "a.b", "a-b_c", "a,b", "a|b", "[a]", "a\tb", "é", "a" * 64, "1.0"]
    accepted = [k for k in candidates if dataset_key_problem(k) is None]
    # (`data_value` is a good folder name: the config refuses it as reserved, the layout need not.)
    assert accepted == ["data_value", "B1", "a.b", "a-b_c", "a" * 64, "1.0"]
    assert dg.StaticPartitionsDefinition(accepted).get_partition_keys() == accepted
    for key in accepted:
        folder = DatasetLayout(tmp_path, key).dir.resolve()
        assert folder.parent == tmp_path.resolve() and folder.name == key


@pytest.mark.parametrize("key", ["..", ".", "../x", "/etc", "a/b"])
def test_layouts_and_object_store_copies_refuse_a_key_outside_the_root(tmp_path, key):
    """Defence in depth: a key that never went through the config (a CLI argument, a run's partition key)
    cannot build a partition path outside a local root, or an object key outside the store's prefix."""
    from eagle3_assets.core.storage.layout import DatasetLayout
    from eagle3_assets.core.storage.remote import RemoteRoot

    with pytest.raises(ValueError, match="dataset key"):
        DatasetLayout(tmp_path / "data", key)
    remote = RemoteRoot("memory://", {}, tmp_path / "cache")
    with pytest.raises(ValueError, match="dataset key"):
        remote.pull(key, ["prompts.parquet"])
    with pytest.raises(ValueError, match="dataset key"):
        remote.lease(key, "a test")
    assert not (tmp_path / "x").exists() and not (tmp_path / "cache" / "x").exists()
