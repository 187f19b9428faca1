"""Chat templates of other model families, written for these tests, applied to copies of SmolLM2's tokenizer.

- `chatml_tools`: ChatML that renders `tools=` into the system prompt and groups consecutive tool results
  into one user turn of `<tool_response>` sections (the Qwen2.5 layout).
- `llama3`: Llama-3 headers, a BOS text token, and content trimmed of surrounding whitespace.
- `strip_thinking`: ChatML that drops `<think>...</think>` from assistant turns before the last user
  message (the Qwen3 layout): not append-only.
"""

import copy

import pytest

from turnrl.chat.templates import ChatTemplate

CHATML_TOOLS = r"""
{%- set sys = messages[0].content if messages and messages[0].role == 'system' else none %}
{%- if tools %}
{{- '<|im_start|>system\n' + (sys if sys is not none else 'You are a helpful assistant.') }}
{{- '\n\n# Tools\n\nYou may call functions. Their JSON signatures:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nWrite each call as {"name": ..., "arguments": ...} inside <tool_call></tool_call>.<|im_end|>\n' }}
{%- elif sys is not none %}
{{- '<|im_start|>system\n' + sys + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA3 = r"""
{{- bos_token }}
{%- for m in messages %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
LLAMA3_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

STRIP_THINKING = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- set content = m.content %}
{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip() %}
{%- endif %}
{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def tokenizer_with(base, template, special=(), bos=None):
    tok = copy.deepcopy(base)
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    if bos:
        tok.add_special_tokens({"bos_token": bos})
    tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def smol_template(smol_tokenizer):
    return ChatTemplate(smol_tokenizer)


@pytest.fixture(scope="session")
def chatml_tools(smol_tokenizer):
    return ChatTemplate(tokenizer_with(smol_tokenizer, CHATML_TOOLS))


@pytest.fixture(scope="session")
def llama3(smol_tokenizer):
    return ChatTemplate(tokenizer_with(smol_tokenizer, LLAMA3, LLAMA3_SPECIAL, bos="<|begin_of_text|>"))


@pytest.fixture(scope="session")
def strip_thinking(smol_tokenizer):
    return ChatTemplate(tokenizer_with(smol_tokenizer, STRIP_THINKING))
