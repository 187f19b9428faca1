"""Converters for the verl keys the trainer reads: the algorithm and its KL, batching, steps and warmup, the
critic, scale-out, checkpoints and logging (`algorithm.*`, `actor_rollout_ref.actor.*`, `critic.*`,
`trainer.*`), and the reward (`reward_model.*`, `custom_reward_function.*`).

Where the two count differently the converters convert: the step count is epochs x (rows // train_batch_size)
(verl's loader drops the last partial batch), mini-batches are a count per step rather than prompts per
mini-batch, warmup counts optimizer steps (x ppo_epochs x mini-batches), grpo without std division is drgrpo,
and KL settings count only when the KL is on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from turnrl.compat.verl_convert import (AR, DTYPES, Convert, Ctx, Out, Refused, as_bool, as_file, as_float,
                                        as_int, is_empty, na, one_of)
from turnrl.config.schema import COMPUTED_METRICS, JUDGED_METRICS


# -- steps, warmup and schedule ------------------------------------------------------------------------
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
    path = as_file(ctx.get("data.train_files"), "training")
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


def steps(value: Any, ctx: Ctx) -> Out:
    if not is_empty(ctx.get("trainer.total_training_steps")):
        return na("trainer.total_training_steps is set")
    as_int(value, "a positive integer")
    return Out({"trainer.steps": total_steps(ctx)}, "epochs x (rows // train_batch_size)")


def training_steps(value: Any, ctx: Ctx) -> Out:
    return na("null: from trainer.total_epochs") if is_empty(value) else Out({"trainer.steps": total_steps(ctx)})


WARMUP_NOTE = "verl counts training steps, turnrl optimizer steps (x ppo_epochs x mini-batches)"


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


def _updates_per_step(ctx: Ctx) -> int:
    batch = as_int(ctx.get("data.train_batch_size"))
    mini = as_int(ctx.get(f"{AR}.actor.ppo_mini_batch_size"))
    return as_int(ctx.get(f"{AR}.actor.ppo_epochs", 1)) * max(batch // max(mini, 1), 1)


def schedule(value: Any, ctx: Ctx) -> Out:
    if value is None:
        return na("null: lr_scheduler_type decides")
    return Out({"trainer.optim.schedule": one_of(value, {"constant": "constant", "cosine": "cosine"}, "schedule")})


# -- the algorithm and its KL --------------------------------------------------------------------------
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


def clip_ratio(value: Any, ctx: Ctx) -> Out:
    out = {}
    if not ctx.has(f"{AR}.actor.clip_ratio_low"):
        out["algo.clip_low"] = as_float(value)
    if not ctx.has(f"{AR}.actor.clip_ratio_high"):
        out["algo.clip_high"] = as_float(value)
    return Out(out) if out else na("clip_ratio_low and clip_ratio_high are both set")


# -- batching, precision, critic and scale-out ---------------------------------------------------------
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


def model_dtype(value: Any, ctx: Ctx) -> Out:
    dtype = one_of(value, DTYPES, "dtype")
    if dtype == "float16":
        raise Refused("training in float16 is not supported: use bf16 or fp32")
    if dtype == "bfloat16":   # verl's bf16 is a GPU speed choice; an AVX2 CPU would run it 60x slower than fp32
        return Out({"trainer.dtype": "auto"}, "fp32 weights, bf16 autocast where the device multiplies bf16 "
                                               "natively (GPUs, AVX512-BF16/AMX CPUs), fp32 elsewhere")
    return Out({"trainer.dtype": dtype}, "turnrl keeps fp32 weights and computes in this dtype (autocast)")


def param_dtype(value: Any, ctx: Ctx) -> Out:
    dtype = one_of(value, DTYPES, "param_dtype")
    if dtype == "float16":
        raise Refused("float16 weights are not supported: use bf16 or fp32")
    if dtype == "bfloat16":   # on an AVX2 CPU bf16 would run 60x slower: auto keeps fp32 weights off GPUs
        return Out({"trainer.param_dtype": "auto"},
                   "on GPUs bf16 weights from fp32 masters as verl's FSDP computes (the local trainer and the Ray "
                   "ranks' FSDP2); fp32 weights under autocast on CPUs")
    return Out({"trainer.param_dtype": dtype}, "fp32 weights under autocast, on the ranks too")


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


# -- checkpoints and logging ---------------------------------------------------------------------------
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


# -- rewards -------------------------------------------------------------------------------------------
def _collab(ctx: Ctx) -> bool:
    return ctx.get("reward_model.reward_manager") == "collabllm"


def reward_manager(value: Any, ctx: Ctx) -> Out:
    if value in (None, "naive"):
        return na("turnrl's reward stage: reward.functions (custom_reward_function) + tool and interaction rewards")
    if value == "collabllm":
        return Out({}, "the CollabLLM conversation-level reward: reward.judge (from reward_kwargs)")
    if value == "dapo":
        return na("turnrl's reward stage, plus DAPO's overlong penalty from reward_kwargs.overlong_buffer_cfg")
    raise Refused(f"reward manager {value!r} is not available; supported: naive, collabllm, dapo")


def metric_weight(value: Any, ctx: Ctx) -> Out:
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
