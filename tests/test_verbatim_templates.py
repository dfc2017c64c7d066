"""The proof that a chat template writes message texts verbatim: what it accepts, what it refuses, and that
skipping the per-row render for a proven template changes no id, no mask and no error."""

from __future__ import annotations

import pytest

from eagle3_assets.core.target_model.chat import Answer, ChatTokenizer, TemplateError
from eagle3_assets.core.target_model.verbatim import verbatim_problem

from .support.kimi_standin import CHAT_TEMPLATE
from .support.tokenizer_families import FAMILIES


def loop(body: str) -> str:
    return "{% for message in messages %}" + body + "{% endfor %}"


PROVEN = {
    "text joined with + and ~": loop("{{ '<|' + message['role'] + '|>' ~ message.content ~ '\\n' }}"),
    "text named, then written": loop("{% set c = message['content'] %}{{ '<' + c + '>' }}"),
    "presence decides, the text is written": loop(
        "{{ message.content if message.content is defined else '' }}"
        "{% if 'reasoning_content' in message %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    ),
    "positions, counts and neighbours": loop(
        "{% if loop.first and messages|length > 1 %}{{ messages[-1].content }}{% endif %}"
        "{% if not loop.first %}{{ messages[loop.index0 - 1]['role'] }}{% endif %}"
        "{% if loop.previtem is defined %}{{ loop.previtem.role }}{% endif %}"
    )
    + "{% for m in messages[1:] %}{{ m.content }}{% endfor %}",
    "roles may be used in any way": loop(
        "{% if message.role|upper == 'USER' %}{{ message.role.title() }}{% endif %}{% if message['role'] not "
        "in ['user', 'system'] %}{{ raise_exception('roles alternate') }}{% endif %}{{ message.content }}"
    ),
    "namespaces of positions": "{% set ns = namespace(last=-1) %}"
    + loop("{% if message.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}")
    + loop("{% if loop.index0 > ns.last %}{{ message.content }}{% endif %}"),
}

REFUSED = {
    "a filter on a text": (loop("{{ message['content'] | trim }}"), "filter 'trim'"),
    "a text decides": (loop("{% if message.content %}{{ message.content }}{% endif %}"), "decides"),
    "a text searched": (loop("{% if '<think>' in message.content %}x{% endif %}"), "decides"),
    "a method on a text": (loop("{{ message.content.strip() }}"), "method"),
    "a slice of a text": (loop("{{ message.content[1:] }}"), "sliced"),
    "a message written": (loop("{{ message }}"), "written out"),
    "a message as JSON": (loop("{{ message | tojson }}"), "filter 'tojson'"),
    "all messages as JSON": ("{{ messages | tojson }}", "filter 'tojson'"),
    "a field named by a variable": (loop("{% set k = 'content' %}{{ message[k] }}"), "key"),
    "fields walked": (loop("{% for k, v in message.items() %}{{ v }}{% endfor %}"), "tested or combined"),
    "a default for a text": (loop("{{ message.content or '' }}"), "decides"),
    "text formatted with %": (loop("{{ '%s' % message.content }}"), "decides"),
    "text repeated": (loop("{{ message.content * 2 }}"), "decides"),
    "text as a call argument": (loop("{{ raise_exception(message.content) }}"), "decides"),
    "text stored in a namespace": (
        "{% set ns = namespace(c='') %}" + loop("{% set ns.c = message.content %}") + "{{ ns.c }}",
        "namespace",
    ),
    "a name that is a message and a text": (
        loop("{% set x = message %}{% set x = message.content %}{{ x }}"),
        "one place",
    ),
    "a text tested before it is named (fixed point)": (
        loop("{% if prev %}again{% endif %}{% set prev = message.content %}"),
        "decides",
    ),
    "a filter block": (loop("{% filter upper %}{{ message.content }}{% endfilter %}"), "FilterBlock"),
    "a captured block": (loop("{% set x %}{{ message.content }}{% endset %}{{ x | trim }}"), "AssignBlock"),
    "a macro": (
        "{% macro show(c) %}{{ c }}{% endmacro %}" + loop("{{ show(message.content) }}"),
        "Macro",
    ),
    "transformers' generation tag": (
        loop("{% generation %}{{ message.content }}{% endgeneration %}"),
        "parsed",
    ),
    "a loop over a text": (loop("{% for ch in message.content %}{{ ch }}{% endfor %}"), "characters"),
    # Markup escapes a plain string added to it: `text + Markup` writes "&lt;" for "<".
    "text added to Markup": (loop("{{ message.content + ('' | safe) }}"), "Markup"),
    "an escaped role joined with text": (loop("{{ (message.role | e) + message.content }}"), "Markup"),
    "random text": ("{{ lipsum(1, false, 3, 5) }}" + loop("{{ message.content }}"), "lipsum"),
    "the clock": ("{{ strftime_now('%f') }}" + loop("{{ message.content }}"), "strftime_now"),
    "deep nesting": ("{% if true %}" * 400 + "x" + "{% endif %}" * 400, "not parsed"),
    "a huge number": ("{{ " + "9" * 5000 + " }}", "not parsed"),
}


@pytest.mark.parametrize("name", sorted(PROVEN))
def test_templates_that_write_texts_verbatim_are_proven(name):
    assert verbatim_problem(PROVEN[name]) is None


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_templates_that_may_change_a_text_are_refused_with_the_reason(name):
    template, reason = REFUSED[name]
    problem = verbatim_problem(template)
    assert problem is not None and reason in problem, problem


def test_a_template_that_writes_a_sentinel_character_is_not_proven():
    template = loop("[{{ '\ue0000c\ue001' }}]{{ message.content }}")
    assert verbatim_problem(template) is None  # nothing reserved
    assert "reserved" in verbatim_problem(template, reserved="\ue000\ue001")


def test_nested_membership_tests_are_analysed_in_linear_time():
    deep = "x"
    for _ in range(60):  # each level evaluated twice would be 2^60 steps
        deep = f"('a' in {deep})"
    assert verbatim_problem("{% if " + deep + " %}y{% endif %}" + loop("{{ message.content }}")) is None


def test_the_real_templates_here():
    assert verbatim_problem(ChatTokenizer(FAMILIES["phi3"]()).tok.chat_template) is None
    verdicts = {name: verbatim_problem(make().chat_template) for name, make in FAMILIES.items()}
    assert {n for n, v in verdicts.items() if v is None} == {"mistral", "phi3", "deepseek_v3"}
    assert "trim" in verdicts["llama3"] and "decides" in verdicts["qwen3"]
    kimi = CHAT_TEMPLATE.read_text()
    assert verbatim_problem(kimi) is not None


def test_the_shipped_target_is_proven_and_its_rows_are_not_rendered_again(chat):
    """The default target (SmolLM2, ChatML) takes the fast path: no row is rendered a second time."""
    assert chat.verbatim_problem is None
    calls = []
    render = chat._render_plain
    chat._render_plain = lambda convs, gen: calls.append(len(convs)) or render(convs, gen)
    try:
        out = chat.tokenize([([{"role": "user", "content": f"q{i}"}], Answer(f"a{i}")) for i in range(20)])
    finally:
        chat._render_plain = render
    assert calls == [] and not any(isinstance(r, TemplateError) for r in out)


ADVERSARIAL = [
    "  padded both sides \n",
    "{braces} {0} {{double}} %s %(x)s",
    "\ue0000c\ue001 sentinel lookalike \ue001",
    "literal <|im_end|> and <|im_start|>user and [INST] and <｜User｜>",
    "{{ messages }} {% if true %}jinja{% endif %}",
    "\n\nleading newlines",
    "日本語 🙂\ttabs\r\nCRLF",
    "x",
]


def _conversations():
    convs = []
    for i, text in enumerate(ADVERSARIAL):
        other = ADVERSARIAL[(i + 3) % len(ADVERSARIAL)]
        convs.append(([{"role": "user", "content": text}], Answer(other, None, True)))
        convs.append(([{"role": "system", "content": other}, {"role": "user", "content": text}], Answer("")))
        convs.append(
            (
                [
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": other, "reasoning": text},
                    {"role": "user", "content": other},
                ],
                Answer(text, other, i % 2 == 0),
            )
        )
    convs.append(([{"role": "user", "content": None}], Answer("not a string")))  # no proof covers this row
    # A role that looks like a sentinel: its row is still rendered (and the plan's text differs from the
    # render).
    convs.append(([{"role": "\ue0000c\ue001", "content": "hi"}], Answer("there")))
    return convs


@pytest.mark.parametrize("family", ["smollm2", "mistral", "phi3", "deepseek_v3"])
def test_skipping_the_render_changes_no_id_mask_or_error(family, smol_tok):
    """The proof's claim, checked: for every proven template, adversarial texts give the same ids, masks and
    errors with the per-row render as without it (and apply_chat_template's own text equals the plan's)."""
    make = (lambda: smol_tok) if family == "smollm2" else FAMILIES[family]
    fast, checked = ChatTokenizer(make()), ChatTokenizer(make())
    assert fast.verbatim_problem is None
    checked.verbatim_problem = "forced: check every row"
    convs = _conversations()
    for train_all in (False, True):
        a, b = fast.tokenize(convs, train_all), checked.tokenize(convs, train_all)
        for x, y in zip(a, b, strict=True):
            assert type(x) is type(y)
            if isinstance(x, TemplateError):
                assert str(x) == str(y)
            else:
                assert x.input_ids.tolist() == y.input_ids.tolist()
                assert x.loss_mask.tolist() == y.loss_mask.tolist() and x.answer_start == y.answer_start
    # The row with no string text was still rendered, and failed; so did the row with a sentinel role where
    # the template writes roles (its plan misreads the role as a text).
    assert isinstance(a[-2], TemplateError)
    assert isinstance(a[-1], TemplateError) is (family in ("smollm2", "phi3"))
    assert sum(isinstance(x, TemplateError) for x in a[:-2]) == 0


def test_a_trimming_template_rebuilds_the_rows_it_rewrites_as_the_model_saw_them():
    """Llama-3 trims every message: the prompt side is what the template renders (what the model saw), the
    answer what the model wrote, ending where the template ends a turn. Its template has no reasoning field,
    so an answer's reasoning is written as the model produced it (`<think>…</think>` before the content),
    exactly as a template that writes texts verbatim writes it: every one of these rows is rebuilt (9 of them
    were refused at first, then the 3 whose answer carries reasoning)."""
    from .support.tokenizer_families import LLAMA3_TEMPLATE

    tok = FAMILIES["llama3"]()
    chat = ChatTokenizer(tok)
    assert chat.verbatim_problem is not None and not chat.template_has_reasoning
    # The same template without `| trim` writes texts verbatim: its answers are the exact path's.
    twin_tok = FAMILIES["llama3"]()
    twin_tok.chat_template = LLAMA3_TEMPLATE.replace(" | trim", "")
    twin = ChatTokenizer(twin_tok)
    assert twin.verbatim_problem is None
    convs = _conversations()
    out, exact = chat.tokenize(convs), twin.tokenize(convs)
    refused = [i for i, x in enumerate(out[:-2]) if isinstance(x, TemplateError)]
    assert refused == []
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    rebuilt = 0
    for (messages, answer), res, twin_res in zip(convs[:-2], out[:-2], exact[:-2], strict=True):
        seen = chat.render(chat.template_messages(messages), True)
        assert tok.decode(res.input_ids[: res.answer_start].tolist()) == seen  # the template's own rendering
        if seen != twin.render(twin.template_messages(messages), True):  # the template rewrote this prompt
            # encoded as a server encodes the prompt it rendered
            assert (
                res.input_ids[: res.answer_start].tolist() == tok(seen, add_special_tokens=False)["input_ids"]
            )
        whole = [*messages, {"role": "assistant", "content": answer.content, "reasoning": answer.reasoning}]
        rebuilt += chat.render(chat.template_messages(whole), False) != twin.render(
            twin.template_messages(whole), False
        )
        assert res.loss_mask[: res.answer_start].sum() == 0 and res.loss_mask[res.answer_start :].all()
        tail = res.answer_ids.tolist()
        assert tail == twin_res.answer_ids.tolist()  # the answer as written, whatever the prompt's rewriting
        written = (f"<think>{answer.reasoning}</think>" if answer.reasoning else "") + answer.content
        assert tok.decode(tail) == written + ("<|eot_id|>" if answer.finished else "")  # untrimmed
        assert (tail[-1] == eot) is answer.finished
    assert rebuilt == 9  # rows whose text the template rewrites (prompt or answer)
    # A request's prompt ids (the embedded model, SGLang) are the rendering too, not a refusal.
    padded_prompt = [{"role": "user", "content": "  padded \n"}]
    assert (
        chat.prompt_ids([padded_prompt])[0]
        == tok(chat.render(padded_prompt, True), add_special_tokens=False)["input_ids"]
    )
    padded = chat.tokenize([([{"role": "user", "content": " padded "}], Answer("  ok  "))])[0]
    assert tok.decode(padded.answer_ids.tolist()) == "  ok  <|eot_id|>"


def test_a_rewriting_template_with_a_reasoning_field_refuses_answers_with_reasoning_naming_why():
    """Qwen3 writes the answer's reasoning in its own field and strips its newlines: where the model's
    thinking ended cannot be told, so that row alone is refused, and the reason says so (not merely that text
    is trimmed); the same answer without reasoning, and a padded prompt, are rebuilt."""
    chat = ChatTokenizer(FAMILIES["qwen3"]())
    assert chat.verbatim_problem is not None and chat.template_has_reasoning
    prompt = [{"role": "user", "content": "  What is 2+2? \n"}]
    out = chat.tokenize(
        [(prompt, Answer("It is 4.", "\nTwo plus two.\n", True)), (prompt, Answer("It is 4."))]
    )
    assert isinstance(out[0], TemplateError) and not isinstance(out[1], TemplateError)
    assert str(out[0]).startswith("the answer carries reasoning the template writes in its own field")
    assert "rewrites this conversation's text" in str(out[0])  # and where the template rewrote it
