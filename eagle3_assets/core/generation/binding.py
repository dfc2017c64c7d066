"""What binds a stored answer to what it answers: the request as sent, the model that wrote it, the target.

Every trained token must be the target's own answer to the prompt as it stands. So each response row carries
two fingerprints, taken when the request goes out:

- `prompt_fingerprint`: the messages as sent (roles, texts, and for `turns: all` the target's own earlier
  answers with their reasoning), canonical JSON hashed; a field a message does not have is left out, so a
  new optional field never changes the fingerprints of messages without it;
- `settings_fingerprint`: what else changes the answer: the dataset's sampling (only keys set away from their
  defaults, so a new sampling option with a neutral default changes nothing), the chat-template variables
  (`target.chat_template_kwargs`: thinking on or off), and the answer-changing knobs of the backend that
  answered (OpenRouter's `reasoning` and `extra_body`, SGLang's `extra_sampling_params`). Each backend's row
  is held to its own backend's knobs, so answers another backend bought stay good.

`max_tokens` is in neither: an answer that stopped under a limit is the same answer under a higher one, and
one cut at the limit is a true prefix of it, flagged by its finish reason. The template itself belongs to the
partition's target identity (`identity`), not to each row.

A row also names the model that served it; `ServedModels` says which names are the target's for a backend.
`standing_answers` decides, under the config as it is now, which stored answers stand and why each other one
is set aside; the responses stage moves those aside (and asks their prompts again), the tokens stage never
trains them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from ...config import BUILTIN_SMOLLM2, OpenRouterConfig, ProjectConfig, SamplingConfig, SGLangConfig
from ..prompts.fingerprints import digest, prompt_fingerprint
from ..prompts.tools import RowTools
from ..target_model.tool_calls import parse_calls
from .conversations import TurnAnswer, assistant_slots, split_turn_id, turn_fingerprint
from .served_models import ServedModels

IMPORTED = "imported"  # the `backend` of rows `eagle3 import-responses` stored
SMOLLM2_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")

# Why an answer is set aside (`set_aside/`'s `aside_reason`).
PROMPT_EDITED = "prompt_edited"  # the prompt's messages are not what was sent
PROMPT_REMOVED = "prompt_removed"  # no prompt has this id any more
SETTINGS_CHANGED = "settings_changed"  # sampling, template variables or the backend's knobs changed
EARLIER_TURN = "earlier_turn_changed"  # turns: all: an earlier turn of the conversation was set aside
FOREIGN_MODEL = "foreign_model"  # served by a model the config does not accept as the target
TARGET_CHANGED = "target_changed"  # a fresh answer set for another target was started
ASKED_AGAIN = (PROMPT_EDITED, SETTINGS_CHANGED, EARLIER_TURN, FOREIGN_MODEL)  # their prompts are asked again


def settings_fingerprint(
    sampling: SamplingConfig,
    template_kwargs: Mapping[str, Any] | None = None,
    knobs: Mapping[str, Any] | None = None,
) -> str:
    """The answer-changing settings of a request besides its messages (the module docstring lists them)."""
    return digest(
        {
            "sampling": sampling.model_dump(exclude_defaults=True),
            "template": dict(template_kwargs or {}),
            "backend": dict(knobs or {}),
        }
    )


def backend_knobs(cfg: ProjectConfig) -> dict[str, dict[str, Any]]:
    """Backend name -> its answer-changing settings."""
    orr, sgl = cfg.backends.openrouter, cfg.backends.sglang
    return {
        "local": {},
        "openrouter": {"reasoning": orr.reasoning, "extra_body": orr.extra_body},
        "sglang": {"extra_sampling_params": sgl.extra_sampling_params},
    }


def settings_fingerprints(cfg: ProjectConfig, key: str) -> dict[str, str | None]:
    """Backend name -> the settings fingerprint its requests for dataset `key` carry under `cfg`; imported
    rows name no settings (None: not compared)."""
    return sampling_fingerprints(cfg, cfg.sampling_for(key))


def sampling_fingerprints(cfg: ProjectConfig, sampling: SamplingConfig) -> dict[str, str | None]:
    """As `settings_fingerprints`, for requests asked with `sampling` (a plan that is no configured dataset:
    the data_value suite)."""
    template = cfg.target.chat_template_kwargs
    out: dict[str, str | None] = {
        name: settings_fingerprint(sampling, template, knobs) for name, knobs in backend_knobs(cfg).items()
    }
    out[IMPORTED] = None
    return out


# -- the model that answered ---------------------------------------------------------------------------------
def local_model_name(model: str) -> str:
    """The name the embedded backend stores for `target.model`."""
    return SMOLLM2_NAMES[1] if model == BUILTIN_SMOLLM2 else model


def openrouter_served(cfg: OpenRouterConfig) -> ServedModels:
    return ServedModels((cfg.model,), tuple(cfg.accepted_models))


def sglang_served(cfg: SGLangConfig, target_model: str) -> ServedModels:
    own = SMOLLM2_NAMES if target_model == BUILTIN_SMOLLM2 else (target_model,)
    return ServedModels(own, tuple(cfg.accepted_models), by_basename=True)


def local_served(target_model: str) -> ServedModels:
    return ServedModels((local_model_name(target_model),))


def served_models(cfg: ProjectConfig) -> dict[str, ServedModels]:
    """Backend name -> the served names the config accepts as the target for answers of that backend (an
    import may name any of them)."""
    out = {
        "local": local_served(cfg.target.model),
        "openrouter": openrouter_served(cfg.backends.openrouter),
        "sglang": sglang_served(cfg.backends.sglang, cfg.target.model),
    }
    out[IMPORTED] = out["local"] | out["openrouter"] | out["sglang"]
    return out


# -- which stored answers stand ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AsideReason:
    kind: str
    detail: str


@dataclass
class AnswerRules:
    """What a stored answer of one dataset must match, under the config as it is now."""

    turns: str
    settings: dict[str, str | None]
    served: dict[str, ServedModels]

    @classmethod
    def from_config(cls, cfg: ProjectConfig, key: str) -> AnswerRules:
        return cls(cfg.dataset(key).turns, settings_fingerprints(cfg, key), served_models(cfg))

    @classmethod
    def for_backend(
        cls, turns: str, sampling: SamplingConfig, backend: str, served: ServedModels | None
    ) -> AnswerRules:
        """The rules of a run planned in code: the dataset's sampling and the backend's served names only."""
        return cls(
            turns,
            {backend: settings_fingerprint(sampling), IMPORTED: None},
            {backend: served} if served is not None else {},
        )

    def foreign(self, backend: str | None, model: str | None) -> str | None:
        """Why an answer of `backend` served as `model` is not the target's; None when it is (or when nothing
        is known of the backend's served names)."""
        served = self.served.get(backend or "") or self.served.get(IMPORTED)
        if served is None or served.accepts(model):
            return None
        return f"served as {model!r}, not the target (accepted for {backend}: {served.describe()})"

    def settings_differ(self, backend: str | None, fingerprint: str | None) -> bool:
        expected = self.settings.get(backend or "")
        return fingerprint is not None and expected is not None and fingerprint != expected


# The columns `standing_answers` reads of the stored answers.
STANDING_COLUMNS = [
    "id",
    "backend",
    "model",
    "prompt_fingerprint",
    "settings_fingerprint",
    "content",
    "reasoning",
    "tool_calls",
]


@dataclass
class Standing:
    """The verdict over a dataset's stored answers: those set aside, with why, and those to bring back."""

    aside: dict[str, AsideReason] = field(default_factory=dict)
    # Answers set aside earlier that fit their prompt again (a row restored, an edit undone): their keys.
    restore: list[str] = field(default_factory=list)
    # Rows written before answers carried fingerprints: kept as they are (nothing tells what they answered).
    unbound: int = 0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.aside.values():
            out[r.kind] = out.get(r.kind, 0) + 1
        return out


def _row_verdict(rules: AnswerRules, row: Mapping[str, Any], expected: str) -> AsideReason | None:
    foreign = rules.foreign(row["backend"], row["model"])
    if foreign is not None:
        return AsideReason(FOREIGN_MODEL, foreign)
    if row["prompt_fingerprint"] is not None and row["prompt_fingerprint"] != expected:
        return AsideReason(PROMPT_EDITED, "the prompt's messages changed since it was answered")
    if rules.settings_differ(row["backend"], row["settings_fingerprint"]):
        return AsideReason(
            SETTINGS_CHANGED,
            f"sampling, chat-template variables or backends.{row['backend']} knobs changed since",
        )
    return None


def _fits(rules: AnswerRules, row: Mapping[str, Any], expected: str) -> bool:
    """A set-aside answer that would stand again: fingerprints known and equal, served by the target."""
    return (
        row["prompt_fingerprint"] == expected
        and row["settings_fingerprint"] is not None
        and rules.settings.get(row["backend"] or "") in (row["settings_fingerprint"], None)
        and rules.foreign(row["backend"], row["model"]) is None
    )


def standing_answers(
    prompts: pl.DataFrame,
    stored: pl.DataFrame,
    rules: AnswerRules,
    aside: pl.DataFrame | None = None,
) -> Standing:
    """Which of `stored` (one row per id, `STANDING_COLUMNS`) no longer answer their prompt as it stands in
    `prompts` (id, messages, and `fingerprint` where prompts.parquet has it), and which answers of `aside`
    (the same columns and `aside_key`, oldest first) fit a prompt that has no standing answer."""
    out = Standing()
    out.unbound = int(stored["prompt_fingerprint"].is_null().sum()) if stored.height else 0
    if rules.turns == "all":
        messages = dict(zip(prompts["id"].to_list(), prompts["messages"].to_list(), strict=True))
        offered = RowTools.of(prompts)
        tools = {
            rid: (t, c)
            for rid, t, c in zip(prompts["id"].to_list(), offered.tools, offered.tool_choice, strict=True)
            if t is not None or c is not None
        }
        _standing_turns(messages, stored, rules, _by_id(aside), out, tools)
    else:
        _standing_prompts(with_fingerprints(prompts), stored, rules, aside, out)
    return out


def with_fingerprints(prompts: pl.DataFrame) -> pl.DataFrame:
    """(id, fingerprint) of `prompts`: the column prompts.parquet stores, computed for a file written before
    it existed."""
    if "fingerprint" in prompts.columns:
        return prompts.select("id", "fingerprint")
    fps = [prompt_fingerprint(m) for m in prompts["messages"].to_list()]
    return pl.DataFrame({"id": prompts["id"], "fingerprint": pl.Series(fps, dtype=pl.String)})


def _by_id(aside: pl.DataFrame | None) -> dict[str, list[dict[str, Any]]]:
    """Set-aside answers by id, newest first."""
    out: dict[str, list[dict[str, Any]]] = {}
    if aside is None or aside.height == 0:
        return out
    for row in reversed(aside.to_dicts()):
        out.setdefault(row["id"], []).append(row)
    return out


def _standing_prompts(
    fingerprints: pl.DataFrame,
    stored: pl.DataFrame,
    rules: AnswerRules,
    aside: pl.DataFrame | None,
    out: Standing,
) -> None:
    """turns: last, over whole columns (a resume of a million answers is a join, not a loop): removed, then
    another model, then an edited prompt, then changed settings; the few rows that fail are named one by
    one."""
    if stored.height:
        foreign = {
            (b, m): why
            for b, m in stored.select("backend", "model").unique().iter_rows()
            if (why := rules.foreign(b, m)) is not None
        }
        pair = pl.concat_str(pl.col("backend").fill_null(""), pl.col("model").fill_null(""), separator="\x1f")
        foreign_pairs = pl.Series([f"{b or ''}\x1f{m or ''}" for b, m in foreign], dtype=pl.String)
        settings = pl.col("backend").replace_strict(
            {k: v for k, v in rules.settings.items() if v is not None}, default=None, return_dtype=pl.String
        )
        verdicts = (
            stored.join(fingerprints.rename({"fingerprint": "expected"}), on="id", how="left")
            .with_columns(
                pl.when(pl.col("expected").is_null())
                .then(pl.lit(PROMPT_REMOVED))
                .when(pair.is_in(foreign_pairs.implode()))
                .then(pl.lit(FOREIGN_MODEL))
                .when(
                    pl.col("prompt_fingerprint").is_not_null()
                    & (pl.col("prompt_fingerprint") != pl.col("expected"))
                )
                .then(pl.lit(PROMPT_EDITED))
                .when(
                    pl.col("settings_fingerprint").is_not_null()
                    & (pl.col("settings_fingerprint") != settings)
                )
                .then(pl.lit(SETTINGS_CHANGED))
                .alias("kind")
            )
            .filter(pl.col("kind").is_not_null())
            .select("id", "backend", "model", "kind")
        )
        for rid, backend, model, kind in verdicts.iter_rows():
            out.aside[rid] = AsideReason(kind, _detail(kind, backend, foreign.get((backend, model))))
    if aside is None or aside.height == 0:
        return
    standing = set(stored["id"].to_list()) - set(out.aside)
    wanted = fingerprints.filter(pl.col("id").is_in(aside["id"].unique().implode()))
    expected = dict(wanted.iter_rows())
    for rid, rows in _by_id(aside).items():
        if rid in standing or rid not in expected:
            continue
        match = next((r for r in rows if _fits(rules, r, expected[rid])), None)
        if match is not None:
            out.restore.append(match["aside_key"])


def _detail(kind: str, backend: str | None, foreign: str | None) -> str:
    if kind == PROMPT_REMOVED:
        return "no prompt of the source has this id any more"
    if kind == FOREIGN_MODEL:
        return foreign or "served by another model than the target"
    if kind == PROMPT_EDITED:
        return "the prompt's messages changed since it was answered"
    return f"sampling, chat-template variables or backends.{backend} knobs changed since"


def _standing_turns(
    messages: dict[str, list[dict]],
    stored: pl.DataFrame,
    rules: AnswerRules,
    spare: dict[str, list[dict[str, Any]]],
    out: Standing,
    tools: dict[str, tuple[str | None, str | None]] | None = None,
) -> None:
    """turns: all. Walk each conversation from its first turn: a turn stands while its row answers the request
    rebuilt from the source and the standing earlier answers; from the first that does not, every later stored
    turn is set aside too (its request carried an answer that no longer stands)."""
    turns: dict[str, dict[int, dict[str, Any]]] = {}
    for row in stored.iter_rows(named=True):
        parsed = split_turn_id(row["id"])
        if parsed is None:
            out.aside[row["id"]] = AsideReason(PROMPT_REMOVED, "not a turn row of a `turns: all` dataset")
            continue
        turns.setdefault(parsed[0], {})[parsed[1]] = row
    spare_turns: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for rid, rows in spare.items():
        parsed = split_turn_id(rid)
        if parsed is not None and parsed[0] in messages:
            spare_turns.setdefault(parsed[0], {})[parsed[1]] = rows
    for cid in set(turns) | set(spare_turns):
        have = turns.get(cid, {})
        source = messages.get(cid)
        if source is None:
            for row in have.values():
                out.aside[row["id"]] = AsideReason(
                    PROMPT_REMOVED, "no conversation of the source has this id"
                )
            continue
        offered = (tools or {}).get(cid, (None, None))
        _walk(cid, source, have, spare_turns.get(cid, {}), rules, out, offered)


def _walk(
    cid: str,
    source: list[dict],
    have: dict[int, dict[str, Any]],
    spare: dict[int, list[dict[str, Any]]],
    rules: AnswerRules,
    out: Standing,
    offered: tuple[str | None, str | None] = (None, None),
) -> None:
    n = len(assistant_slots(source))
    answers: list[TurnAnswer] = []
    broken: AsideReason | None = None
    for k in range(1, max([n, *have]) + 1):
        row = have.get(k)
        if broken is not None:
            if row is not None:
                out.aside[row["id"]] = broken
            continue
        if k > n:
            if row is not None:
                out.aside[row["id"]] = AsideReason(PROMPT_EDITED, f"the conversation has {n} turns now")
            continue
        expected = turn_fingerprint(source, k, answers, *offered)
        verdict = None if row is None else _row_verdict(rules, row, expected)
        if row is not None and verdict is None:
            answers.append(_turn_answer(row))
            continue
        if row is not None and verdict is not None:
            out.aside[row["id"]] = verdict
        match = next((r for r in spare.get(k, []) if _fits(rules, r, expected)), None)
        if match is not None:
            out.restore.append(match["aside_key"])
            answers.append(_turn_answer(match))
            continue
        broken = AsideReason(EARLIER_TURN, f"turn {k} of the conversation no longer stands")


def _turn_answer(row: Mapping[str, Any]) -> TurnAnswer:
    return TurnAnswer(row["content"] or "", row["reasoning"], tuple(parse_calls(row.get("tool_calls"))))
