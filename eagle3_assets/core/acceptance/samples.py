"""The partition's samples as the gate sees them: split into training and heldout prompts by a hash of their
id, loaded with their messages and (for training) their aux states, their answer spans checked against the
template rendered afresh, and turned into the drafter's training samples."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from ...config import AcceptanceConfig
from ..hidden_states.reader import HiddenStatesReader
from ..storage.layout import DatasetLayout
from ..target_model.chat import Answer, ChatTokenizer, TemplateError
from ..target_model.tool_calls import has_tool_fields
from ..tokens.turns import row_prompts
from .measure import FeatureSource, PromptSet


@dataclass
class GateSample:
    id: str
    messages: list[dict[str, Any]]
    input_ids: np.ndarray
    loss_mask: np.ndarray
    source_answer: str | None = None
    aux: Any = None  # the auxiliary hidden states (torch), kept for the samples the draft trains on
    tools: list[dict[str, Any]] | None = None  # the tools the prompt offers (rendered into it)


def split_ids(ids: Sequence[str], n_train: int, n_heldout: int) -> tuple[list[str], list[str]]:
    """(train, heldout) ids, ordered by a hash of the id: stable, and independent of how rows are stored."""
    order = sorted(ids, key=lambda i: hashlib.blake2b(i.encode(), digest_size=8).digest())
    heldout = min(n_heldout, max(1, len(order) // 4)) if len(order) >= 2 else 0
    return order[heldout : heldout + n_train], order[:heldout]


def answer_span(mask: np.ndarray) -> tuple[int, int] | None:
    """[start, end) of the last run of 1s in the loss mask (the answer the target gave)."""
    ones = np.flatnonzero(mask > 0)
    if not len(ones):
        return None
    end = int(ones[-1]) + 1
    gaps = np.flatnonzero(np.diff(ones) > 1)
    start = int(ones[gaps[-1] + 1]) if len(gaps) else int(ones[0])
    return start, end


def boundary_problem(sample: GateSample, prompt_ids: list[int], stop_ids: set[int]) -> str | None:
    """Why this sample's answer span is not where the template puts it, or None."""
    span = answer_span(sample.loss_mask)
    if span is None:
        return "no loss-mask tokens"
    start, end = span
    if list(sample.input_ids[:start]) != prompt_ids:
        return (
            f"the answer's loss mask starts at {start}, the rendered generation prompt is {len(prompt_ids)} "
            "tokens (or its ids differ)"
        )
    if int(sample.input_ids[end - 1]) not in stop_ids and end != len(sample.input_ids):
        last = int(sample.input_ids[end - 1])
        return f"the answer's loss mask ends at {end} on token {last}, not on end-of-turn"
    return None


def boundary_problems(
    samples: Sequence[GateSample], prompts: Sequence[list[int]], stop_ids: set[int]
) -> dict[str, str]:
    """Samples whose loss mask is off the answer span of the template rendered afresh, with why."""
    problems = {}
    for s, p in zip(samples, prompts, strict=True):
        why = boundary_problem(s, p, stop_ids)
        if why:
            problems[s.id] = why
    return problems


def rendered_prompts(chat: ChatTokenizer, samples: Sequence[GateSample]) -> list[list[int]]:
    """Each sample's generation prompt as a server tokenizes it: the template's text, encoded by the
    tokenizer."""
    return [
        _tool_prompt(chat, s)
        if s.tools or has_tool_fields(s.messages)
        else chat.tok(chat.render(chat.template_messages(s.messages), True), add_special_tokens=False)[
            "input_ids"
        ]
        for s in samples
    ]


def _tool_prompt(chat: ChatTokenizer, s: GateSample) -> list[int]:
    """A prompt with tools, as the server renders and tokenizes it (`tool_render`)."""
    renderer = chat.tool_renderer
    return renderer.encode(renderer.render([renderer.message(dict(m)) for m in s.messages], s.tools, True))


def load_samples(
    layout: DatasetLayout,
    ids: Sequence[str],
    reader: HiddenStatesReader | None = None,
    aux_window: int | None = None,
    chat: ChatTokenizer | None = None,
) -> list[GateSample]:
    """The samples' ids and masks from the hidden-states shards and their messages: a prompt's row as
    prompts.parquet has it, a row of `turns: all` (`<id>#t<k>`) as the model saw turn k (the source with the
    target's stored answers to turns 1..k-1; `chat` says whether the template keeps their reasoning). With
    `aux_window`, each sample also keeps its auxiliary states up to that many tokens into its answer (what the
    draft trains on, see crop_to_window), copied so that the rest of the sample's states is freed: each sample
    is read once, and memory holds only the windows."""
    keep_reasoning = chat.template_has_reasoning if chat is not None else True
    by_id = row_prompts(layout, pl.read_parquet(layout.prompts), ids, keep_reasoning)
    reader = reader or HiddenStatesReader(layout.hidden_states_dir)
    out = []
    for sid in ids:
        row = by_id.get(sid)
        if row is None:
            raise ValueError(
                f"{sid}: in hidden_states but neither a prompt of prompts.parquet nor a stored turn of one; "
                "re-materialise hidden_states"
            )
        s = reader.sample(sid)
        out.append(
            GateSample(
                sid,
                row["messages"],
                s["input_ids"].numpy(),
                s["loss_mask"].numpy(),
                row["source_answer"],
                None if aux_window is None else _aux_window(s, aux_window),
                row.get("tools"),
            )
        )
    return out


def _aux_window(sample: dict[str, Any], window: int) -> Any:
    span = answer_span(sample["loss_mask"].numpy())
    end = len(sample["input_ids"]) if span is None else min(len(sample["input_ids"]), span[0] + window)
    return sample["aux_hidden_states"][:end].clone()


@dataclass
class GateInputs:
    """The partition's samples as the gate splits them, with their rendered prompts and boundary problems."""

    train: list[GateSample]
    heldout: list[GateSample]
    train_prompts: PromptSet
    heldout_prompts: PromptSet
    problems: dict[str, str]
    window: int


def gate_inputs(
    layout: DatasetLayout, settings: AcceptanceConfig, chat: ChatTokenizer, stop_ids: set[int]
) -> GateInputs:
    """Split, load (training samples with their aux window), render the prompts and check the boundaries."""
    reader = HiddenStatesReader(layout.hidden_states_dir)
    all_ids = reader.ids()
    train_ids, heldout_ids = split_ids(all_ids, settings.train_prompts, settings.heldout_prompts)
    if not train_ids or not heldout_ids:
        raise ValueError(
            f"{layout.key}: {len(all_ids)} samples with hidden states; the gate needs at least 2 "
            "(some to train on, some held out)"
        )
    window = settings.max_new_tokens + (settings.ttt_steps or settings.draft_tokens) + 1
    train = load_samples(layout, train_ids, reader, aux_window=window, chat=chat)
    # Heldout samples keep their window too: the simulated acceptance is computed on them.
    heldout = load_samples(layout, heldout_ids, reader, aux_window=window, chat=chat)
    prompts = rendered_prompts(chat, train + heldout)
    return GateInputs(
        train,
        heldout,
        PromptSet(train_ids, prompts[: len(train)]),
        PromptSet(heldout_ids, prompts[len(train) :]),
        boundary_problems(train + heldout, prompts, stop_ids),
        window,
    )


def crop_to_window(sample: Any, window: int) -> Any:
    """The sample up to `window` tokens into its answer: the gate measures the first max_new_tokens of each
    answer, so that is the span the draft must fit (training on the rest would cost minutes and change nothing
    the fit is measured on)."""
    from .drafter import TrainSample

    span = answer_span(sample.loss_mask.numpy())
    if span is None:
        return sample
    end = min(len(sample.input_ids), span[0] + window)
    return TrainSample(sample.input_ids[:end], sample.loss_mask[:end], sample.aux[:end])


def as_train_samples(samples: Sequence[GateSample], window: int) -> list[Any]:
    """Gate samples (loaded with their aux window) as the drafter's training samples, cropped to it."""
    import torch

    from .drafter import TrainSample

    return [
        crop_to_window(
            TrainSample(
                torch.from_numpy(s.input_ids.astype(np.int64)),
                torch.from_numpy(s.loss_mask.astype(np.int64)),
                s.aux.float(),
            ),
            window,
        )
        for s in samples
    ]


def source_samples(
    samples: Sequence[GateSample], chat: ChatTokenizer, features: FeatureSource, window: int
) -> list[Any]:
    """The dataset's own answers as training samples: tokenized with the target's template, features from the
    target over them."""
    import torch

    from .drafter import TrainSample

    convs = [(list(s.messages), Answer(str(s.source_answer), None, True)) for s in samples]
    tokenized = chat.tokenize(convs, tools=[s.tools for s in samples])
    rows = [r for r in tokenized if not isinstance(r, TemplateError)]
    states = features.aux_states([r.input_ids for r in rows])
    return [
        crop_to_window(
            TrainSample(
                torch.from_numpy(r.input_ids.astype(np.int64)),
                torch.from_numpy(r.loss_mask.astype(np.int64)),
                aux,
            ),
            window,
        )
        for r, aux in zip(rows, states, strict=True)
    ]
