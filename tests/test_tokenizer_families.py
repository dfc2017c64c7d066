"""Exact ids across tokenizer families: for every family the rebuilt ids equal the tokenizer's own encoding
of the rendered conversation; what a family cannot rebuild is a per-row error (independent of row order) or
a preflight finding, never silently wrong ids. The Kimi K2.5 stand-in (a template and
tokenizer of Kimi's shape, not Moonshot's files) has its own file (test_kimi_template.py)."""

from __future__ import annotations

import json

import pytest

from eagle3_assets.core.target_model.chat import Answer, ChatTokenizer, TemplateError
from eagle3_assets.core.target_model.preflight import exactness, reference_ids, special_token_problems

from .support.tokenizer_families import FAMILIES

CONVERSATIONS = [
    (
        [{"role": "user", "content": "What is the capital of France?"}],
        Answer("The capital of France is Paris.", None, True),
    ),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Écris une phrase sur Tokyo 東京."},
        ],
        Answer("Tokyo est une ville immense, 東京は大きい.", None, True),
    ),
    (
        [
            {"role": "user", "content": "Write f."},
            {"role": "assistant", "content": "def f(x):\n    return x"},
            {"role": "user", "content": "Now g?"},
        ],
        Answer("def g(y):\n    return 2 * y", None, True),
    ),
    # The answer opens with a letter right after the prompt's last control token: a Metaspace tokenizer with
    # prepend_scheme "first" must not give it a "▁" there.
    ([{"role": "user", "content": "Say x"}], Answer("x", None, True)),
    ([{"role": "user", "content": "Count to five."}], Answer("One, two, three, four, five.", None, False)),
]


_CHATS: dict[str, ChatTokenizer] = {}


def chat_for(family: str) -> ChatTokenizer:
    if family not in _CHATS:
        _CHATS[family] = ChatTokenizer(FAMILIES[family]())
    return _CHATS[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rebuilt_ids_equal_the_tokenizers_own_encoding(family):
    chat = chat_for(family)
    assert special_token_problems(chat) == [] and exactness(chat)[0] == []
    tok = chat.tok
    for messages, answer in CONVERSATIONS:
        res = chat.tokenize([(messages, answer)])[0]
        assert not isinstance(res, TemplateError), (family, res)
        ours = res.input_ids.tolist()
        prompt = tok(chat.render(messages, True), add_special_tokens=False)["input_ids"]
        assert ours[: res.answer_start] == prompt, (family, messages)  # the prompt as a server tokenizes it
        truth = reference_ids(chat, messages, answer.content)
        n = len(ours) if answer.finished else len(ours) - 3  # a cut answer's last word may merge differently
        assert truth[:n] == ours[:n], (
            family,
            answer.content,
            chat.encoder.decode(ours),
            chat.encoder.decode(truth),
        )
        if answer.finished:
            assert ours == truth and ours[-1] == chat.eot_id
        assert res.loss_mask[: res.answer_start].sum() == 0 and res.loss_mask[res.answer_start :].all()
        # Multi-turn history inside the prompt is what encoding the rendered conversation gives, turn by turn.
        full = tok(
            chat.render([*messages, {"role": "assistant", "content": answer.content}], False),
            add_special_tokens=False,
        )["input_ids"]
        assert (
            full[: res.answer_start] == ours[: res.answer_start]
            or full[: res.answer_start - 1] == ours[: res.answer_start - 1]
        )


def test_the_families_are_what_they_claim():
    """Guards that make the tests above meaningful: the structures really are the families' own."""
    spec = json.loads(chat_for("mistral").tok.backend_tokenizer.to_str())
    assert spec["pre_tokenizer"]["type"] == "Metaspace" and spec["pre_tokenizer"]["prepend_scheme"] == "first"
    mistral = chat_for("mistral").tok
    alone = mistral("x", add_special_tokens=False)["input_ids"]
    after = mistral("[/INST]x", add_special_tokens=False)["input_ids"][1:]
    assert alone != after  # text encoded alone differs from the same text after a control token
    phi = chat_for("phi3")
    swallowed = phi.tok("<|assistant|>\nHi", add_special_tokens=False)["input_ids"]
    assert (
        swallowed == phi.tok("<|assistant|>Hi", add_special_tokens=False)["input_ids"]
    )  # rstrip ate the newline
    assert phi.encoder.rstrip_ids >= {
        phi.encoder.control_ids["<|assistant|>"],
        phi.encoder.control_ids["<|end|>"],
    }
    assert chat_for("llama3").encoder.control_ids["<|eot_id|>"] == chat_for("llama3").eot_id
    assert (
        "byte"
        in json.dumps(json.loads(chat_for("llama3").tok.backend_tokenizer.to_str())["pre_tokenizer"]).lower()
    )
    assert len(chat_for("deepseek_v3").tok) > 128_000


def test_a_trimming_template_rebuilds_the_padded_rows_whatever_their_order():
    """Llama-3 trims every message: a padded row is rebuilt as the model saw it (the template's rendering of
    the prompt) with the answer as the model wrote it, never refused; the same whatever the batch's order."""
    tok = FAMILIES["llama3"]()
    chat = ChatTokenizer(tok)
    clean = ([{"role": "user", "content": "Hello there"}], Answer("Hi.", None, True))
    padded = ([{"role": "user", "content": "  Hello there \n"}], Answer(" Hi. ", None, True))
    results = {}
    for batch in ([clean, padded], [padded, clean], [padded]):
        for conv, res in zip(batch, ChatTokenizer(FAMILIES["llama3"]()).tokenize(batch), strict=True):
            assert not isinstance(res, TemplateError)
            results.setdefault(id(conv), set()).add(tuple(res.input_ids.tolist()))
    assert all(len(v) == 1 for v in results.values())  # order-independent
    res = chat.tokenize([padded])[0]
    seen = chat.render(padded[0], True)
    assert "Hello there<|eot_id|>" in seen  # the template trimmed the prompt: that is what the model saw
    assert tok.decode(res.input_ids[: res.answer_start].tolist()) == seen
    assert tok.decode(res.answer_ids.tolist()) == " Hi. <|eot_id|>"  # what the model wrote
    problems, warnings = exactness(chat)
    assert problems == [] and any("trims or strips" in w for w in warnings)


def test_a_thinking_template_keeps_the_final_reasoning_and_says_what_it_drops():
    chat = chat_for("qwen3")
    messages = [{"role": "user", "content": "What is 2+2?"}]
    answer = Answer("It is 4.", "Two plus two makes four.", True)
    res = chat.tokenize([(messages, answer)])[0]
    full = chat.tok(
        chat.render(
            [*messages, {"role": "assistant", "content": "It is 4.", "reasoning_content": answer.reasoning}],
            False,
        ),
        add_special_tokens=False,
    )["input_ids"]
    assert res.input_ids.tolist() == full[: len(res.input_ids)]
    assert "<think>" in chat.encoder.decode(res.answer_ids.tolist())
    # Reasoning that the template would strip cannot be rebuilt: that row fails, alone.
    stripped = (messages, Answer("It is 4.", "\nTwo plus two.\n", True))
    out = chat.tokenize([stripped, (messages, answer)])
    assert isinstance(out[0], TemplateError) and not isinstance(out[1], TemplateError)
    # Earlier turns lose their reasoning once a later user turn follows: training on them cannot be exact.
    problems, warnings = exactness(chat)
    assert problems == [] and any("train_all_assistant_turns" in w for w in warnings)


def test_a_template_that_rewrites_all_text_is_refused_before_any_request():
    tok = FAMILIES["deepseek_v3"]()
    tok.chat_template = tok.chat_template.replace("m['content']", "m['content'] | upper")
    problems, _ = exactness(ChatTokenizer(tok))
    assert problems and "cannot render a plain conversation exactly" in problems[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_verification_renders_what_apply_chat_template_renders(family):
    """The per-row verification renders plain conversations through transformers' second step directly; it
    must give apply_chat_template's text for every family (reasoning fields and template options included)."""
    chat = chat_for(family)
    with_reasoning = [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because.", "reasoning_content": "\nThink it over.\n"},
    ]
    convs = [[*m, {"role": "assistant", "content": a.content}] for m, a in CONVERSATIONS] + [with_reasoning]
    for gen in (False, True):
        batch = [c[:-1] for c in convs] if gen else convs
        expected = chat.tok.apply_chat_template(batch, tokenize=False, add_generation_prompt=gen)
        assert chat._render_plain(batch, gen) == expected, family
    options = ChatTokenizer(chat.tok, {"enable_thinking": False})
    expected = chat.tok.apply_chat_template(
        [convs[0][:-1]], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert options._render_plain([convs[0][:-1]], True) == expected
