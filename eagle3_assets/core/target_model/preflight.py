"""What preflight asks of a target's tokenizer and template before anything is paid for: is the end-of-turn
token the special token it should be, and does a plain conversation rebuild to exactly the ids the tokenizer
itself gives?
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .chat import Answer, ChatRecipe, ChatTokenizer, TemplateError


def special_token_problems(chat: ChatTokenizer, configured_id: int | None = None) -> list[str]:
    """Fatal configuration problems with the end-of-turn token (checked before any request)."""
    problems: list[str] = []
    eot, eot_id = chat.eot_token, chat.eot_id
    if eot_id is None:
        problems.append(
            f"end-of-turn token {eot!r} is not an added token of the tokenizer; "
            "set target.end_of_turn_token to the string the template writes after an answer"
        )
        return problems
    decoded = chat.encoder.decode([eot_id])
    if decoded != eot:
        problems.append(f"end-of-turn id {eot_id} decodes to {decoded!r}, not {eot!r}")
    if eot_id not in chat.encoder.special_ids:
        problems.append(f"end-of-turn token {eot!r} (id {eot_id}) is not a special token of the tokenizer")
    if configured_id is not None and configured_id != eot_id:
        other = chat.encoder.decode([configured_id])
        problems.append(
            f"target.end_of_turn_id {configured_id} decodes to {other!r}, but the template ends a turn with "
            f"{eot!r} (id {eot_id}); set end_of_turn_id to {eot_id} or remove it"
        )
    try:
        probe = chat.tokenize([([{"role": "user", "content": "hi"}], Answer("hello", None, True))])[0]
    except Exception as e:
        problems.append(f"the chat template cannot render a simple conversation: {e}")
    else:
        if isinstance(probe, TemplateError):
            problems.append(f"the chat template cannot render a simple conversation: {probe}")
        elif int(probe.input_ids[-1]) != eot_id:
            problems.append(f"the chat template does not end an answer with {eot!r}")
    return problems


def reference_ids(chat: ChatTokenizer, messages: Sequence[dict[str, Any]], answer: str) -> list[int]:
    """The ids a serving stack and the model give a finished answer, from the tokenizer's own encoding alone:
    the rendered generation prompt as a server tokenizes it, then the answer as text that follows a control
    token, closed by the end-of-turn token. (Encoding the whole rendered conversation at once is not it: a
    prompt that ends in template whitespace merges with the answer's first word there, which the model never
    saw.)"""
    prompt = chat.tok(chat.render(list(messages), True), add_special_tokens=False)["input_ids"]
    after = chat.tok(chat.eot_token + answer + chat.eot_token, add_special_tokens=False)["input_ids"]
    return [*prompt, *after[1:]]


def exactness(chat: ChatTokenizer) -> tuple[list[str], list[str]]:
    """(problems, warnings) about rebuilding this family's ids exactly, found with probe conversations before
    any request is paid for. A problem: ordinary text does not rebuild to the ids the tokenizer itself gives
    the rendered conversation (the run must not start). A warning: some rows will not rebuild (they become
    tokens_errors rows with their reason) or an option cannot be exact."""
    problems: list[str] = []
    warnings: list[str] = []
    clean = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Name a city, then write f(x) = 2x in Python."},
    ]
    answer = Answer("Paris.\nA function:\n    def f(x):\n        return 2 * x", None, True)
    got = chat.tokenize([(clean, answer)])[0]
    if isinstance(got, TemplateError):
        problems.append(f"the chat template cannot render a plain conversation exactly: {got}")
    else:
        ours = got.input_ids.tolist()
        truth = reference_ids(chat, clean, answer.content)
        if truth != ours:
            at = next((i for i, (a, b) in enumerate(zip(ours, truth, strict=False)) if a != b), len(ours))
            problems.append(
                "this tokenizer and template cannot be rebuilt exactly: a plain conversation's ids differ "
                f"from the tokenizer's own encoding at token {at} "
                f"({chat.encoder.decode(ours[at : at + 3])!r} vs {chat.encoder.decode(truth[at : at + 3])!r})"
            )
    padded = [{"role": "user", "content": "  padded question \n"}]
    padded_answer = Answer(" padded answer\n", None, True)
    rendered = chat.render([*padded, {"role": "assistant", "content": padded_answer.content}], False)
    if isinstance(chat.tokenize([(padded, padded_answer)])[0], TemplateError):
        warnings.append(
            "the chat template rewrites message text (it trims or strips whitespace) and such rows cannot be "
            "rebuilt: conversations whose messages start or end with whitespace go to tokens_errors.parquet"
        )
    elif "  padded question \n" not in rendered:
        warnings.append(
            "the chat template rewrites message text (it trims or strips whitespace): such conversations are "
            "rebuilt as the model saw them (the template's rendering of the prompt, the answer as written)"
        )
    history = [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "One.", "reasoning": "Count."},
        {"role": "user", "content": "Second?"},
    ]
    if isinstance(
        chat.tokenize([(history, Answer("Two.", "Count again.", True))], train_all=True)[0], TemplateError
    ):
        warnings.append(
            "the template renders earlier assistant turns differently once later turns follow (it drops "
            "their reasoning): tokens.train_all_assistant_turns cannot be exact for multi-turn rows with "
            "reasoning"
        )
    return problems, warnings


def passed_record(recipe: ChatRecipe, configured_eot_id: int | None) -> Path | None:
    """Where a passed preflight of this tokenizer and template is remembered in the machine cache, or None
    where it cannot be remembered safely (a hub id, remote code). Keyed by what the verdict depends on: the
    tokenizer folder's files and the transformers version (as for the remembered tokenizer class), the
    template settings, and the source of the rules and of the code they run (every module of this package:
    chat, text encoder, verbatim proof, loading), so a change to any of them asks again. Only passes are kept:
    a failing target is checked afresh every time."""
    import hashlib

    from .loading import cache_root, tokenizer_files_key

    files = tokenizer_files_key(recipe.ref, recipe.trust_remote_code, recipe.revision)
    if files is None:
        return None
    try:
        rules = b"".join(f.read_bytes() for f in sorted(Path(__file__).parent.glob("*.py")))
    except OSError:
        return None
    digest = hashlib.blake2b(rules, digest_size=12)
    digest.update(repr((files, recipe, configured_eot_id)).encode())
    return cache_root() / "preflight-passed" / f"{digest.hexdigest()}.json"
