"""turns: all: every assistant turn is the target's own, answered in order as a chain, resumable
mid-conversation."""

from __future__ import annotations

import json
import secrets
import subprocess

import polars as pl
import pytest

from eagle3_assets.core.generation.conversations import (
    TurnAnswer,
    assistant_slots,
    split_turn_id,
    turn_id,
    turn_messages,
)
from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable

from .support.cli_runs import env_for, kill_once_written, materialize_cmd
from .support.engine_runs import KEY_ENV
from .support.fake_servers import FakeOpenRouter
from .support.projects import REPO, make_project, materialize_in_process


def sharegpt(cid: str, n_turns: int, trailing_user: bool = False) -> dict:
    """A ShareGPT conversation with `n_turns` assistant turns (answered by 'source' texts the target must
    never see)."""
    conv = [{"from": "system", "value": "You are terse."}]
    for k in range(1, n_turns + 1):
        conv.append({"from": "human", "value": f"{cid} question {k}"})
        conv.append({"from": "gpt", "value": f"SOURCE ANSWER {cid} {k}"})
    if trailing_user:
        conv.append({"from": "human", "value": f"{cid} question {n_turns + 1}"})
    return {"id": cid, "conversations": conv}


ROWS = [sharegpt(f"c{i}", 3 + i % 3) for i in range(12)]  # 3, 4 or 5 assistant turns each
N_TURNS = sum(3 + i % 3 for i in range(12))


def test_turn_requests_carry_the_targets_earlier_answers_never_the_sources():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "source a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "source a2"},
        {"role": "user", "content": "u3"},
    ]
    assert assistant_slots(msgs) == [2, 4, 6]
    assert turn_messages(msgs, 1, []) == msgs[:2]
    answers = [TurnAnswer("mine 1", "why 1"), TurnAnswer("mine 2")]
    assert turn_messages(msgs, 3, answers) == [
        msgs[0],
        msgs[1],
        {"role": "assistant", "content": "mine 1", "reasoning": "why 1"},
        msgs[3],
        {"role": "assistant", "content": "mine 2"},
        msgs[5],
    ]
    assert split_turn_id(turn_id("a#t9", 3)) == ("a#t9", 3)  # ids that look like turn ids stay intact
    assert split_turn_id("plain") is None
    with pytest.raises(ValueError):
        turn_messages(msgs, 3, answers[:1])


def _project(tmp_path, server=None, rows=ROWS, checks=None, openrouter=None, **ds):
    top = {"checks": checks} if checks else {}
    if server is not None:
        top = {
            "backend": "openrouter",
            **top,
            "backends": {
                "openrouter": {
                    "base_url": server.base_url,
                    "api_key_env": KEY_ENV,
                    "max_concurrency": 8,
                    **(openrouter or {}),
                }
            },
        }
    return make_project(
        tmp_path,
        {"B1": {"rows": rows, "format": "sharegpt", "turns": "all", "max_tokens": 16, **ds}},
        **top,
    )


def _materialize(path, select=("prompts", "responses")):
    return materialize_in_process(path, select)


def test_an_openai_compatible_server_answers_every_turn_with_the_targets_own_history(tmp_path, monkeypatch):
    key = "k-" + secrets.token_hex(8)
    monkeypatch.setenv(KEY_ENV, key)
    with FakeOpenRouter(key=key) as server:
        _materialize(_project(tmp_path, server))
        hits = list(server.hits)
    responses = pl.read_parquet(tmp_path / "data" / "B1" / "responses" / "*.parquet")
    assert responses.height == N_TURNS == responses["id"].n_unique()
    ids = set(responses["id"].to_list())
    for i in range(12):
        assert {turn_id(f"c{i}", k) for k in range(1, 4 + i % 3)} == {
            x for x in ids if x.startswith(f"c{i}#")
        }
    assert len(hits) == N_TURNS  # each turn sent once
    for h in hits:
        msgs = h.body["messages"]
        assert not any("SOURCE ANSWER" in m["content"] for m in msgs)  # never another model's words
        users = [m["content"] for m in msgs if m["role"] == "user"]
        assistants = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert assistants == [f"Answer to: {u}" for u in users[:-1]]  # the target's own earlier answers
        assert msgs[0] == {"role": "system", "content": "You are terse."}


def test_the_embedded_model_regenerates_every_turn_and_each_turn_is_a_token_row_as_the_model_saw_it(
    tmp_path, smol_tok
):
    rows = [sharegpt("a", 3), sharegpt("b", 4, trailing_user=True)]
    _materialize(
        _project(tmp_path, rows=rows, max_tokens=6), ("prompts", "responses", "tokens", "validation_report")
    )
    responses = pl.read_parquet(tmp_path / "data" / "B1" / "responses" / "*.parquet")
    ids = sorted([turn_id("a", k) for k in (1, 2, 3)] + [turn_id("b", k) for k in (1, 2, 3, 4, 5)])
    assert sorted(responses["id"].to_list()) == ids  # a trailing user turn is answered too
    assert responses["output_ids"].null_count() == 0 and (responses["completion_tokens"] > 0).all()

    tokens = pl.read_parquet(tmp_path / "data" / "B1" / "tokens.parquet")
    assert sorted(tokens["id"].to_list()) == ids  # a row per turn, its id naming the turn
    assert tokens["reference_match"].all()  # each turn's ids equal what the model produced
    prompts = pl.read_parquet(tmp_path / "data" / "B1" / "prompts.parquet")
    source = dict(zip(prompts["id"], prompts["messages"].to_list(), strict=True))
    answers = {r["id"]: TurnAnswer(r["content"]) for r in responses.iter_rows(named=True)}
    for row in tokens.iter_rows(named=True):
        cid, k = split_turn_id(row["id"])
        history = [answers[turn_id(cid, j)] for j in range(1, k)]
        msgs = turn_messages(source[cid], k, history)
        # The template's own rendering of what the model was asked, then exactly the ids it produced.
        seen = smol_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        want = smol_tok.encode(seen, add_special_tokens=False)
        ids_row, mask = row["input_ids"], row["loss_mask"]
        assert ids_row[: len(want)] == want
        produced = responses.filter(pl.col("id") == row["id"])["output_ids"].item().to_list()
        assert ids_row[len(want) :][: len(produced)] == produced
        assert sum(mask[: len(want)]) == 0 and all(
            mask[len(want) : len(want) + len(produced)]
        )  # this turn only

    report = json.loads((tmp_path / "data" / "B1" / "report.json").read_text())
    assert report["turns"] == {
        "total": 8,
        "answered": 8,
        "conversations_answered": 2,
        "conversations_complete": 2,
        "conversations_cut_by_template": 0,
    }
    assert report["coverage"] == 1.0 and report["n_responses"] == 8


def test_a_kill_mid_conversation_resumes_each_conversation_after_its_last_stored_turn(tmp_path):
    key = "k-" + secrets.token_hex(8)
    rows = [sharegpt(f"k{i}", 4) for i in range(40)]
    with FakeOpenRouter(key=key, latency=0.3) as server:
        config = _project(tmp_path, server, rows=rows)
        env = env_for(config, tmp_path / "dagster_home", key)
        responses_dir = tmp_path / "data" / "B1" / "responses"
        kill_once_written(materialize_cmd(), responses_dir, "part-*.parquet", 2, 120, env)
        stored = JournalTable(responses_dir, RESPONSE_SCHEMA).keys()
        assert 0 < len(stored) < 160
        mid = {split_turn_id(s)[0] for s in stored if split_turn_id(s)[1] < 4}
        assert mid, "no conversation was cut in the middle"
        before = len(server.hits)
        done = subprocess.run(
            materialize_cmd(), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        after = server.hits[before:]
    final = pl.read_parquet(responses_dir / "*.parquet")
    assert final.height == 160 == final["id"].n_unique()
    # The resumed run sent no stored turn again: turn k of a conversation is the request whose history holds
    # k-1 answers, so (conversation, k) identifies it.
    resent = {
        (
            h.body["messages"][1]["content"].split()[0],
            sum(m["role"] == "assistant" for m in h.body["messages"]) + 1,
        )
        for h in after
    }
    assert not resent & {split_turn_id(s) for s in stored}
    # and each cut conversation went on from its stored answers
    for h in after:
        msgs = h.body["messages"]
        assert [m["content"] for m in msgs if m["role"] == "assistant"] == [
            f"Answer to: {m['content']}" for m in msgs if m["role"] == "user"
        ][:-1]


def test_a_turn_that_fails_for_good_ends_its_conversation_with_a_failure_row_naming_the_turn(
    tmp_path, monkeypatch
):
    key = "k-" + secrets.token_hex(8)
    monkeypatch.setenv(KEY_ENV, key)
    bad = sharegpt("bad", 4)
    bad["conversations"][3]["value"] = "bad question 2 [[400]]"  # the second user turn is refused for good
    with FakeOpenRouter(key=key) as server:
        rows = [bad, sharegpt("ok", 3)]
        checks = {"max_failure_share": 0.6}  # one conversation of two ends early, on purpose
        _materialize(_project(tmp_path, server, rows=rows, checks=checks))
        _materialize(
            _project(tmp_path, server, rows=rows, checks=checks)
        )  # the second run sends nothing more
        hits = len(server.hits)
    responses = pl.read_parquet(tmp_path / "data" / "B1" / "responses" / "*.parquet")
    assert sorted(responses["id"].to_list()) == sorted(
        [turn_id("bad", 1)] + [turn_id("ok", k) for k in (1, 2, 3)]
    )
    failures = pl.read_parquet(tmp_path / "data" / "B1" / "failures" / "*.parquet")
    assert failures.filter(pl.col("permanent"))["id"].to_list() == [turn_id("bad", 2)]
    assert hits == 5  # bad: turns 1 and 2 (refused), never 3 or 4; ok: three turns; nothing in the second run


@pytest.fixture(scope="module")
def thinking_chats(tmp_path_factory):
    from transformers import AutoTokenizer

    from eagle3_assets.core.target_model.chat import ChatTokenizer

    from .support.kimi_standin import build_kimi_standin
    from .support.tokenizer_families import FAMILIES

    kimi = AutoTokenizer.from_pretrained(
        build_kimi_standin(tmp_path_factory.mktemp("kimi")), trust_remote_code=True
    )
    return {"qwen3": ChatTokenizer(FAMILIES["qwen3"]()), "kimi": ChatTokenizer(kimi)}


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_templates_that_drop_earlier_reasoning_get_a_row_per_turn_equal_to_their_own_rendering(
    family, thinking_chats
):
    """Qwen3 and Kimi K2.5 drop earlier turns' reasoning from the history: turn k's row is the template's own
    rendering of what the model saw when it wrote turn k (earlier reasoning gone), then turn k as written (its
    reasoning kept), loss on turn k only."""
    from eagle3_assets.core.target_model.chat import Answer

    chat = thinking_chats[family]
    source = [
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "source 1"},
        {"role": "user", "content": "Second question?"},
        {"role": "assistant", "content": "source 2"},
        {"role": "user", "content": "Third question?"},
    ]
    answers = [TurnAnswer(f"Answer {k}.", f"Thinking {k}.") for k in (1, 2, 3)]
    for k in (1, 2, 3):
        msgs = turn_messages(source, k, answers[: k - 1])
        res = chat.tokenize([(msgs, Answer(answers[k - 1].content, answers[k - 1].reasoning, True))])[0]
        history = [
            {"role": m["role"], "content": m["content"],
             **({"reasoning_content": m["reasoning"]} if m.get("reasoning") else {})}
            for m in msgs
        ]  # fmt: skip
        seen = chat.render(history, True)
        assert chat.encoder.decode(res.input_ids[: res.answer_start].tolist()) == seen
        for j in range(1, k):
            assert f"Thinking {j}." not in seen  # the template dropped the earlier reasoning
            assert f"Answer {j}." in seen  # but kept the target's own earlier answers
        written = chat.encoder.decode(res.answer_ids.tolist())
        assert f"Thinking {k}." in written and f"Answer {k}." in written and written.endswith(chat.eot_token)
        assert res.loss_mask[: res.answer_start].sum() == 0 and res.loss_mask[res.answer_start :].all()


def test_a_template_that_keeps_the_history_verbatim_gives_one_row_per_conversation(
    tmp_path, monkeypatch, smol_tok
):
    """ChatML (SmolLM2) renders every earlier turn in the final conversation as it was while being written:
    one row per conversation, named by its last turn, equal to the template's own rendering, loss on every
    target turn."""
    import numpy as np

    key = "k-" + secrets.token_hex(8)
    monkeypatch.setenv(KEY_ENV, key)
    rows = [sharegpt("v1", 3), sharegpt("v2", 4)]
    with FakeOpenRouter(key=key) as server:  # every answer finishes (stop), without reasoning
        path = _project(tmp_path, server, rows=rows, openrouter={"reasoning": None})
        _materialize(path, ("prompts", "responses", "tokens", "validation_report"))
    tokens = pl.read_parquet(tmp_path / "data" / "B1" / "tokens.parquet")
    assert sorted(tokens["id"].to_list()) == [turn_id("v1", 3), turn_id("v2", 4)]
    prompts = pl.read_parquet(tmp_path / "data" / "B1" / "prompts.parquet")
    source = dict(zip(prompts["id"], prompts["messages"].to_list(), strict=True))
    for row in tokens.iter_rows(named=True):
        cid, last = split_turn_id(row["id"])
        users = [m["content"] for m in source[cid] if m["role"] == "user"]
        answers = [TurnAnswer(f"Answer to: {u}") for u in users]
        msgs = [*turn_messages(source[cid], last, answers[: last - 1]), answers[last - 1].message()]
        want = smol_tok.encode(smol_tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)
        got = row["input_ids"]
        assert got == want[: len(got)] and len(want) - len(got) <= 1  # the template's own rendering
        mask = np.asarray(row["loss_mask"])
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        spans = list(zip(edges[::2], edges[1::2], strict=True))
        assert [smol_tok.decode(got[a:b]) for a, b in spans] == [
            f"{a.content}<|im_end|>" for a in answers[:last]
        ]
    report = json.loads((tmp_path / "data" / "B1" / "report.json").read_text())
    assert report["turns"]["answered"] == 7 and report["n_tokens_rows"] == 2


def test_reasoning_the_history_does_not_show_gives_a_row_per_turn(tmp_path, monkeypatch):
    """SmolLM2's template has no reasoning field: an earlier turn's reasoning is never shown to the model
    again, so that turn as written is not in the final conversation, and each turn gets its own row."""
    key = "k-" + secrets.token_hex(8)
    monkeypatch.setenv(KEY_ENV, key)
    with FakeOpenRouter(key=key) as server:  # answers with reasoning
        _materialize(_project(tmp_path, server, rows=[sharegpt("r", 3)]), ("prompts", "responses", "tokens"))
        history = [h.body["messages"] for h in server.hits]
    tokens = pl.read_parquet(tmp_path / "data" / "B1" / "tokens.parquet")
    assert sorted(tokens["id"].to_list()) == [turn_id("r", k) for k in (1, 2, 3)]
    assert all(
        "reasoning" not in m for msgs in history for m in msgs
    )  # not sent: the template would not show it


# -- turns the template refuses, the gate and the coverage check on turn rows
# --------------------------------------

ALTERNATING = (
    "{%- set ns = namespace(prev='') %}{%- for message in messages %}{%- if message['role'] != 'system' %}"
    "{%- if message['role'] == ns.prev %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}{%- set ns.prev = message['role'] %}{%- endif %}{%- endfor %}"
)


def _alternating_tokenizer(smollm2_dir, folder):
    """SmolLM2's tokenizer with a template that, like Mistral's and Gemma's, raises on roles that do not
    alternate."""
    import shutil

    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(
        ALTERNATING + (smollm2_dir / "chat_template.jinja").read_text()
    )
    return folder


def _check_evaluations(result) -> dict:
    return {
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }


def test_a_turn_the_template_refuses_cuts_only_its_conversation_and_is_not_a_failed_request(
    tmp_path, smollm2_dir, smol_tok
):
    """Bad input: a conversation whose later turns do not alternate as the template demands is regenerated up
    to the turn the template refuses; that turn is recorded with the reason, naming the turn; every other
    conversation goes on; and the blocking failure-share check passes (one conversation of four cut would be
    25% > 5%): the rest of a conversation that cannot be rendered is bad data, not a failed request."""
    from eagle3_assets.core.target_model.chat import ChatTokenizer

    from .support.fake_servers import FakeSGLang

    tok_dir = _alternating_tokenizer(smollm2_dir, tmp_path / "tokenizer")
    alt = sharegpt("alt", 3)
    # turn 3's request would hold two user turns in a row: the template raises
    alt["conversations"].insert(6, {"from": "human", "value": "alt question 3, asked twice"})
    rows = [alt] + [sharegpt(f"ok{i}", 3) for i in range(3)]
    eot = ChatTokenizer(smol_tok).eot_id
    with FakeSGLang(smol_tok, eot) as server:
        path = make_project(
            tmp_path,
            {"B1": {"rows": rows, "format": "sharegpt", "turns": "all", "max_tokens": 48}},
            backend="sglang",
            backends={"sglang": {"base_url": server.base_url, "max_concurrency": 8}},
            target={"tokenizer": str(tok_dir)},
        )
        result = _materialize(path, ("prompts", "responses", "tokens", "validation_report"))
        sent = len(server.generate_bodies)
    data = tmp_path / "data" / "B1"
    responses = pl.read_parquet(data / "responses" / "*.parquet")
    ok = [turn_id(f"ok{i}", k) for i in range(3) for k in (1, 2, 3)]
    assert sorted(responses["id"].to_list()) == sorted([turn_id("alt", 1), turn_id("alt", 2), *ok])
    assert sent == 11  # alt's turn 3 was never sent
    failures = pl.read_parquet(data / "failures" / "*.parquet")
    assert failures["id"].to_list() == [turn_id("alt", 3)]
    row = failures.row(0, named=True)
    assert row["error_kind"] == "template_rest" and row["permanent"]
    assert row["message"].startswith("turn 3 of 3: ") and "roles must alternate" in row["message"]
    assert "turns 1-2 answered and stored" in row["message"]

    checks = _check_evaluations(result)
    share = checks["responses_failure_share"]
    assert share.passed
    assert share.metadata["failures"].value == 0
    assert share.metadata["conversations_cut_by_template"].value == 1
    assert checks["tokens_coverage"].passed
    tokens = pl.read_parquet(data / "tokens.parquet")
    assert {split_turn_id(i)[0] for i in tokens["id"]} == {"alt", "ok0", "ok1", "ok2"}  # alt's turns trained
    report = json.loads((data / "report.json").read_text())
    assert report["turns"]["conversations_cut_by_template"] == 1
    assert report["failure_kinds"] == {"template_rest": 1}
    assert "1 cut at a turn the template refuses" in (data / "report.md").read_text()


def test_failures_that_count_toward_the_failure_share():
    """A first turn the template refuses loses the whole prompt (counted, like a request that failed for
    good); a later turn it refuses cuts a conversation answered up to it (reported, not counted)."""
    from eagle3_assets.core.report.validation import counted_failures, failure_share

    failures = pl.DataFrame(
        {
            "id": ["a#t1", "b#t3", "c", "d#t2"],
            "error_kind": ["template", "template_rest", "bad_request", "template_rest"],
        }
    )
    assert counted_failures(failures) == (2, 2)
    verdict = failure_share(2, 40, 0.05, 2)
    assert verdict.passed and verdict.metadata["conversations_cut_by_template"] == 2
    assert not failure_share(3, 40, 0.05).passed


def _turns_partition(tmp_path, chat, reasoning: bool):
    """A turns: all partition written directly (no server): conversation a answered in full, turn 1 of b cut
    by max_tokens, c with reasoning in every answer (when `reasoning`); tokens built by the tokens stage."""
    from eagle3_assets.core.storage.layout import DatasetLayout
    from eagle3_assets.core.tokens.build import build_tokens

    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    source = {}
    for cid in ("a", "b", "c"):
        msgs = [{"role": "system", "content": "You are terse."}]
        for k in (1, 2, 3):
            msgs += [
                {"role": "user", "content": f"{cid} question {k}"},
                {"role": "assistant", "content": f"SOURCE ANSWER {cid} {k}"},
            ]
        source[cid] = msgs
    pl.DataFrame(
        {
            "id": list(source),
            "messages": [m[:-1] for m in source.values()],  # the trailing assistant turn is the source answer
            "source_answer": [m[-1]["content"] for m in source.values()],
        }
    ).write_parquet(layout.prompts)
    rows = []
    for cid in source:
        for k in (1, 2, 3):
            rows.append(
                {
                    "id": turn_id(cid, k),
                    "backend": "test",
                    "content": f"Answer {k} to {cid}.",
                    "reasoning": f"Thinking {k} about {cid}." if reasoning and cid == "c" else None,
                    "finish_reason": "length" if (cid, k) == ("b", 1) else "stop",
                }
            )
    JournalTable(layout.responses_dir, RESPONSE_SCHEMA).append(
        pl.DataFrame(rows).with_columns(
            pl.lit(None, dtype=RESPONSE_SCHEMA[c]).alias(c) for c in RESPONSE_SCHEMA if c not in rows[0]
        )
    )
    build_tokens(layout, chat, log=lambda m: None, workers=1)
    return layout, source


def _qwen3_chat():
    from eagle3_assets.core.target_model.chat import ChatTokenizer

    from .support.tokenizer_families import FAMILIES

    return ChatTokenizer(FAMILIES["qwen3"]())


class _TokensReader:
    """The hidden-states reader's `sample`, from tokens.parquet (the gate's sample loading without a
    model)."""

    def __init__(self, layout):
        self.rows = {r["id"]: r for r in pl.read_parquet(layout.tokens).iter_rows(named=True)}

    def sample(self, sid):
        import torch

        r = self.rows[sid]
        return {"input_ids": torch.tensor(r["input_ids"]), "loss_mask": torch.tensor(r["loss_mask"])}


@pytest.mark.parametrize("family", ["smollm2", "qwen3"])
def test_the_acceptance_gate_loads_turn_rows_as_the_model_saw_each_turn(tmp_path, family, request):
    """The gate's samples of a turns: all partition: each row's messages are the request of its (last) turn,
    with the target's own earlier answers (their reasoning where the template has a field for it), its source
    answer the source's own text for that turn; the template rendered afresh puts every answer span where the
    token rows have it, for conversation rows (ChatML keeps the history) and per-turn rows alike."""
    from eagle3_assets.core.acceptance.samples import boundary_problems, load_samples, rendered_prompts

    chat = request.getfixturevalue("chat") if family == "smollm2" else _qwen3_chat()
    layout, source = _turns_partition(tmp_path, chat, reasoning=True)
    tokens = pl.read_parquet(layout.tokens)
    assert pl.read_parquet(layout.tokens_errors).height == 0
    marked = dict(zip(tokens["id"], tokens["all_turns"], strict=True))
    if (
        family == "smollm2"
    ):  # a kept in full: one conversation row; b (a cut turn) and c (hidden reasoning): turns
        assert marked == {"a#t3": True, **{turn_id(c, k): False for c in "bc" for k in (1, 2, 3)}}
    else:  # Qwen3 drops earlier reasoning and is not proven verbatim: a row per turn
        assert marked == {turn_id(c, k): False for c in "abc" for k in (1, 2, 3)}
    ids = sorted(marked)
    samples = load_samples(layout, ids, _TokensReader(layout), chat=chat)
    keep = chat.template_has_reasoning
    for s in samples:
        cid, k = split_turn_id(s.id)
        answers = [
            TurnAnswer(f"Answer {j} to {cid}.", f"Thinking {j} about {cid}." if cid == "c" else None)
            for j in range(1, k)
        ]
        assert s.messages == turn_messages(source[cid][:-1], k, answers, keep)
        assert s.source_answer == f"SOURCE ANSWER {cid} {k}"
        assert not any("SOURCE ANSWER" in m["content"] for m in s.messages)
    if keep:  # the template's own field carries the earlier reasoning to the template (which drops it)
        assert any(m.get("reasoning") for s in samples for m in s.messages)
    stop = {chat.eot_id, chat.tok.eos_token_id}
    assert boundary_problems(samples, rendered_prompts(chat, samples), stop) == {}
    with pytest.raises(ValueError, match=r"neither a prompt of prompts\.parquet nor a stored turn"):
        load_samples(layout, ["a#t9"], _TokensReader(layout), chat=chat)


def test_the_coverage_check_expands_only_conversation_rows(tmp_path, chat):
    """A conversation row (all_turns) covers its earlier turns; a turn's own row covers that turn only, so a
    per-turn conversation that lost an earlier turn's row is reported as not covered."""
    from eagle3_assets.core.report.validation import token_coverage, token_rows

    layout, _ = _turns_partition(tmp_path, chat, reasoning=True)
    responses = JournalTable(layout.responses_dir, RESPONSE_SCHEMA).keys()
    token_ids, conversation_rows = token_rows(layout.tokens)
    assert conversation_rows == {"a#t3"} and len(token_ids) == 7
    assert token_coverage(responses, token_ids, set(), 0.05, conversation_rows).passed
    lost = token_coverage(responses, token_ids - {"b#t1"}, set(), 0.05, conversation_rows)
    assert not lost.passed
    assert lost.metadata["without_row_or_reason"] == 1 and json.loads(lost.metadata["examples"]) == ["b#t1"]
    # the conversation row still covers a's earlier turns; without it they are missing
    assert not token_coverage(responses, token_ids - {"a#t3"}, set(), 0.05, conversation_rows).passed
    # a tokens.parquet written before rows were marked: every turn row is taken to cover its earlier turns
    legacy = tmp_path / "legacy.parquet"
    pl.read_parquet(layout.tokens).drop("all_turns").write_parquet(legacy)
    assert token_rows(legacy) == (token_ids, None)
