"""The generation engine run in process against an OpenRouter-shaped server on loopback: the dataset it
reads, the settings it runs with, and what it stored. Shared by the engine, limit, robustness and tokenizer
tests and by `bench engine`."""

from __future__ import annotations

import functools

import polars as pl

from eagle3_assets.config import BUILTIN_SMOLLM2, DatasetConfig, OpenRouterConfig, SamplingConfig, load_config
from eagle3_assets.core.generation.binding import local_model_name, local_served, settings_fingerprint
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.run import GenerationPlan, generate_responses
from eagle3_assets.core.prompts.fingerprints import prompt_fingerprint
from eagle3_assets.core.prompts.ingest import write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.tables import FAILURE_SCHEMA, RESPONSE_SCHEMA, JournalTable
from eagle3_assets.core.target_model.chat import ChatTokenizer
from resources import Target
from resources.inference.openrouter import OpenRouterBackend

from .projects import REPO, user_rows, write_jsonl

KEY_ENV = "EAGLE3_TEST_OPENROUTER_KEY"
KEY = "test-key-" + "x" * 24
# The embedded target's name as its answers carry it, and the names an import of its answers may give.
SMOLLM2 = local_model_name(BUILTIN_SMOLLM2)
IMPORTED_AS_TARGET = local_served(BUILTIN_SMOLLM2)


@functools.cache
def shipped_target_tokenizer() -> ChatTokenizer:
    """The shipped target's tokenizer (eagle3.yaml's), loaded at its first use: an OpenRouter backend counts
    every answer with it."""
    return Target(load_config(REPO / "eagle3.yaml")).deferred_chat_tokenizer()


def make_plan(
    key: str, max_tokens: int, budget_tokens: int, budget_usd: float | None = None, sampling=None, **run
) -> GenerationPlan:
    """A generation plan for a dataset section written in code (tests and benchmarks)."""
    ds = DatasetConfig(
        source="(in code)",
        format="messages",
        max_tokens=max_tokens,
        budget_tokens=budget_tokens,
        budget_usd=budget_usd,
    )
    return GenerationPlan(key, ds, sampling or SamplingConfig(), **run)


def dataset(tmp_path, texts: list[str], key: str = "B1") -> DatasetLayout:
    layout = DatasetLayout(tmp_path / "data", key).ensure()
    src = write_jsonl(tmp_path / f"{key}.jsonl", user_rows(texts))
    write_prompts(src, layout, DatasetConfig(source=str(src), format="messages"))
    return layout


def run(
    layout,
    server,
    chat,
    *,
    budget_tokens=10_000_000,
    budget_usd=None,
    concurrency=64,
    retries=4,
    max_tokens=100,
    **resource,
):
    cfg = OpenRouterConfig(
        base_url=server.base_url,
        api_key_env=KEY_ENV,
        max_concurrency=concurrency,
        max_retries=retries,
        request_timeout_s=resource.pop("timeout", 30),
        **resource,
    )
    plan = make_plan(layout.key, max_tokens, budget_tokens, budget_usd)
    settings = fast_settings(
        concurrency, retries, backoff_max_s=0.1, flush_interval_s=0.2, progress_interval_s=0.5
    )
    return generate_responses(layout, plan, OpenRouterBackend(cfg, chat), chat, settings, log=lambda m: None)


def fast_settings(concurrency: int, retries: int, **kw) -> EngineSettings:
    """Engine settings with the tests' short backoffs and flushes; any other field passed through `kw`."""
    kw = {"backoff_base_s": 0.02, "fatal_grace_s": 2, **kw}
    return EngineSettings(max_concurrency=concurrency, max_retries=retries, **kw)


def drive(
    layout, base_url, chat, *, concurrency, budget_tokens=10**12, max_tokens=512, stream=True, retries=4, **kw
):
    """`run` with the limit tests' settings: streaming by default, a roomy budget, and any `EngineSettings`
    field passed through `kw`."""
    cfg = OpenRouterConfig(
        base_url=base_url,
        api_key_env=KEY_ENV,
        model=kw.pop("model", "sim/model"),
        max_concurrency=concurrency,
        stream=stream,
        reasoning=None,
        request_timeout_s=60,
    )
    plan = make_plan(layout.key, max_tokens, budget_tokens, kw.pop("budget_usd", None))
    kw = {"backoff_max_s": 0.2, "flush_interval_s": 0.5, "progress_interval_s": 1.0, **kw}
    settings = fast_settings(concurrency, retries, **kw)
    return generate_responses(layout, plan, OpenRouterBackend(cfg, chat), chat, settings, log=lambda m: None)


def stored(layout):
    return (
        JournalTable(layout.responses_dir, RESPONSE_SCHEMA).read(),
        JournalTable(layout.failures_dir, FAILURE_SCHEMA).read(keep="last"),
    )


def assert_all_answered(layout, n: int, summary) -> None:
    responses, failures = stored(layout)
    assert responses.height == n == responses["id"].n_unique()
    assert failures.height == 0, failures.head(5)
    assert summary.report.unanswered == 0


class NeverCalledBackend:
    """A backend whose every use fails the test: a run with nothing to do must not start or contact it."""

    name = "openrouter"
    model = "m"
    wants_prompt_ids = False
    served = None

    async def start(self):
        raise AssertionError("a finished partition must not start the backend")

    async def preflight(self):
        raise AssertionError("a finished partition must not contact the backend")

    async def complete(self, request):
        raise AssertionError("nothing may be sent")

    async def close(self):
        pass


def write_finished_partition(root, n: int) -> DatasetLayout:
    """A dataset of n prompts, every one answered, written column-wise (as a 100k-prompt run leaves it)."""
    layout = DatasetLayout(root, "B9").ensure()
    ids = [f"id{i:07d}" for i in range(n)]
    messages = [[{"role": "user", "content": f"q{i}"}] for i in range(n)]
    fingerprints = [prompt_fingerprint(m) for m in messages]
    pl.DataFrame(
        {"id": ids, "messages": messages, "fingerprint": fingerprints},
        schema={
            "id": pl.String,
            "messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
            "fingerprint": pl.String,
        },
    ).write_parquet(layout.prompts)
    cols = {k: [None] * n for k in RESPONSE_SCHEMA}
    cols.update(
        id=ids,
        backend=["openrouter"] * n,
        model=["m"] * n,
        content=["a"] * n,
        finish_reason=["stop"] * n,
        completion_tokens=[10] * n,
        prompt_tokens=[5] * n,
        prompt_fingerprint=fingerprints,
        settings_fingerprint=[settings_fingerprint(SamplingConfig())] * n,
    )
    JournalTable(layout.responses_dir, RESPONSE_SCHEMA).append(pl.DataFrame(cols, schema=RESPONSE_SCHEMA))
    return layout
