"""Rows whose text the template rewrites (Llama-3 trims every message): their plan's ids are not what the
model saw, so such a row is rebuilt from the template's real rendering when it can be."""

from __future__ import annotations

from dataclasses import replace

from .template_plan import CLOSE, OPEN, Piece, PieceKind, PlannedRow, Region, TemplatePlan
from .template_render import ChatTemplate, failure_reason
from .text_encoder import TextEncoder


def rebuilt_row(template: ChatTemplate, encoder: TextEncoder, row: PlannedRow) -> PlannedRow | str:
    """The prompt is what the template renders for the row (what the model saw, encoded from the real
    rendering, as a server encodes the prompt it rendered), the answer what the model wrote, ending where the
    template ends a turn (the plan's generated turn, filled with the texts as they are). A prompt alone (a
    request's prompt ids) is the rendering alone. Returns the row with its rebuilt plan, or why it cannot be
    rebuilt."""
    shape, plan = row.shape, row.plan
    if not all(type(v) is str for v in row.texts):
        return "a message text is not a string"
    if not shape.prompt_only:
        problem = _answer_problem(template, encoder, plan.regions[-1], shape.reasoning[-1])
        if problem is not None:
            return problem
    n = len(shape.roles) - (0 if shape.prompt_only else 1)
    messages = template.filled_messages(shape.roles[:n], shape.reasoning[:n], row.texts)
    try:
        seen = template.render(messages, True)
    except Exception as e:
        return failure_reason(e)
    # Encoded as a server encodes the prompt it rendered (special tokens parsed): what the model saw.
    prompt = tuple(template.tok(seen, add_special_tokens=False)["input_ids"])
    head = Region((Piece(PieceKind.FIXED, prompt),), trained=False)
    if shape.prompt_only:
        return replace(row, plan=TemplatePlan((head,), ()))
    return replace(row, plan=TemplatePlan((head, plan.regions[-1]), plan.fills))


def _answer_problem(
    template: ChatTemplate, encoder: TextEncoder, answer: Region, has_reasoning: bool
) -> str | None:
    """Why the plan's generated turn cannot stand for what the model wrote; None when it can."""
    if not answer.trained:
        return "the answer has no span of its own in the rendered conversation"
    if has_reasoning and template.template_has_reasoning:
        # The template writes the answer's reasoning in its own field and may rewrite it as it does the other
        # texts (Qwen3 strips its newlines): where the model's own thinking ended cannot be told from the
        # parsed reasoning. (A template without a reasoning field never sees it: the answer is written in the
        # thinking form the model produced, `<think>…</think>` then the content, exactly as for a template
        # that writes texts verbatim.)
        return (
            "the answer carries reasoning the template writes in its own field and may rewrite, so where "
            "the model's thinking ended cannot be told"
        )
    fixed = [encoder.decode(list(p.ids)) for p in answer.pieces if p.kind is PieceKind.FIXED]
    if not any(p.kind is PieceKind.FILL for p in answer.pieces) or any(
        OPEN in t or CLOSE in t for t in fixed
    ):
        # e.g. the template upper-cases the answer: its rendering is not what was written
        return "the template rewrites the answer's own text"
    return None
