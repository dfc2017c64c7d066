"""Shared fixtures and the session's hooks: the real embedded model and tokenizer, an S3-compatible server,
the shipped defaults run once. Helpers that are not fixtures live in tests/support/. Fixtures import what they
need when first used, so that collecting one light test module stays light."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .support.projects import REPO

os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")


def pytest_configure(config: pytest.Config) -> None:
    """The project's known notices, named in one place, join pytest's own filters (which replace the
    module's)."""
    from eagle3_assets.definitions import KNOWN_NOTICES

    for message, category in KNOWN_NOTICES:
        config.addinivalue_line(
            "filterwarnings", f"ignore:{message}:{category.__module__}.{category.__qualname__}"
        )


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from eagle3_assets.core.target_model.loading import builtin_dir

    return builtin_dir("smollm2")


@pytest.fixture(scope="session")
def smol_tok(smollm2_dir):
    from eagle3_assets.core.target_model.loading import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="session")
def chat(smol_tok):
    from eagle3_assets.core.target_model.chat import ChatTokenizer

    return ChatTokenizer(smol_tok)


@pytest.fixture(scope="module")
def reference_model(smollm2_dir):
    """The embedded SmolLM2 loaded whole, in fp32 on the CPU: the independent forward that stored states are
    compared with (one per test module, freed with it)."""
    from eagle3_assets.core.target_model.loading import load_model

    return load_model(str(smollm2_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """One moto server per test module, holding `object_store.BUCKET`; yields its URL."""
    from .support.object_store import BUCKET, moto_server

    with moto_server(BUCKET) as url:
        yield url


@pytest.fixture
def aws_env(monkeypatch):
    """Credentials and region for the object-store clients (moto accepts any)."""
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)


# Older vLLM versions -> the collected tests that still need their session server (released after the last).
_VLLM_PENDING: dict[str, set[str]] = {}


def _vllm_version(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("vllm_version") if callspec is not None else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start building the training frameworks' environments in the background as soon as a test selected
    to run needs them (`@pytest.mark.consumers(...)`), the image's install (`@pytest.mark.runtime_install`)
    and the session's vLLM servers (`@pytest.mark.vllm`; the versions a test is parametrized over,
    `vllm_version`, the newest otherwise): a cold build takes minutes, the rest of the suite runs meanwhile.

    `trylast`: pytest's own selection (`-k`, `-m`, `--deselect`) has run by then, so `items` holds only the
    tests that will run and a slice of the suite pays only for its own set-up; `--collect-only` runs nothing,
    so it starts nothing (tests/test_suite_slicing.py)."""
    if config.option.collectonly:
        return
    names = {n for item in items if (m := item.get_closest_marker("consumers")) for n in m.args}
    if names:
        from .support.consumers import environments

        environments.prefetch(sorted(names))
    if any(item.get_closest_marker("runtime_install") for item in items):
        from .support import runtime_install

        runtime_install.prefetch()
    served = [item for item in items if item.get_closest_marker("vllm")]
    if served:
        from .support import vllm_server

        if vllm_server.skip_reason() is None:
            versions = [_vllm_version(item) or vllm_server.NEWEST for item in served]
            vllm_server.start_in_background(versions)  # the builds, then the servers, in the background
            for item, version in zip(served, versions, strict=True):
                if version != vllm_server.NEWEST:
                    _VLLM_PENDING.setdefault(version, set()).add(item.nodeid)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """An older vLLM version's session server stops once the last collected test that needs it has run."""
    version = _vllm_version(item)
    pending = _VLLM_PENDING.get(version or "")
    if pending is None or item.nodeid not in pending:
        return
    pending.discard(item.nodeid)
    if not pending:
        from .support import vllm_server

        vllm_server.release(str(version))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the session's vLLM servers, if a test or the hook above asked for any (a session that never
    imported the module started none)."""
    vllm_server = sys.modules.get(f"{__package__}.support.vllm_server")
    if vllm_server is not None:
        vllm_server.stop()


@dataclass
class ShippedRun:
    """B3 materialised through every asset with the shipped eagle3.yaml, unchanged."""

    root: Path
    success: bool
    failures: list[str]
    materialized: set[str]
    checks: dict  # check name -> AssetCheckEvaluation

    @property
    def layout(self):
        from eagle3_assets.core.storage.layout import DatasetLayout

        return DatasetLayout(self.root / "data", "B3")


@pytest.fixture(scope="session")
def shipped_b3(tmp_path_factory) -> ShippedRun:
    """One run of the shipped defaults for the whole session (the acceptance gate trains a draft: minutes),
    read by the shipped-defaults test and by the training frameworks' tests. Six answers keep it short (the
    gate trains on five, holds one out)."""
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import build_definitions

    root = tmp_path_factory.mktemp("shipped")
    shutil.copy(REPO / "eagle3.yaml", root / "eagle3.yaml")
    shutil.copytree(REPO / "prompts", root / "prompts")
    path = root / "eagle3.yaml"
    assert path.read_text() == (REPO / "eagle3.yaml").read_text()
    defs = build_definitions(load_config(path), str(path))
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        result = job.execute_in_process(
            partition_key="B3",
            instance=instance,
            run_config={"ops": {"responses": {"config": {"limit": 6}}}},
            raise_on_error=False,
        )
    return ShippedRun(
        root=root,
        success=result.success,
        failures=[e.message for e in result.all_events if e.is_failure],
        materialized={
            e.asset_key.to_user_string() for e in result.get_asset_materialization_events() if e.asset_key
        },
        checks={
            e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
            for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"
        },
    )
