"""The generation engine against real HTTP servers on loopback: faults per kind, cool-down, budget,
preflight."""

from __future__ import annotations

import zlib

import polars as pl
import pytest

from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.protocol import FatalRunError
from eagle3_assets.core.generation.run import PreflightError, generate_responses

from .support.engine_runs import (
    KEY,
    KEY_ENV,
    NeverCalledBackend,
    dataset,
    make_plan,
    run,
    stored,
    write_finished_partition,
)
from .support.fake_servers import FakeOpenRouter, dump_hits


@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def test_every_fault_kind_is_handled_per_its_kind(tmp_path, chat, key_env):
    retried = [
        "429",
        "429ra=0.2",
        "503",
        "503ra=0.2",
        "500",
        "502",
        "408",
        "body502",
        "body429",
        "reset",
        "malformed",
        "empty",
        "finisherror",
        "nochoices",
        "402ra=0.2",
    ]
    texts = [f"retry {f} [[{f}]]" for f in retried]
    texts += [
        "permanent [[400]]",
        "context [[ctx]]",
        "plain question",
        "two faults [[500,reset]]",
        "gives up [[500,500,500,500,500,500]]",
    ]
    layout = dataset(tmp_path, texts)
    with FakeOpenRouter(key=KEY) as server:
        summary = run(layout, server, chat, retries=3)
        responses, failures = stored(layout)
        answered = {t for t in texts if t in set(_prompts_of(layout, responses["id"]))}
        for t in [*texts[: len(retried)], "plain question", "two faults [[500,reset]]"]:
            assert t in answered, (t, dump_hits(server))
        kinds = dict(zip(_prompts_of(layout, failures["id"]), failures["error_kind"], strict=True))
        assert kinds["permanent [[400]]"] == "bad_request"
        assert kinds["context [[ctx]]"] == "context_length"
        assert kinds["gives up [[500,500,500,500,500,500]]"] == "server"
        perm = dict(zip(_prompts_of(layout, failures["id"]), failures["permanent"], strict=True))
        assert (
            perm["permanent [[400]]"]
            and perm["context [[ctx]]"]
            and not perm["gives up [[500,500,500,500,500,500]]"]
        )
        # Permanent errors are not retried; the one that gives up tried 1 + 3 retries.
        assert len(server.hits_for("permanent")) == 1 and len(server.hits_for("gives up")) == 4
        # Retry-After is honoured: the retry arrives after the delay the server asked for.
        for word in ("429ra=0.2", "503ra=0.2", "402ra=0.2"):
            hits = server.hits_for(f"retry {word}")
            assert hits[1].at - hits[0].at >= 0.19, word
        row = responses.row(0, named=True)
        assert (
            row["provider"] == "FakeProvider"
            and row["cost_usd"] > 0
            and row["reasoning"].startswith("Thinking")
        )
        assert row["model"] == "moonshotai/kimi-k2.5" and row["backend"] == "openrouter"
        assert summary.report.errors["rate_limited"] >= 3
    # Attribution headers and the key went to the server, the provider object as configured.
    h = server.hits[0]
    assert h.headers["Authorization"] == f"Bearer {KEY}" and h.headers["X-Title"] == "eagle3-assets"
    assert "HTTP-Referer" in h.headers


def _prompts_of(layout, ids) -> list[str]:
    prompts = pl.read_parquet(layout.prompts)
    by_id = {i: m[-1]["content"] for i, m in zip(prompts["id"], prompts["messages"].to_list(), strict=True)}
    return [by_id[i] for i in ids]


def test_provider_routing_and_reasoning_are_sent_as_configured(tmp_path, chat, key_env):
    layout = dataset(tmp_path, ["hello"])
    provider = {"order": ["moonshotai", "together"], "allow_fallbacks": False, "quantizations": ["fp8"]}
    with FakeOpenRouter(key=KEY) as server:
        run(layout, server, chat, provider=provider, reasoning={"effort": "high"}, extra_body={"seed": 7})
    body = server.hits[0].body
    assert body["provider"] == provider and body["reasoning"] == {"effort": "high"} and body["seed"] == 7
    assert body["max_tokens"] == 100 and body["model"] == "moonshotai/kimi-k2.5"


def test_401_stops_the_run_and_keeps_what_was_paid_for(tmp_path, chat, key_env):
    texts = [f"q{i}" for i in range(40)] + ["bad key now [[401]]"] + [f"later {i}" for i in range(200)]
    layout = dataset(tmp_path, texts)
    with FakeOpenRouter(key=KEY, latency=0.05) as server:
        with pytest.raises(FatalRunError, match="API key was rejected"):
            run(layout, server, chat, concurrency=8)
        responses, _ = stored(layout)
        sent = len(server.hits)
    assert 0 < responses.height < len(texts) - 1
    assert sent < len(texts)  # stopped long before the end
    # Everything stored was answered; nothing is lost or duplicated.
    assert responses["id"].n_unique() == responses.height


def test_402_without_retry_after_means_out_of_credits(tmp_path, chat, key_env):
    layout = dataset(tmp_path, ["a", "b [[402]]", "c"])
    with FakeOpenRouter(key=KEY) as server, pytest.raises(FatalRunError, match="out of credits"):
        run(layout, server, chat, concurrency=1)


def test_retry_after_delays_only_the_request_that_got_it(tmp_path, chat, key_env):
    texts = [f"storm {i}" for i in range(30)]
    layout = dataset(tmp_path, texts)
    with FakeOpenRouter(key=KEY, global_faults=["429ra=0.5"] * 3) as server:
        summary = run(layout, server, chat, concurrency=1, retries=0)
        hits = list(server.hits)
    refused = [h for h in hits if h.fault]
    assert len(refused) == 3
    for h in refused:
        retry = next(x for x in hits if x.prompt == h.prompt and x.attempt == h.attempt + 1)
        assert retry.at - h.at >= 0.45  # that prompt waited what the provider asked for
    # Everyone else went on meanwhile: other prompts were sent while the refused one waited for its retry.
    first = refused[0]
    retry = next(x for x in hits if x.prompt == first.prompt and x.attempt == 2)
    assert any(first.at < h.at < retry.at and h.prompt != first.prompt for h in hits)
    # Backpressure used no retry allowance (retries=0) and left nothing unanswered.
    responses, failures = stored(layout)
    assert responses.height == 30 and failures.height == 0
    assert summary.report.refused == 3 and summary.report.unanswered == 0


def test_a_closed_key_window_pauses_everyone_until_it_resets(tmp_path, chat, key_env):
    texts = [f"window {i}" for i in range(12)]
    layout = dataset(tmp_path, texts)
    with FakeOpenRouter(key=KEY, global_faults=["429window=0.8"]) as server:
        summary = run(layout, server, chat, concurrency=1, retries=0)
        hits = list(server.hits)
    first = next(h for h in hits if h.fault)
    later = [h for h in hits if h.at > first.at]
    # No request reached the server while the provider said the key's window was closed.
    assert later and min(h.at for h in later) - first.at >= 0.6
    assert summary.report.global_pauses == 1 and stored(layout)[0].height == 12


def test_budget_overshoot_stays_under_one_percent_over_thousands_of_requests(tmp_path, chat, key_env):
    texts = [f"budget {i}" for i in range(4000)]
    layout = dataset(tmp_path, texts)
    budget = 150_000
    with FakeOpenRouter(key=KEY, completion_tokens=lambda p: 20 + (zlib.crc32(p.encode()) % 200)) as server:
        summary = run(layout, server, chat, concurrency=500, budget_tokens=budget, max_tokens=220)
    responses, _ = stored(layout)
    used = int(responses["completion_tokens"].sum())
    assert summary.stop_reason == "budget"
    assert used <= budget * 1.01, used
    assert used >= budget * 0.95, used  # and the budget is used, not abandoned early
    assert responses.height < len(texts)


def test_dollar_budget(tmp_path, chat, key_env):
    layout = dataset(tmp_path, [f"usd {i}" for i in range(300)])
    with FakeOpenRouter(key=KEY, completion_tokens=100, cost_per_token=1e-4) as server:  # $0.01 a request
        run(layout, server, chat, concurrency=20, budget_usd=1.0)
    responses, _ = stored(layout)
    assert 0.9 <= responses["cost_usd"].sum() <= 1.01


def test_resume_counts_other_backends_and_sends_nothing_twice(tmp_path, chat, key_env):
    layout = dataset(tmp_path, [f"r{i}" for i in range(20)])
    with FakeOpenRouter(key=KEY) as server:
        run(layout, server, chat, concurrency=4)
        first = len(server.hits)
        summary = run(layout, server, chat, concurrency=4)
        assert len(server.hits) == first == 20 and summary.todo == 0


def test_preflight_fails_before_any_request(tmp_path, chat, monkeypatch):
    layout = dataset(tmp_path, ["x"])
    with FakeOpenRouter(key=KEY) as server:
        monkeypatch.delenv(KEY_ENV, raising=False)
        with pytest.raises(PreflightError, match="rejected the API key"):
            run(layout, server, chat)
        monkeypatch.setenv(KEY_ENV, KEY)
        with pytest.raises(PreflightError, match="not listed"):
            run(layout, server, chat, model="moonshotai/kimi-k9")
        assert server.hits == []
    with pytest.raises(PreflightError, match="cannot reach"):
        run(layout, server, chat)  # the server is gone


def test_rerunning_a_finished_100k_partition_sends_nothing(tmp_path, chat):
    layout = write_finished_partition(tmp_path / "data", 100_000)
    plan = make_plan("B9", 100, 10**9)
    summary = generate_responses(
        layout, plan, NeverCalledBackend(), chat, EngineSettings(max_concurrency=8), log=lambda m: None
    )
    assert summary.todo == 0 and summary.report is None and summary.n_responses == 100_000


class _Gate:
    """A budget whose room the test opens and closes (the dispatcher's view of it: can one more go?)."""

    def __init__(self) -> None:
        self.room = True

    def can_dispatch(self) -> bool:
        return self.room


def test_a_prompt_waiting_for_the_budget_is_not_displaced_by_a_chains_next_turn():
    """A request held back by a closed budget goes first when it reopens, even if a conversation's next turn
    arrived meanwhile: neither is dropped, and each is counted as sent once."""
    from eagle3_assets.core.generation.lanes import Lane, PendingPrompt
    from eagle3_assets.core.generation.protocol import CompletionRequest
    from eagle3_assets.core.generation.scheduler import LaneScheduler

    def req(rid: str) -> CompletionRequest:
        return CompletionRequest(rid, [{"role": "user", "content": "q"}], 8)

    budget = _Gate()
    lane = Lane("B1", [req("c1#t1"), req("c2#t1"), req("c3#t1")], 3, budget, writer=None)
    scheduler = LaneScheduler([lane], EngineSettings(max_concurrency=4))
    assert scheduler.next(0.0).request.id == "c1#t1"
    budget.room = False
    assert scheduler.next(0.0) is None and lane.held.request.id == "c2#t1"
    lane.budget_blocked = False  # the dispatcher's next pass: c1's answer landed, its second turn is queued
    lane.followups.append(PendingPrompt(req("c1#t2"), lane))
    assert scheduler.next(0.0) is None
    budget.room, lane.budget_blocked = True, False
    sent = []
    while (p := scheduler.next(0.0)) is not None:
        sent.append(p.request.id)
    assert sent == ["c2#t1", "c1#t2", "c3#t1"]
    assert lane.report.sent == 4  # c1#t1, c2#t1, c1#t2, c3#t1: each once


class _Shares:
    def __init__(self, spent: float, committed: float) -> None:
        self.spent, self.committed = spent, committed

    def spent_share(self) -> float:
        return self.spent

    def committed_share(self) -> float:
        return self.committed


@pytest.mark.parametrize(
    "spent, committed, closes",
    [
        (0.92, 0.98, True),  # the last answers in flight hold the rest: no trickle while they land
        (0.85, 0.99, False),  # a reservation still pessimistic (few answers known): the lane goes on
        (0.93, 0.95, False),  # room left beyond what is in flight
        (0.97, 0.97, True),
    ],
)
def test_a_lane_closes_out_only_when_its_budget_is_committed_and_mostly_spent(spent, committed, closes):
    from eagle3_assets.core.generation.scheduler import closing_out

    assert closing_out(_Shares(spent, committed)) is closes
