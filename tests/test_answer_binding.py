"""What binds a stored answer to what it answers (core.generation.binding), as plain functions: the request's
fingerprints, which served names are the target's, and which stored answers still stand."""

from __future__ import annotations

import polars as pl
import pytest

from eagle3_assets.config import OpenRouterConfig, ProjectConfig, SamplingConfig, SGLangConfig
from eagle3_assets.core.generation.binding import (
    EARLIER_TURN,
    FOREIGN_MODEL,
    PROMPT_EDITED,
    PROMPT_REMOVED,
    SETTINGS_CHANGED,
    STANDING_COLUMNS,
    AnswerRules,
    openrouter_served,
    settings_fingerprint,
    settings_fingerprints,
    sglang_served,
    standing_answers,
)
from eagle3_assets.core.generation.conversations import TurnAnswer, turn_fingerprint, turn_id
from eagle3_assets.core.generation.served_models import ServedModels
from eagle3_assets.core.prompts.fingerprints import prompt_fingerprint

MODEL = "moonshotai/kimi-k2.5"


def test_the_prompt_fingerprint_is_stable_and_ignores_fields_a_message_does_not_have():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city."}]
    # A stored answer is compared with this value in later runs and later versions: it must never drift.
    assert prompt_fingerprint(msgs) == "bcf9a4a53ec8559a431576c42b676c81"
    with_nulls = [{**m, "reasoning": None, "tool_calls": None} for m in msgs]
    assert prompt_fingerprint(with_nulls) == prompt_fingerprint(msgs)
    edited = [msgs[0], {"role": "user", "content": "EDITED: Name a city."}]
    assert prompt_fingerprint(edited) != prompt_fingerprint(msgs)
    assert prompt_fingerprint([msgs[1], msgs[0]]) != prompt_fingerprint(msgs)


def test_settings_that_change_the_answer_change_the_fingerprint_and_nothing_else_does():
    base = settings_fingerprint(SamplingConfig())
    assert (
        settings_fingerprint(SamplingConfig(temperature=0.0, top_p=1.0)) == base
    )  # the defaults, spelled out
    assert settings_fingerprint(SamplingConfig(temperature=0.7)) != base
    assert settings_fingerprint(SamplingConfig(seed=3)) != base
    assert settings_fingerprint(SamplingConfig(), {"thinking": False}) != base
    assert settings_fingerprint(SamplingConfig(), knobs={"reasoning": {"enabled": True}}) != base
    # Per backend: a change to OpenRouter's knobs leaves the embedded backend's answers standing.
    cfg = ProjectConfig.model_validate({"datasets": {"B1": {"source": "x.jsonl", "format": "messages"}}})
    changed = ProjectConfig.model_validate(
        {
            "datasets": {"B1": {"source": "x.jsonl", "format": "messages"}},
            "backends": {"openrouter": {"reasoning": {"effort": "high"}}},
        }
    )
    before, after = settings_fingerprints(cfg, "B1"), settings_fingerprints(changed, "B1")
    assert before["local"] == after["local"] and before["openrouter"] != after["openrouter"]
    assert before["imported"] is None  # an import names no settings: not compared


def test_served_names_exact_aliased_or_a_local_copy_of_the_checkpoint():
    served = openrouter_served(OpenRouterConfig(model=MODEL, accepted_models=["moonshotai/kimi-k2.5-2026*"]))
    assert served.accepts(MODEL) and served.accepts("MoonshotAI/Kimi-K2.5")
    assert served.accepts("moonshotai/kimi-k2.5-20260115")  # a dated snapshot the config accepts
    assert not served.accepts("moonshotai/kimi-k2.5-20251101")  # one it does not
    assert not served.accepts("evil/other-model-7b") and not served.accepts(None) and not served.accepts("")
    assert not openrouter_served(OpenRouterConfig(model=MODEL)).accepts("moonshotai/kimi-k2.5-20260115")
    sgl = sglang_served(SGLangConfig(), "moonshotai/Kimi-K2.5")
    assert sgl.accepts("/models/Kimi-K2.5") and sgl.accepts("moonshotai/Kimi-K2.5")
    assert not sgl.accepts("/models/Kimi-K2") and not sgl.accepts("/models/Qwen3-8B")


def _rules(turns: str = "last", settings: str | None = None) -> AnswerRules:
    return AnswerRules(
        turns,
        {"openrouter": settings or settings_fingerprint(SamplingConfig()), "imported": None},
        {"openrouter": ServedModels((MODEL,))},
    )


def _prompts(rows: dict[str, list[dict]]) -> pl.DataFrame:
    return pl.DataFrame(
        {"id": list(rows), "messages": list(rows.values())},
        schema={"id": pl.String, "messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String}))},
    )


def _stored(rows: list[dict]) -> pl.DataFrame:
    base = {
        "backend": "openrouter",
        "model": MODEL,
        "settings_fingerprint": settings_fingerprint(SamplingConfig()),
        "content": "an answer",
        "reasoning": None,
    }
    return pl.DataFrame([{**base, **r} for r in rows], schema={c: pl.String for c in STANDING_COLUMNS})


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_stored_answers_stand_while_they_answer_the_prompt_as_it_stands():
    prompts = _prompts(
        {"a": user("write a haiku about the sea"), "b": user("b"), "c": user("c"), "d": user("d")}
    )
    stored = _stored(
        [
            {"id": "a", "prompt_fingerprint": prompt_fingerprint(user("write a haiku about the sea"))},
            {"id": "b", "prompt_fingerprint": prompt_fingerprint(user("b")), "model": "evil/other-model-7b"},
            {
                "id": "c",
                "prompt_fingerprint": prompt_fingerprint(user("c")),
                "settings_fingerprint": "0" * 32,
            },
            {"id": "d", "prompt_fingerprint": None},  # written before fingerprints: kept as it is
            {"id": "gone", "prompt_fingerprint": prompt_fingerprint(user("gone"))},
        ]
    )
    standing = standing_answers(prompts, stored, _rules())
    assert {k: r.kind for k, r in standing.aside.items()} == {
        "b": FOREIGN_MODEL,
        "c": SETTINGS_CHANGED,
        "gone": PROMPT_REMOVED,
    }
    assert standing.unbound == 1
    edited = _prompts({"a": user("EDITED: write a haiku about the sea")})
    assert standing_answers(edited, stored.head(1), _rules()).aside["a"].kind == PROMPT_EDITED


def test_a_set_aside_answer_that_fits_its_prompt_again_comes_back_and_a_foreign_one_never_does():
    prompts = _prompts({"a": user("a"), "b": user("b")})
    aside = _stored(
        [
            {"id": "a", "prompt_fingerprint": prompt_fingerprint(user("an older a"))},
            {"id": "a", "prompt_fingerprint": prompt_fingerprint(user("a"))},
            {"id": "b", "prompt_fingerprint": prompt_fingerprint(user("b")), "model": "evil/other-model-7b"},
        ]
    ).with_columns(aside_key=pl.Series(["a|1", "a|2", "b|1"]))
    standing = standing_answers(prompts, _stored([]), _rules(), aside)
    assert standing.restore == ["a|2"] and not standing.aside


def test_turns_all_a_conversation_edited_in_its_middle_keeps_the_turns_before_the_edit():
    source = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "source answer 1"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "source answer 2"},
        {"role": "user", "content": "three"},
    ]
    answers = [TurnAnswer("target 1", "thought 1"), TurnAnswer("target 2"), TurnAnswer("target 3")]
    rows = [
        {
            "id": turn_id("c", k),
            "prompt_fingerprint": turn_fingerprint(source, k, answers),
            "content": answers[k - 1].content,
            "reasoning": answers[k - 1].reasoning,
        }
        for k in (1, 2, 3)
    ]
    stored = _stored(rows)
    assert standing_answers(_prompts({"c": source}), stored, _rules("all")).aside == {}
    edited = [*source[:2], {"role": "user", "content": "EDITED two"}, *source[3:]]
    standing = standing_answers(_prompts({"c": edited}), stored, _rules("all"))
    assert {k: r.kind for k, r in standing.aside.items()} == {"c#t2": PROMPT_EDITED, "c#t3": EARLIER_TURN}
    # Turn 1's answer is part of turn 2's request: an answer whose reasoning differs is another history.
    assert turn_fingerprint(source, 2, answers) != turn_fingerprint(source, 2, [TurnAnswer("target 1")])


@pytest.mark.parametrize("removed", [True, False])
def test_turns_all_a_removed_or_shortened_conversation_sets_its_turns_aside(removed):
    source = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "a"}, user("two")[0]]
    answers = [TurnAnswer("t1"), TurnAnswer("t2")]
    stored = _stored(
        [{"id": turn_id("c", k), "prompt_fingerprint": turn_fingerprint(source, k, answers)} for k in (1, 2)]
    )
    prompts = _prompts({} if removed else {"c": source[:1]})
    kinds = {k: r.kind for k, r in standing_answers(prompts, stored, _rules("all")).aside.items()}
    assert kinds == ({"c#t1": PROMPT_REMOVED, "c#t2": PROMPT_REMOVED} if removed else {"c#t2": PROMPT_EDITED})
