"""Converters for verl keys: the types the key table is made of, and the conversions that read several keys.

A converter takes (value, ctx) and returns `Out` (turnrl keys to set, a note, or not applicable for this
value with the reason), or raises `Refused` for a value turnrl cannot honour. `Ctx` shows the whole command
line, with verl's defaults for what it leaves out, so conversions can combine keys: the step count is epochs x
(rows // train_batch_size), the context is prompt + response, grpo without std division is drgrpo, KL settings
count only when the KL is on. Unit conversions and what differs are stated in the notes the table prints.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

AR = "actor_rollout_ref"


class Refused(ValueError):
    """A verl value turnrl cannot honour; the message says why and what to do."""


@dataclass
class Out:
    assign: dict[str, Any] = field(default_factory=dict)   # turnrl dotted key -> value
    note: str = ""
    applicable: bool = True     # False: not applicable for this value (the note says why)


def na(reason: str) -> Out:
    return Out({}, reason, applicable=False)


Convert = Callable[[Any, "Ctx"], Out]


@dataclass(frozen=True)
class Rule:
    pattern: str                # a verl key; `*` matches one dotted part, a final `**` any rest
    target: str                 # the turnrl side, as the key table shows it ('' when not applicable)
    note: str = ""              # the reason (not applicable) or what differs
    convert: Convert | None = None   # None: always not applicable


class Ctx:
    """The whole verl command line as converters see it: given values, else verl's defaults."""

    def __init__(self, given: dict[str, Any], defaults: dict[str, Any] | None = None):
        self.given = given
        self.defaults = defaults or {}
        self.key = ""           # the key being converted (for rules whose pattern has a `*`)

    def has(self, key: str) -> bool:
        return key in self.given

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.given:
            return self.given[key]
        if key in self.defaults:
            value = self.defaults[key]
            return value(self) if callable(value) else value
        return default

    def under(self, prefix: str) -> dict[str, Any]:
        """`prefix.a=1 prefix.b=2` (or `prefix={a: 1, b: 2}`) as {a: 1, b: 2}."""
        out = dict(self.given.get(prefix) or {}) if isinstance(self.given.get(prefix), dict) else {}
        for key, value in self.given.items():
            if key.startswith(prefix + "."):
                out[key[len(prefix) + 1:]] = value
        return out


# -- value helpers -------------------------------------------------------------------------------------
def as_int(value: Any, what: str = "an integer") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise Refused(f"must be {what}, got {value!r}")
    return int(value)


def as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(f"must be a number, got {value!r}")
    return float(value)


def as_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Refused(f"must be true or false, got {value!r}")
    return value


def is_empty(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


def one_of(value: Any, table: dict[Any, Any], what: str) -> Any:
    if value not in table:
        raise Refused(f"{what} {value!r} is not supported here; supported: {', '.join(map(str, table))}")
    return table[value]


def to(key: str, check: Callable[[Any], Any] = lambda v: v, note: str = "") -> Convert:
    return lambda value, ctx: Out({key: check(value)}, note)


def na_unless_set(reason_unset: str, refusal: str) -> Convert:
    """Not applicable while null/empty/false/default; any other value is refused."""
    def convert(value: Any, ctx: Ctx) -> Out:
        if is_empty(value) or value is False:
            return na(reason_unset)
        raise Refused(refusal)
    convert.doc = f"unset: {reason_unset}; set: error ({refusal})"
    return convert


def refuse(reason: str) -> Convert:
    def convert(value: Any, ctx: Ctx) -> Out:
        raise Refused(reason)
    convert.doc = f"error: {reason}"
    return convert


def only(ok: tuple[Any, ...], reason: str, refusal: str) -> Convert:
    """Not applicable for the values in `ok` (they are what turnrl does anyway); others are refused."""
    def convert(value: Any, ctx: Ctx) -> Out:
        if value in ok:
            return na(reason)
        raise Refused(refusal)
    shown = " or ".join("null" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in ok)
    convert.doc = f"{shown}: {reason}; other values: error ({refusal})"
    return convert


def _path(value: Any, what: str) -> Path | None:
    if isinstance(value, list):
        if len(value) > 1:
            raise Refused(f"{len(value)} {what} files given; turnrl reads one file: concatenate them "
                          "(pyarrow.concat_tables) into one parquet")
        value = value[0] if value else None
    if is_empty(value):
        return None
    if not isinstance(value, str):
        raise Refused(f"must be a file path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_file():
        raise Refused(f"{what} file '{path}' does not exist")
    return path


def _rows_in(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.ParquetFile(path).metadata.num_rows
    if path.suffix in (".jsonl", ".json"):
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    raise Refused(f"'{path}': unknown data format '{path.suffix}'; use .parquet or .jsonl")


def total_steps(ctx: Ctx) -> int:
    """verl's step count: total_training_steps, else epochs x full batches (its loader drops the last partial one)."""
    if not is_empty(ctx.get("trainer.total_training_steps")):
        return as_int(ctx.get("trainer.total_training_steps"), "a positive integer")
    path = _path(ctx.get("data.train_files"), "training")
    if path is None:
        raise Refused("data.train_files is not set: verl needs it too (the steps are counted from its rows)")
    rows = _rows_in(path)
    cap = ctx.get("data.train_max_samples")
    if not is_empty(cap) and as_int(cap) > 0:
        rows = min(rows, as_int(cap))
    batch = as_int(ctx.get("data.train_batch_size"), "a positive integer")
    if rows // batch == 0:
        raise Refused(f"{path} has {rows} row(s), fewer than data.train_batch_size={batch}: verl's loader drops "
                      "the last partial batch, so no step would run; lower data.train_batch_size")
    return (rows // batch) * as_int(ctx.get("trainer.total_epochs"), "a positive integer")


def _collab(ctx: Ctx) -> bool:
    return ctx.get("reward_model.reward_manager") == "collabllm"


# -- converters that read several keys -----------------------------------------------------------------
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "mse", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "low_var_kl"}  # verl clamps k3 too
ESTIMATORS = {"grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp",
              "reinforce_plus_plus_baseline": "reinforce_pp_baseline", "gae": "gae"}


def adv_estimator(value: Any, ctx: Ctx) -> Out:
    name = one_of(value, ESTIMATORS, "adv_estimator")
    if name == "grpo" and ctx.get("algorithm.norm_adv_by_std_in_grpo", True) is False:
        return Out({"algo.advantage": "drgrpo"}, "norm_adv_by_std_in_grpo=false: Dr.GRPO (no std division)")
    return Out({"algo.advantage": name})


def norm_adv(value: Any, ctx: Ctx) -> Out:
    if ctx.get("algorithm.adv_estimator") != "grpo":
        return na("read only with adv_estimator=grpo")
    return Out({}, "grpo" if as_bool(value) else "drgrpo (set with algorithm.adv_estimator)")


def use_kl_loss(value: Any, ctx: Ctx) -> Out:
    if as_bool(value):
        if ctx.get("algorithm.use_kl_in_reward") is True:
            raise Refused("both use_kl_loss and algorithm.use_kl_in_reward: turnrl applies the KL in the loss or "
                          "in the reward, not both")
        return Out({}, "KL in the loss: algo.kl_coef / kl_type from kl_loss_coef / kl_loss_type")
    if ctx.get("algorithm.use_kl_in_reward") is True:
        return na("the KL is in the reward (algorithm.use_kl_in_reward)")
    return Out({"algo.kl_coef": 0.0}, "no KL term")


def kl_loss(key: str, convert: Callable[[Any], Any]) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        if ctx.get(f"{AR}.actor.use_kl_loss") is not True:
            return na("actor.use_kl_loss is false")
        return Out({key: convert(value)})
    return c


def kl_reward(key: str, convert: Callable[[Any], Any]) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        if ctx.get("algorithm.use_kl_in_reward") is not True:
            return na("algorithm.use_kl_in_reward is false")
        return Out({key: convert(value)})
    return c


def kl_type(value: Any) -> str:
    return one_of(value, KL_TYPES, "KL estimator")


def kl_ctrl_type(value: Any, ctx: Ctx) -> Out:
    if value == "fixed" or ctx.get("algorithm.use_kl_in_reward") is not True:
        return na("a fixed coefficient (turnrl's only kind)" if value == "fixed" else "use_kl_in_reward is false")
    raise Refused("an adaptive KL controller is not available: use kl_ctrl.type=fixed")


def mini_batches(value: Any, ctx: Ctx) -> Out:
    mini = as_int(value, "a positive integer")
    batch = as_int(ctx.get("data.train_batch_size"), "a positive integer")
    default = "" if ctx.has(ctx.key) else " (verl's default)"
    if mini <= 0 or mini > batch:
        raise Refused(f"ppo_mini_batch_size={mini}{default} must be in 1..data.train_batch_size={batch} (verl "
                      "refuses this too)")
    if batch % mini:
        raise Refused(f"data.train_batch_size={batch} must be a multiple of ppo_mini_batch_size={mini}{default}")
    return Out({"trainer.mini_batches": batch // mini},
               f"verl counts prompts per mini-batch; turnrl counts mini-batches per step ({batch} / {mini})")


def clip_ratio(value: Any, ctx: Ctx) -> Out:
    out = {}
    if not ctx.has(f"{AR}.actor.clip_ratio_low"):
        out["algo.clip_low"] = as_float(value)
    if not ctx.has(f"{AR}.actor.clip_ratio_high"):
        out["algo.clip_high"] = as_float(value)
    return Out(out) if out else na("clip_ratio_low and clip_ratio_high are both set")


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


def engine(value: Any, ctx: Ctx) -> Out:
    if value == "sglang":
        raise Refused("SGLang is not available here; use rollout.name=vllm (the same multi-turn agent loop runs "
                      "on every engine) or hf")
    return Out({"engine.kind": one_of(value, {"vllm": "vllm", "hf": "hf"}, "rollout engine")})


DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32", "auto": "auto"}


def model_dtype(value: Any, ctx: Ctx) -> Out:
    dtype = one_of(value, DTYPES, "dtype")
    if dtype == "float16":
        raise Refused("training in float16 is not supported: use bf16 or fp32")
    return Out({"trainer.dtype": dtype}, "turnrl keeps fp32 weights and computes in this dtype (autocast)")


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


def tool_parser(value: Any, ctx: Ctx) -> Out:
    from turnrl.chat.parsers import PARSERS
    if value not in PARSERS:
        raise Refused(f"tool-call format {value!r} has no parser here; known: {', '.join(PARSERS)}")
    return Out({"rollout.tool_parser": value})


def config_file(key: str, what: str) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        path = _path(value, what)
        return Out({key: str(path)}) if path else na("no file")
    return c


def agent_loops(value: Any, ctx: Ctx) -> Out:
    """verl's agent-loop registry file: a list of {name, _target_}; only loop names turnrl runs are accepted."""
    from turnrl.data.rows import AGENT_NAMES
    path = _path(value, "agent loop config")
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
    raise Refused(f"the model's chat template reads '{name}', and turnrl renders templates without extra "
                  "arguments: drop the key, or use a model/template without it")


def save_every(value: Any, ctx: Ctx) -> Out:
    n = as_int(value)
    return Out({"trainer.save_every": max(n, 0)}, "turnrl also saves after the last step")


def eval_every(value: Any, ctx: Ctx) -> Out:
    n = as_int(value)
    if n > 0 and is_empty(ctx.get("data.val_files")):
        return na("no eval set (data.val_files is empty)")
    return Out({"trainer.eval_every": max(n, 0)})


def output_dir(value: Any, ctx: Ctx) -> Out:
    return Out({"output_dir": str(Path(str(value)).expanduser())}, "checkpoints go to OUTPUT_DIR/checkpoints")


def resume_mode(value: Any, ctx: Ctx) -> Out:
    one_of(value, {"auto": 0, "disable": 0, "resume_path": 0}, "resume_mode")
    if value == "disable":
        return na("start fresh")
    if value == "resume_path":
        path = Path(str(ctx.get("trainer.resume_from_path") or "")).expanduser()
        if not (path / "trainer_state.json").is_file():
            raise Refused(f"trainer.resume_from_path '{path}' is not a turnrl checkpoint (no trainer_state.json); "
                          "verl's FSDP checkpoints cannot be loaded here")
        return Out({"trainer.resume": str(path)})
    root = Path(str(ctx.get("trainer.default_local_dir"))).expanduser() / "checkpoints"
    if (root / "latest").is_file():
        return Out({"trainer.resume": "latest"}, f"resumes from the latest checkpoint in {root}")
    return na(f"auto: no checkpoint in {root} yet, so the run starts fresh")


def resume_path(value: Any, ctx: Ctx) -> Out:
    if ctx.get("trainer.resume_mode") == "resume_path":
        return Out({}, "used by trainer.resume_mode=resume_path")
    return na("verl reads it only with trainer.resume_mode=resume_path")


SINKS = ("console", "wandb", "tensorboard", "mlflow")


def logger(value: Any, ctx: Ctx) -> Out:
    sinks = [value] if isinstance(value, str) else value
    if not isinstance(sinks, list):
        raise Refused(f"must be a list of logger names, got {value!r}")
    for s in sinks:
        one_of(s, {k: k for k in SINKS}, "logger")
    return Out({"logging.sinks": list(dict.fromkeys(sinks))}, "metrics.jsonl is always written too")


def steps(value: Any, ctx: Ctx) -> Out:
    if not is_empty(ctx.get("trainer.total_training_steps")):
        return na("trainer.total_training_steps is set")
    as_int(value, "a positive integer")
    return Out({"trainer.steps": total_steps(ctx)}, "epochs x (rows // train_batch_size)")


def training_steps(value: Any, ctx: Ctx) -> Out:
    return na("null: from trainer.total_epochs") if is_empty(value) else Out({"trainer.steps": total_steps(ctx)})


def warmup_steps(value: Any, ctx: Ctx) -> Out:
    if is_empty(value) or as_int(value) < 0:
        return na("-1: from lr_warmup_steps_ratio")
    return Out({"trainer.optim.warmup_steps": as_int(value) * _updates_per_step(ctx)}, WARMUP_NOTE)


def warmup_ratio(value: Any, ctx: Ctx) -> Out:
    given = ctx.get(f"{AR}.actor.optim.lr_warmup_steps")
    if not is_empty(given) and as_int(given) >= 0:
        return na("lr_warmup_steps is set")
    if as_float(value) == 0:
        return Out({"trainer.optim.warmup_steps": 0})
    steps = int(as_float(value) * total_steps(ctx))
    return Out({"trainer.optim.warmup_steps": steps * _updates_per_step(ctx)}, WARMUP_NOTE)


WARMUP_NOTE = "verl counts training steps, turnrl optimizer steps (x ppo_epochs x mini-batches)"


def _updates_per_step(ctx: Ctx) -> int:
    batch = as_int(ctx.get("data.train_batch_size"))
    mini = as_int(ctx.get(f"{AR}.actor.ppo_mini_batch_size"))
    return as_int(ctx.get(f"{AR}.actor.ppo_epochs", 1)) * max(batch // max(mini, 1), 1)


def schedule(value: Any, ctx: Ctx) -> Out:
    if value is None:
        return na("null: lr_scheduler_type decides")
    return Out({"trainer.optim.schedule": one_of(value, {"constant": "constant", "cosine": "cosine"}, "schedule")})


def data_file(key: str, what: str, required: bool) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        path = _path(value, what)
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


def reward_manager(value: Any, ctx: Ctx) -> Out:
    if value in (None, "naive"):
        return na("turnrl's reward stage: reward.functions (custom_reward_function) + tool and interaction rewards")
    if value == "collabllm":
        return Out({}, "the CollabLLM conversation-level reward: reward.judge (from reward_kwargs)")
    raise Refused(f"reward manager {value!r} is not available; supported: naive, collabllm")


def metric_weight(value: Any, ctx: Ctx) -> Out:
    from turnrl.rewards.judge import COMPUTED_METRICS, JUDGED_METRICS
    if not _collab(ctx):
        raise Refused("metric_weights belong to reward_model.reward_manager=collabllm")
    metric = ctx.key.rsplit(".", 1)[-1]
    valid = [*JUDGED_METRICS, *COMPUTED_METRICS]
    if metric not in valid:
        raise Refused(f"unknown CollabLLM metric '{metric}' (verl would score it 0 with only a printed line); "
                      f"valid: {', '.join(valid)}")
    return Out({f"reward.judge.metric_weights.{metric}": as_float(value)})


JUDGE_KWARGS = {"model": "model", "max_tokens": "max_tokens", "temperature": "temperature", "api_base": "base_url",
                "base_url": "base_url", "api_key": "api_key", "timeout": "timeout_s", "num_retries": "retries",
                "max_retries": "retries"}


def judge_kwarg(value: Any, ctx: Ctx) -> Out:
    if not _collab(ctx):
        raise Refused("llm_judge_kwargs belong to reward_model.reward_manager=collabllm")
    name = ctx.key.rsplit(".", 1)[-1]
    if name == "top_p":
        return Out({"reward.judge.llm.extra_body.top_p": as_float(value)})
    field_name = one_of(name, JUDGE_KWARGS, "llm_judge_kwargs key")
    if field_name == "api_key" and not str(value).startswith(("env:", "file:")):
        raise Refused("write the key's place, not the key: env:NAME or file:PATH")
    out = {f"reward.judge.llm.{field_name}": value}
    note = ""
    if field_name == "model":
        out["reward.judge.llm.backend"] = "openai"
        note = ("an OpenAI-compatible endpoint at reward.judge.llm.base_url (litellm's provider prefixes need a "
                "LiteLLM proxy there); or --set reward.judge.llm.backend=local with a local model")
    return Out(out, note)


def repeat_rollouts(value: Any, ctx: Ctx) -> Out:
    if not _collab(ctx):
        return na("only the CollabLLM reward samples futures")
    return Out({"reward.judge.num_repeat_rollouts": as_int(value)})


def reward_fn(value: Any, ctx: Ctx) -> Out:
    if is_empty(value):
        return na("no custom reward function")
    if _collab(ctx):
        return Out({}, "replaced: with reward_manager=collabllm this is CollabLLM's conversation-level reward, which "
                       "turnrl computes itself (reward.judge); the file is not loaded", applicable=False)
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise Refused(f"reward function file '{path}' does not exist")
    name = ctx.get("custom_reward_function.name") or "compute_score"
    out: dict[str, Any] = {"reward.functions": [f"{path}:{name}"]}
    kwargs = ctx.under("custom_reward_function.reward_kwargs")
    if kwargs:
        out["reward.function_kwargs"] = [kwargs]
    return Out(out, "called as compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)")


def with_reward_path(value: Any, ctx: Ctx) -> Out:
    if is_empty(ctx.get("custom_reward_function.path")) or _collab(ctx):
        return na("no custom reward function is loaded")
    return Out({}, "with custom_reward_function.path")


def rollout_is(value: Any, ctx: Ctx) -> Out:
    if is_empty(value):
        return na("off")
    if value != "token":
        raise Refused("only rollout_is=token (truncated importance sampling per token) is available")
    return Out({"algo.tis_cap": as_float(ctx.get("algorithm.rollout_correction.rollout_is_threshold", 2.0))})


def tokenizer_path(value: Any, ctx: Ctx) -> Out:
    if is_empty(value) or value == ctx.get(f"{AR}.model.path"):
        return na("the model's tokenizer")
    raise Refused("the model's own tokenizer is used")


def critic(value: Any, ctx: Ctx) -> Out:
    if ctx.get("algorithm.adv_estimator") != "gae":
        return na("no critic: adv_estimator is not gae")
    return na("turnrl's critic (initialised from the policy) trains with the actor's batching and sharding")


def critic_lr(value: Any, ctx: Ctx) -> Out:
    if ctx.get("algorithm.adv_estimator") != "gae":
        return na("no critic: adv_estimator is not gae")
    if as_float(value) != as_float(ctx.get(f"{AR}.actor.optim.lr")):
        raise Refused("turnrl trains the critic with the actor's optimizer: its lr must equal actor.optim.lr")
    return na("the actor's optimizer")


def scale_out(key: str) -> Convert:
    """trainer.nnodes / n_gpus_per_node: one GPU on one node is turnrl's local trainer; more is its Ray placement
    `colocated` (engines share the trainer's GPUs, as verl's hybrid engine does) with FSDP2 training ranks."""
    def c(value: Any, ctx: Ctx) -> Out:
        n = as_int(value)
        if n < 1:
            raise Refused(f"must be at least 1, got {n}")
        many = as_int(ctx.get("trainer.nnodes", 1)) > 1 or as_int(ctx.get("trainer.n_gpus_per_node", 1)) > 1
        if not many:
            return na("one device: turnrl's local trainer")
        return Out({"trainer.placement": "colocated", key: n}, "Ray: engines and FSDP2 ranks share the GPUs")
    return c


def positive_one(what: str) -> Convert:
    def c(value: Any, ctx: Ctx) -> Out:
        if as_int(value) <= 1:
            return na("1: nothing to split")
        raise Refused(f"{what} > 1 is not available here")
    c.doc = "1: not applicable; > 1: error"
    return c


def val_kwarg(ok: tuple[Any, ...]) -> Convert:
    return only(ok, "turnrl evaluates greedily, one sample per row",
                "turnrl evaluates greedily with one sample per row (`turnrl eval` / trainer.eval_every)")


