"""Chat templates: rendering, probing a template's structure, and tool-prompt injection.

`ChatTemplate` wraps a tokenizer's Jinja chat template. It learns what it needs by rendering small probe
conversations instead of hard-coding model families:
- `assistant_suffix`: the text a template writes after an assistant message's content (ChatML:
  `<|im_end|>\\n`); generation stops at the first token of it, so the rest is template glue;
- `stop_token_ids`: the end-of-turn token(s) generation must stop at (the first special token of that
  suffix, plus the tokenizer's EOS);
- `native_tools`: whether the template renders a `tools=` list at all. Templates that ignore tools (SmolLM2's
  does) get a hermes-style tool system prompt injected into the system message instead, so the model sees
  its tools either way, and the injected text is part of the messages that every re-render uses;
- reasoning: the session keeps a reply's leading `<think>...</think>` as the message's `reasoning_content`
  and the rest as `content` (`split_reasoning`), the OpenAI-style shape that judges, simulated users and the
  trajectory file see. `render` puts the reasoning back in front of the content exactly as sampled
  (`join_reasoning`) before the template runs, so the split never changes a render: templates that read
  `reasoning_content` (Qwen3, DeepSeek-R1, QwQ) take it apart from the content the same way themselves. When
  the generation prompt itself opens the thinking block (DeepSeek-R1 style `<think>\\n`), the reply holds only
  the closing tag, and the split and the join both leave the opening tag out.

`template_kwargs` are extra variables for every render (`model.chat_template_kwargs`, e.g. Qwen3's
`enable_thinking: false`), as `apply_chat_template(..., **kwargs)` passes them; a name the template never
mentions is an error (a typo would otherwise change nothing, silently).
"""

from __future__ import annotations

import functools
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any

PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_zq", "description": "probe", "parameters": {"type": "object", "properties": {}}}}
SENTINEL = "SENTINEL_ASSISTANT_TEXT_ZQ"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Arguments turnrl itself passes to apply_chat_template; they cannot be template_kwargs.
RESERVED_KWARGS = {"conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize",
                   "continue_final_message", "return_dict", "chat_template", "return_tensors", "padding",
                   "truncation", "max_length", "return_assistant_tokens_mask"}

TOOL_PROMPT = (
    "# Tools\n\nYou can call the functions described inside <tools></tools>, one JSON schema per line:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments between <tool_call> and "
    "</tool_call>, like this:\n<tool_call>\n{{\"name\": \"function_name\", \"arguments\": {{\"arg\": \"value\"}}}}\n"
    "</tool_call>\nThe results come back inside <tool_response></tool_response>."
)


class TemplateError(ValueError):
    """A chat template that turnrl cannot drive; the message says why."""


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    return TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


GIL_FREE_CHARS = 256   # texts at least this long are encoded through the batch call, which releases the GIL


def _encode_one(backend: Any, text: str) -> Any:
    """The Rust tokenizer's encoding of one text. A long one goes through `encode_batch`, the same encoding
    (ids and offsets), which lets go of the GIL while it works where `encode` holds it: a GPU engine's worker
    thread waits for the GIL to launch its next step, and a conversation of a few hundred tokens took 0.4-1.1 ms
    to encode here (10-15% more through the batch call, whose threads are the cost)."""
    if len(text) >= GIL_FREE_CHARS:
        return backend.encode_batch([text], add_special_tokens=False)[0]
    return backend.encode(text, add_special_tokens=False)


class ChatTemplate:
    def __init__(self, tokenizer: Any, tool_prompt_mode: str = "auto", template_kwargs: dict[str, Any] | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("The tokenizer has no chat template; set one (tokenizer.chat_template = ...).")
        if tool_prompt_mode not in ("auto", "native", "inject"):
            raise TemplateError(f"tool_prompt_mode must be auto, native or inject, got {tool_prompt_mode!r}.")
        self.tokenizer = tokenizer
        self.tool_prompt_mode = tool_prompt_mode
        self.template_kwargs = _checked_kwargs(tokenizer.chat_template, template_kwargs or {})
        # The n samples of a task start from the same rendered prompt: tokenize it once (about 1 us a token).
        self._prompt_ids = functools.lru_cache(maxsize=256)(lambda text: tuple(self.encode(text)))

    # -- rendering and tokenization ------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> str:
        if any(m.get("reasoning_content") is not None for m in messages):
            messages = [self.join_reasoning(m) for m in messages]
        kwargs = {**self.template_kwargs, **({"tools": tools} if tools else {})}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        backend = self._backend()
        if backend is not None:
            return _encode_one(backend, text).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text. The Rust tokenizer's batch call spreads them over its threads and releases the
        GIL while it works (a single encode holds it), so a caller on another thread keeps running."""
        backend = self._backend()
        if backend is not None:
            return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(text) for text in texts]

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        """`encode`, remembered for the last 256 texts (first prompts, rendered once per sample)."""
        return self._prompt_ids(text)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        backend = self._backend()
        if backend is not None:
            enc = _encode_one(backend, text)
            return enc.ids, enc.offsets
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def decode(self, ids: list[int]) -> str:
        backend = self._backend()
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @cached_property
    def _direct(self) -> bool:
        """Whether the tokenizer is a plain fast tokenizer whose calls go straight to its Rust `tokenizers`
        object: no subclass changes how it encodes or decodes. Calling that object directly then gives the same
        ids, offsets and text without the wrapper's per-call work (about 0.1 ms a call; the gateway and the
        agent loop encode and decode on every turn)."""
        tok = self.tokenizer
        base = next((c for c in type(tok).__mro__ if c.__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")),
                    None)
        if base is None or not hasattr(getattr(tok, "_tokenizer", None), "encode_batch"):
            return False
        names = ("__call__", "_call_one", "_encode_plus", "_batch_encode_plus", "encode", "decode", "_decode",
                 "convert_tokens_to_string", "prepare_for_tokenization")
        return all(getattr(type(tok), n, None) is getattr(base, n, None) for n in names)

    def _backend(self) -> Any:
        """The Rust tokenizer, set up as the wrapper sets it up per call, or None where only the wrapper will do
        (not a plain fast tokenizer; truncation or padding left on it by someone else's call)."""
        if not self._direct:
            return None
        backend = self.tokenizer._tokenizer
        if backend.truncation is not None or backend.padding is not None:
            return None
        split = bool(getattr(self.tokenizer, "split_special_tokens", False))
        if backend.encode_special_tokens != split:
            backend.encode_special_tokens = split
        return backend

    # -- reasoning -----------------------------------------------------------------------------------
    @cached_property
    def prompt_opens_thinking(self) -> bool:
        try:
            return self.generation_prompt.rstrip().endswith(THINK_OPEN)
        except TemplateError:  # no usable generation prompt: nothing is opened for the reply
            return False

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        """A reply -> (its leading reasoning, or None; the rest). `join_reasoning` undoes it exactly."""
        opener = "" if self.prompt_opens_thinking else THINK_OPEN
        if not text.startswith(opener):
            return None, text
        close = text.find(THINK_CLOSE, len(opener))
        if close < 0 or THINK_OPEN in text[len(opener):close]:
            return None, text
        return text[len(opener):close], text[close + len(THINK_CLOSE):]

    def join_reasoning(self, message: dict[str, Any]) -> dict[str, Any]:
        """An assistant message whose `reasoning_content` is put back in front of its content."""
        reasoning = message.get("reasoning_content")
        if message.get("role") != "assistant" or reasoning is None:
            return message
        joined = {k: v for k, v in message.items() if k != "reasoning_content"}
        opener = "" if self.prompt_opens_thinking else THINK_OPEN
        joined["content"] = f"{opener}{reasoning}{THINK_CLOSE}{message.get('content') or ''}"
        return joined

    # -- probed structure ----------------------------------------------------------------------------
    @cached_property
    def assistant_suffix(self) -> str:
        """Text the template writes right after an assistant message's content."""
        base = [{"role": "user", "content": "hi"}]
        text = self.render(base + [{"role": "assistant", "content": SENTINEL}])
        at = text.rfind(SENTINEL)
        if at < 0:
            raise TemplateError("The chat template does not render assistant message content verbatim.")
        return text[at + len(SENTINEL):]

    @cached_property
    def generation_prompt(self) -> str:
        base = [{"role": "user", "content": "hi"}]
        with_prompt = self.render(base, add_generation_prompt=True)
        without = self.render(base)
        if not with_prompt.startswith(without):
            raise TemplateError("add_generation_prompt=True does not extend the rendered conversation.")
        return with_prompt[len(without):]

    @cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        suffix_ids = self.encode(self.assistant_suffix) if self.assistant_suffix else []
        special = set(self.tokenizer.all_special_ids)
        added = {i for i, tok in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if tok.special}
        if suffix_ids and (suffix_ids[0] in special or suffix_ids[0] in added):
            ids.append(suffix_ids[0])
        eos = self.tokenizer.eos_token_id
        for e in (eos if isinstance(eos, list) else [eos]):
            if e is not None and e not in ids:
                ids.append(e)
        if not ids:
            raise TemplateError("Found no end-of-turn token: the template's assistant suffix starts with no "
                                "special token and the tokenizer has no EOS token.")
        return tuple(ids)

    @cached_property
    def native_tools(self) -> bool:
        if self.tool_prompt_mode == "native":
            return True
        if self.tool_prompt_mode == "inject":
            return False
        try:
            text = self.render([{"role": "user", "content": "hi"}], tools=[PROBE_TOOL])
        except Exception:  # noqa: BLE001 - a template that breaks on tools= does not support them
            return False
        return PROBE_TOOL["function"]["name"] in text

    @cached_property
    def renders_tool_role(self) -> bool:
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "call"},
                {"role": "tool", "content": SENTINEL, "name": "probe_tool_zq"}]
        try:
            return SENTINEL in self.render(msgs)
        except Exception:  # noqa: BLE001 - e.g. templates that raise on unknown roles
            return False

    # -- message preparation -------------------------------------------------------------------------
    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages (with an injected tool prompt where needed) and the `tools=` argument for `render`."""
        messages = [dict(m) for m in messages]
        if not tools:
            return messages, None
        if self.native_tools:
            return messages, tools
        prompt = tool_prompt(tools)
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{prompt}"
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        return messages, None

    def tool_message(self, name: str, text: str, call_id: str = "") -> dict[str, Any]:
        """A tool result as a chat message this template renders."""
        if self.renders_tool_role:
            msg = {"role": "tool", "name": name, "content": text}
            if call_id:
                msg["tool_call_id"] = call_id
            return msg
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}


def _checked_kwargs(template: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TemplateError(f"chat_template_kwargs must be a mapping of names to values, got {kwargs!r}.")
    reserved = sorted(RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise TemplateError(f"chat_template_kwargs cannot set {reserved}: turnrl passes those itself.")
    text = template if isinstance(template, str) else json.dumps(template)
    unread = [k for k in kwargs if not re.search(rf"\b{re.escape(k)}\b", text)]
    if unread:
        raise TemplateError(f"the chat template never reads {unread}: drop them from chat_template_kwargs (or check "
                            "the spelling; e.g. Qwen3 reads 'enable_thinking').")
    return dict(kwargs)


def load_template(model_dir: str | Path, chat_template: str | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> ChatTemplate:
    """The chat template of the model in `model_dir` (its tokenizer's, or the Jinja file `chat_template` in its
    place: `model.chat_template`), rendered with `template_kwargs` (`model.chat_template_kwargs`)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template:
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise TemplateError(f"model.chat_template: no file {chat_template!r}; give the path of a Jinja chat "
                                "template")
        tokenizer.chat_template = path.read_text()
    return ChatTemplate(tokenizer, template_kwargs=template_kwargs)
