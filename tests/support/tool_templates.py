"""Targets whose chat templates render tools, written here to reproduce each family's documented tool format
on offline vocabularies (as `tokenizer_families` does for plain chat):

- `qwen_tools`: Qwen2.5 / Hermes style: the tools listed as JSON inside `<tools></tools>` in the system turn,
  each call `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` after the assistant's text, tool
  results gathered into a user turn inside `<tool_response>` (SmolLM2's ChatML vocabulary, the tool tags as
  added tokens, as Qwen2.5 has them);
- `llama31_tools`: Llama-3.1 JSON tool calling: the tools as JSON in the first user turn, a call written as
  `{"name": ..., "parameters": ...}` ending the turn with `<|eot_id|>`, results in `ipython` turns;
- `kimi_tools`: the Kimi K2.5 stand-in (`kimi_standin`), whose hand-written template declares tools in a
  `tool_declare` system turn and writes calls with Kimi's tool-call tokens: it proves tool rendering of a
  template of that shape on the slow-tokenizer path, not Moonshot's own template.

None of these is a family's real template file: each proves the rebuild of a template of that documented
shape.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .tokenizer_families import _smollm2_json, llama3

QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}\
{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": ' }}
{{- '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) \
or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31_TOOLS_TEMPLATE = """\
{{- bos_token }}
{%- set ns = namespace(first_user=true) %}
{%- for message in messages %}
{%- if message.role == 'user' and tools and ns.first_user %}
{%- set ns.first_user = false %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper '
    'arguments that best answers the given prompt.\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    'value}. Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- message.content | trim + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}
{{- tool_call.arguments | tojson }}
{{- '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
{{- message.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""


def qwen_tools() -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_str(json.dumps(_smollm2_json()))  # ChatML: <|im_start|>, <|im_end|> are special
    tok.add_tokens(
        [
            AddedToken(t, special=False)
            for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", chat_template=QWEN_TOOLS_TEMPLATE
    )


# Llama-3's pre-tokenizer pattern: a run of newlines is its own word (`\n\n` before a call's `{` stays one
# token, as the real Llama-3 tokenizer has it; GPT-2's pattern, SmolLM2's, splits it in two).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def llama31_tools() -> PreTrainedTokenizerFast:
    """The Llama-3 family's tokenizer with Llama-3's own pre-tokenizer split and the tools template."""
    tok = llama3()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.chat_template = LLAMA31_TOOLS_TEMPLATE
    return tok


def kimi_tools(folder: Path):
    """The Kimi K2.5 stand-in (not Moonshot's template), built into `folder` and loaded as a Kimi target is
    (trust_remote_code)."""
    from eagle3_assets.core.target_model.loading import load_tokenizer

    from .kimi_standin import build_kimi_standin

    build_kimi_standin(folder)
    return load_tokenizer(str(folder), True, None)


TOOL_FAMILIES = {"qwen_tools": qwen_tools, "llama31_tools": llama31_tools}
