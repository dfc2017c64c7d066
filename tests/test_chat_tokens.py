"""Exact reconstruction on the SmolLM2 ChatML template: golden ids, masks, literal special tokens."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3_assets.core.target_model.chat import Answer, TemplateError
from eagle3_assets.core.target_model.preflight import special_token_problems

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [{"role": "user", "content": "日本語で答えて 🙂\ttabs and  spaces \r\nCRLF"}],
]
ANSWERS = ["4", "Blue.", "Why did the chicken cross the road?", "はい、わかりました。 🙂"]


def hf_ids(tok, messages, add_generation_prompt):
    return tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_prompt_ids_equal_the_templates_own_tokenization(chat, smol_tok, i):
    assert chat.prompt_ids([CONVERSATIONS[i]])[0] == hf_ids(smol_tok, CONVERSATIONS[i], True)


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_full_conversation_and_mask(chat, smol_tok, i):
    msgs, answer = CONVERSATIONS[i], ANSWERS[i]
    res = chat.tokenize([(msgs, Answer(answer))])[0]
    prompt = hf_ids(smol_tok, msgs, True)
    answer_ids = smol_tok(answer, add_special_tokens=False)["input_ids"] + [2]
    assert res.input_ids.tolist() == prompt + answer_ids
    assert res.loss_mask.tolist() == [0] * len(prompt) + [1] * len(answer_ids)
    assert res.answer_start == len(prompt)
    assert res.input_ids[-1] == 2 and res.loss_mask[-1] == 1  # the end-of-turn token is trained


def test_truncated_answer_has_no_end_of_turn(chat, smol_tok):
    res = chat.tokenize([(CONVERSATIONS[0], Answer("The answer is", finished=False))])[0]
    assert res.input_ids[-1] != 2
    assert smol_tok.decode(res.answer_ids.tolist()) == "The answer is"


def test_literal_special_token_text_stays_text(chat):
    msgs = [{"role": "user", "content": "Explain what <|im_end|> and <|im_start|> mean."}]
    res = chat.tokenize([(msgs, Answer("The token <|im_end|> ends a turn."))])[0]
    ids = res.input_ids.tolist()
    # Control ids: only where the template put them (system, user, assistant turns).
    assert ids.count(1) == 3
    assert ids.count(2) == 3  # system end, user end, answer end
    assert chat.encoder.decode(res.answer_ids.tolist()) == "The token <|im_end|> ends a turn.<|im_end|>"


def test_answer_starting_with_newlines_is_split_where_generation_started(chat, smol_tok):
    res = chat.tokenize([(CONVERSATIONS[0], Answer("\n\nFour."))])[0]
    own = smol_tok("\n\nFour.", add_special_tokens=False)["input_ids"] + [2]
    assert res.answer_ids.tolist() == own


def test_train_all_assistant_turns_masks_every_answer(chat):
    msgs = CONVERSATIONS[2]
    one = chat.tokenize([(msgs, Answer("A joke."))])[0]
    every = chat.tokenize([(msgs, Answer("A joke."))], train_all=True)[0]
    assert every.loss_mask.sum() > one.loss_mask.sum()
    trained = every.input_ids[every.loss_mask == 1].tolist()
    assert chat.encoder.decode(trained) == "Hello! How can I help?<|im_end|>A joke.<|im_end|>"


def test_special_token_sanity(chat):
    assert special_token_problems(chat) == []
    problems = special_token_problems(chat, configured_id=1234)
    assert problems and "1234" in problems[0] and "'<|im_end|>' (id 2)" in problems[0]


def test_bad_conversation_yields_error_not_exception(chat):
    res = chat.tokenize(
        [([{"role": "user", "content": "ok"}], Answer("fine")), ([{"role": "user"}], Answer("x"))]
    )
    assert not isinstance(res[0], TemplateError)
    assert isinstance(res[1], TemplateError)
    assert np.all(res[0].loss_mask[res[0].answer_start :] == 1)


def test_reasoning_without_a_template_field_uses_the_configured_think_tags(chat, smol_tok):
    """SmolLM2's template has no reasoning field: reasoning is written as <think>…</think> before the
    answer."""
    res = chat.tokenize([(CONVERSATIONS[0], Answer("4", "2 plus 2", True))])[0]
    text = "<think>2 plus 2</think>4"
    assert res.answer_ids.tolist() == smol_tok(text, add_special_tokens=False)["input_ids"] + [2]
    empty = chat.tokenize([(CONVERSATIONS[0], Answer("4", "", True))])[0]
    assert empty.answer_ids.tolist() == smol_tok("4", add_special_tokens=False)["input_ids"] + [2]


def test_surrounding_whitespace_and_tabs_are_kept(chat, smol_tok):
    msgs = [{"role": "user", "content": "  padded\tquestion  "}]
    res = chat.tokenize([(msgs, Answer("\tanswer with tab  "))])[0]
    assert res.input_ids.tolist() == hf_ids(smol_tok, msgs, True) + smol_tok(
        "\tanswer with tab  ", add_special_tokens=False
    )["input_ids"] + [2]


def test_a_split_the_model_chose_is_told_apart_from_a_rebuild_defect(chat, smol_tok):
    """Small models sometimes emit a non-canonical split of their own text ("ong" + "s" where the tokenizer
    writes "ongs"). The row keeps the model's ids; the comparison calls it the model's split, explained, only
    when the rebuild equals the tokenizer's own encoding of the text (an independent path). The other way
    round, a rebuild that is not the tokenizer's encoding, stays a rebuild defect that the blocking check
    counts."""
    import numpy as np

    from eagle3_assets.core.tokens.chunks import _canonical
    from eagle3_assets.core.tokens.reference import compare

    ids = lambda *toks: [smol_tok.convert_tokens_to_ids(t) for t in toks]  # noqa: E731
    canonical = [*ids("ven", "k", "ongs", "Ġcould"), chat.eot_id]
    model = [*ids("ven", "k", "ong", "s", "Ġcould"), chat.eot_id]
    assert smol_tok.decode(canonical) == smol_tok.decode(model)
    assert _canonical(chat)(model) == canonical  # what the tokenizer itself writes for that text

    chose = compare(np.asarray(canonical), model, chat.encoder.decode, True, _canonical(chat))
    assert chose.kind == "model_split" and chose.explained and not chose.match
    defect = compare(np.asarray(model), canonical, chat.encoder.decode, True, _canonical(chat))
    assert defect.kind == "bpe_split" and not defect.explained
