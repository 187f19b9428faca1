"""Converters for the verl keys the rollout reads: data files and prompt limits, the chat template, the engine
and its sampling, agent loops and tools (`data.*`, `actor_rollout_ref.model.*`, `actor_rollout_ref.rollout.*`).

verl's lengths combine: turnrl's context is prompt + response, and a per-turn cap comes from the response
budget (verl has none). Truncating samplers (top-p < 1, top-k > 0) are refused with vLLM, whose logprobs are
then the truncated distribution's. Prompts are never cut: over-long prompts are filtered or refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from turnrl.compat.verl_convert import (AR, Convert, Ctx, Out, Refused, as_bool, as_file, as_float, as_int,
                                        is_empty, na, one_of, only)


# -- data files and prompt limits ----------------------------------------------------------------------
def data_file(key: str, what: str, required: bool) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        path = as_file(value, what)
        if path is None:
            if required:
                raise Refused(f"empty: give the {what} parquet file (verl's rows are read as they are)")
            return na("empty: no eval set")
        return Out({key: str(path)})
    return c


def max_rows(key: str, files: str) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        if is_empty(ctx.get(files)):
            return na(f"{files} is empty")
        if is_empty(value) or as_int(value) < 0:
            return na("-1: all rows")
        return Out({key: as_int(value)}, "the first N rows")
    return c


def prompt_check(value: Any, ctx: Ctx) -> Out:
    if as_bool(value):
        return Out({}, "rows whose prompt (with tool schemas) is over data.max_prompt_length tokens are dropped "
                       "before training")
    return na("false: no filtering")


def truncation(value: Any, ctx: Ctx) -> Out:
    if value == "error":
        if ctx.get("data.filter_overlong_prompts") is True:
            return na("over-long prompts are filtered first")
        return Out({}, "a prompt over data.max_prompt_length tokens is an error before training")
    raise Refused(f"truncation={value!r}: turnrl never cuts a prompt (the ledger must hold what the model saw); "
                  "use truncation=error or data.filter_overlong_prompts=true")


def max_prompt(value: Any, ctx: Ctx) -> Out:
    total = as_int(value) + as_int(ctx.get("data.max_response_length"))
    out: dict[str, Any] = {"rollout.max_context_tokens": total}
    if not ctx.has(f"{AR}.rollout.max_model_len"):
        out["engine.max_model_len"] = total
    return Out(out, "context = prompt + response; prompts over the limit: see data.filter_overlong_prompts")


def max_response(value: Any, ctx: Ctx) -> Out:
    n = as_int(value)
    return Out({"rollout.max_response_tokens": n, "rollout.sampling.max_tokens_per_turn": n},
               "all tokens after the prompt; verl has no per-turn cap, so a turn may use what is left")


def rollout_length(data_key: str) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        if value == ctx.get(data_key):
            return na(f"the same as {data_key}")
        raise Refused(f"differs from {data_key}: set {data_key} instead")
    return c


def turns(key: str) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        if value is None:  # verl: unlimited; every turn takes at least one token of the response budget
            return Out({key: as_int(ctx.get("data.max_response_length"))},
                       "null (unlimited): bounded by the response budget")
        return Out({key: as_int(value)})
    return c


# -- the model's chat template -------------------------------------------------------------------------
def tokenizer_path(value: Any, ctx: Ctx) -> Out:
    if is_empty(value) or value == ctx.get(f"{AR}.model.path"):
        return na("the model's tokenizer")
    raise Refused("the model's own tokenizer is used")


def _template_reads(ctx: Ctx, name: str) -> bool:
    """Whether the model's chat template reads variable `name` (tokenizer_config.json or chat_template.jinja)."""
    from turnrl.models import ModelError, resolve
    try:
        model = resolve(str(ctx.get(f"{AR}.model.path")))
    except ModelError as exc:
        raise Refused(f"cannot read the model's chat template: {exc}") from None
    texts = [p.read_text() for p in model.glob("*.jinja")]
    config = model / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template") or ""
        texts.append(template if isinstance(template, str) else json.dumps(template))
    return any(re.search(rf"\b{re.escape(name)}\b", t) for t in texts)


def template_kwarg(value: Any, ctx: Ctx) -> Out:
    name = ctx.key.rsplit(".", 1)[-1]
    if not _template_reads(ctx, name):
        return na(f"the model's chat template does not read '{name}'")
    return Out({f"model.chat_template_kwargs.{name}": value})


# -- the engine and its sampling -----------------------------------------------------------------------
def engine(value: Any, ctx: Ctx) -> Out:
    if value == "sglang":
        raise Refused("SGLang is not available here; use rollout.name=vllm (the same multi-turn agent loop runs "
                      "on every engine) or hf, or vLLM servers (engine.kind=vllm_server; README 'Rolling out on "
                      "vLLM servers' says what an SGLang server engine would take)")
    return Out({"engine.kind": one_of(value, {"vllm": "vllm", "hf": "hf"}, "rollout engine")})


def temperature(value: Any, ctx: Ctx) -> Out:
    if ctx.get(f"{AR}.rollout.do_sample") is False:
        return na("do_sample=false: greedy")
    return Out({"rollout.sampling.temperature": as_float(value)})


def do_sample(value: Any, ctx: Ctx) -> Out:
    return na("sampling (temperature)") if as_bool(value) else Out({"rollout.sampling.temperature": 0.0}, "greedy")


def _no_truncation_on_vllm(ctx: Ctx, what: str) -> None:
    if ctx.get(f"{AR}.rollout.name") == "vllm":
        raise Refused(f"{what} with vLLM: its logprobs are then the truncated, renormalised distribution, not the "
                      "one the trainer recomputes, so turnrl's vLLM engine refuses it; use rollout.name=hf, or no "
                      "truncation")


def top_p(value: Any, ctx: Ctx) -> Out:
    p = as_float(value)
    if p < 1:
        _no_truncation_on_vllm(ctx, f"top_p={p}")
    return Out({"rollout.sampling.top_p": p})


def top_k(value: Any, ctx: Ctx) -> Out:
    k = as_int(value)
    if k > 0:
        _no_truncation_on_vllm(ctx, f"top_k={k}")
    return Out({"rollout.sampling.top_k": max(k, 0)}, "-1 = off = turnrl's 0" if k < 0 else "")


def val_kwarg(ok: tuple[Any, ...]) -> Convert:
    return only(ok, "turnrl evaluates greedily, one sample per row",
                "turnrl evaluates greedily with one sample per row (`turnrl eval` / trainer.eval_every)")


# -- agent loops and tools -----------------------------------------------------------------------------
def tool_parser(value: Any, ctx: Ctx) -> Out:
    from turnrl.chat.parsers import PARSERS
    if value not in PARSERS and value != "auto":
        raise Refused(f"tool-call format {value!r} has no parser here; known: {', '.join(PARSERS)}, auto")
    return Out({"rollout.tool_parser": value})


def config_file(key: str, what: str) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        path = as_file(value, what)
        return Out({key: str(path)}) if path else na("no file")
    return c


def agent_loops(value: Any, ctx: Ctx) -> Out:
    """verl's agent-loop registry file: a list of {name, _target_}; only loop names turnrl runs are accepted."""
    from turnrl.data.rows import AGENT_NAMES
    path = as_file(value, "agent loop config")
    if path is None:
        return na("no file")
    import yaml
    entries = yaml.safe_load(path.read_text()) or []
    names = [e.get("name") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else None
    if names is None:
        raise Refused(f"'{path}' must hold a list of {{name, _target_}} entries")
    unknown = [n for n in names if n not in AGENT_NAMES]
    if unknown:
        raise Refused(f"'{path}' registers agent loop(s) {unknown}, which turnrl cannot run: it runs one agent loop "
                      f"for rows named {', '.join(AGENT_NAMES)} (multi-turn whenever a row has tools or an "
                      "interaction)")
    return na(f"turnrl's one agent loop runs rows named {', '.join(names) or 'nothing'} from this file")


def agent_default(value: Any, ctx: Ctx) -> Out:
    from turnrl.data.rows import AGENT_NAMES
    one_of(value, {n: n for n in AGENT_NAMES}, "agent loop")
    return na("a row without agent_name is multi-turn when it has tools or an interaction, else single-turn")
