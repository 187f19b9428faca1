"""Converters for verl's algorithm variants: policy loss modes (`actor.policy_loss.loss_mode`), rollout correction
(`algorithm.rollout_correction.*`) and DAPO (`algorithm.filter_groups.*`, `data.gen_batch_size`, the DAPO reward
manager's overlong buffer).

Loss modes: vanilla -> ppo, gspo, cispo, geo_mean -> gmpo. verl's gspo and geo_mean average per sequence whatever
`loss_agg_mode` says, so they set `algo.loss_agg=seq-mean-token-mean` and `loss_agg_mode` is not applicable for
them; the dual clip (`clip_ratio_c`) belongs to vanilla alone.

Rollout correction: both generations of verl's keys are read. The first (rollout_rs = token | sequence | geometric
with `rollout_rs_threshold` as the upper ratio bound, `rollout_rs_threshold_lower` the lower one (default its
reciprocal, or rollout_is_threshold when no upper bound is given), and `rollout_token_veto_threshold`) maps one to
one. The second names options by statistic (token_k1, seq_sum_k1, seq_mean_k1 bound -log r, with thresholds
"lower_upper" as ratios): keeping -log r in [log lower, log upper] keeps r in [1 / upper, 1 / lower], which is
what turnrl is given. Its k2 / k3 options (bounds on squared or k3 divergences) and chained criteria are refused,
as are bypass mode and batch-normalised weights.
"""

from __future__ import annotations

from typing import Any

from turnrl.compat.verl_convert import AR, Ctx, Out, Refused, as_bool, as_float, as_int, is_empty, na, one_of

RC = "algorithm.rollout_correction"
FG = "algorithm.filter_groups"
OB = "reward_model.reward_kwargs.overlong_buffer_cfg"

# -- policy loss modes ---------------------------------------------------------------------------------
LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo", "geo_mean": "gmpo"}
SEQ_MODES = ("gspo", "geo_mean")


def _mode(ctx: Ctx) -> Any:
    return ctx.get(f"{AR}.actor.policy_loss.loss_mode", "vanilla")


def loss_mode(value: Any, ctx: Ctx) -> Out:
    mode = one_of(value, LOSS_MODES, "policy_loss.loss_mode")
    if value in SEQ_MODES:
        return Out({"algo.loss_mode": mode, "algo.loss_agg": "seq-mean-token-mean"},
                   "verl averages it per sequence whatever loss_agg_mode says")
    return Out({"algo.loss_mode": mode})


def loss_agg_mode(value: Any, ctx: Ctx) -> Out:
    if _mode(ctx) in SEQ_MODES:
        return na(f"loss_mode={_mode(ctx)} averages per sequence (algo.loss_agg=seq-mean-token-mean)")
    return Out({"algo.loss_agg": one_of(value, {m: m for m in (
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean")}, "loss_agg_mode")})


def clip_ratio_c(value: Any, ctx: Ctx) -> Out:
    if _mode(ctx) != "vanilla":
        return na(f"the dual clip is vanilla PPO's; loss_mode={_mode(ctx)} has none")
    return Out({"algo.dual_clip": as_float(value)})


# -- rollout correction --------------------------------------------------------------------------------
RS_OPTIONS = {"token": ("token", False), "sequence": ("sequence", False), "geometric": ("geometric", False),
              "token_k1": ("token", True), "seq_sum_k1": ("sequence", True), "seq_mean_k1": ("geometric", True)}


def rollout_is(value: Any, ctx: Ctx) -> Out:
    if is_empty(value):
        return na("off")
    level = one_of(value, {"token": "token", "sequence": "sequence"}, "rollout_is")
    cap = as_float(ctx.get(f"{RC}.rollout_is_threshold", 2.0))
    return Out({"algo.correction.is_level": level, "algo.correction.is_cap": cap})


def with_rollout_is(value: Any, ctx: Ctx) -> Out:
    return na("rollout_is is off") if is_empty(ctx.get(f"{RC}.rollout_is")) else Out({}, "with rollout_is")


def _ratio(spec: Any) -> float:
    try:
        value = as_float(float(spec) if isinstance(spec, str) else spec)
    except ValueError:
        raise Refused(f"threshold {spec!r} is not a number") from None
    if value <= 0:
        raise Refused(f"thresholds must be > 0, got {spec!r}")
    return value


def _bounds(option: str, k1: bool, ctx: Ctx) -> tuple[float, float]:
    """(low, high) ratio bounds from verl's threshold keys."""
    spec = ctx.get(f"{RC}.rollout_rs_threshold")
    if not k1:
        high = _ratio(spec) if not is_empty(spec) else as_float(ctx.get(f"{RC}.rollout_is_threshold", 2.0))
        lower = ctx.get(f"{RC}.rollout_rs_threshold_lower")
        return (_ratio(lower) if not is_empty(lower) else 1.0 / high), high
    if is_empty(spec):
        raise Refused(f"rollout_rs={option} needs rollout_rs_threshold (a ratio, or 'lower_upper')")
    if isinstance(spec, str) and "_" in spec:
        lower_s, upper_s = spec.split("_", 1)
        lower, upper = _ratio(lower_s), _ratio(upper_s)
    else:
        upper = _ratio(spec)
        lower = 1.0 / upper
    return 1.0 / upper, 1.0 / lower   # -log r in [log lower, log upper]  <=>  r in [1 / upper, 1 / lower]


def rollout_rs(value: Any, ctx: Ctx) -> Out:
    if is_empty(value):
        return na("off")
    if isinstance(value, str) and "," in value:
        raise Refused("one rejection criterion at a time here (algo.correction.rs_level); drop the others")
    if value not in RS_OPTIONS:
        raise Refused(f"rollout_rs={value!r} is not available; supported: {', '.join(RS_OPTIONS)} (the k2/k3 "
                      "divergence bounds are not)")
    level, k1 = RS_OPTIONS[value]
    low, high = _bounds(value, k1, ctx)
    if low > high:
        raise Refused(f"the rejection bounds are empty: keep ratios in [{low:g}, {high:g}]")
    return Out({"algo.correction.rs_level": level, "algo.correction.rs_low": low, "algo.correction.rs_high": high},
               f"keeps pi_trainer / pi_engine in [{low:.4g}, {high:.4g}]")


def with_rollout_rs(value: Any, ctx: Ctx) -> Out:
    return na("rollout_rs is off") if is_empty(ctx.get(f"{RC}.rollout_rs")) else Out({}, "with rollout_rs")


def veto(value: Any, ctx: Ctx) -> Out:
    if is_empty(value):
        return na("off")
    return Out({"algo.correction.veto": as_float(value)})


def bypass_mode(value: Any, ctx: Ctx) -> Out:
    if not as_bool(value):
        return na("decoupled: pi_old is the trainer's (turnrl's only mode)")
    raise Refused("bypass mode (pi_old = the engine's logprobs) is not available: turnrl's pi_old is the trainer's "
                  "own, free in the update's forward with one optimizer step per batch; set bypass_mode=false")


def loss_type(value: Any, ctx: Ctx) -> Out:
    if ctx.get(f"{RC}.bypass_mode") is not True:
        return na("read only with bypass_mode=true")
    raise Refused("bypass mode is not available")


# -- DAPO ----------------------------------------------------------------------------------------------
FILTER_METRICS = {"acc": "accuracy", "score": "reward", "seq_reward": "reward", "seq_final_reward": "reward"}


def _filtering(ctx: Ctx) -> bool:
    return ctx.get(f"{FG}.enable") is True


def filter_enable(value: Any, ctx: Ctx) -> Out:
    if value is None or not as_bool(value):
        return na("off")
    if is_empty(ctx.get(f"{FG}.metric")):
        raise Refused("filter_groups.metric is required with filter_groups.enable (acc, score, seq_reward, ...)")
    return Out({"algo.filter_groups.enable": True})


def filter_metric(value: Any, ctx: Ctx) -> Out:
    if not _filtering(ctx) or is_empty(value):
        return na("filter_groups is off" if not _filtering(ctx) else "see filter_groups.enable")
    if value in FILTER_METRICS:
        return Out({"algo.filter_groups.metric": FILTER_METRICS[value]})
    return Out({"algo.filter_groups.metric": str(value)}, "the reward part of that name")


def filter_rounds(value: Any, ctx: Ctx) -> Out:
    if not _filtering(ctx):
        return na("filter_groups is off")
    return Out({"algo.filter_groups.max_rounds": max(as_int(value), 0)},
               "<= 0: no limit; at the limit turnrl tops the batch up with dropped groups (verl stops the run)")


def gen_batch_size(value: Any, ctx: Ctx) -> Out:
    if _filtering(ctx):
        return Out({"algo.filter_groups.prompts_per_round": as_int(value, "a positive integer")})
    if as_int(value) == as_int(ctx.get("data.train_batch_size")):
        return na("equals train_batch_size")
    raise Refused("data.gen_batch_size differs from train_batch_size: it is read with algorithm.filter_groups "
                  "(prompts per sampling round); without filtering make it equal or drop it")


def _dapo(ctx: Ctx) -> bool:
    return ctx.get("reward_model.reward_manager") == "dapo"


def overlong_enable(value: Any, ctx: Ctx) -> Out:
    if value is None or not as_bool(value):
        return na("off")
    if not _dapo(ctx):
        raise Refused("overlong_buffer_cfg is read by reward_model.reward_manager=dapo; set it")
    length = ctx.get(f"{OB}.len")
    if is_empty(length):
        raise Refused("overlong_buffer_cfg.len is required with overlong_buffer_cfg.enable")
    factor = ctx.get(f"{OB}.penalty_factor", 1.0)
    return Out({"reward.overlong.buffer": as_int(length, "a positive integer"), "reward.overlong.penalty":
                as_float(factor)}, "the penalty grows over the last `len` tokens before rollout.max_response_tokens")


def with_overlong(value: Any, ctx: Ctx) -> Out:
    if ctx.get(f"{OB}.enable") is not True:
        return na("overlong_buffer_cfg.enable is off")
    return Out({}, "with overlong_buffer_cfg.enable")


def max_resp_len(value: Any, ctx: Ctx) -> Out:
    if not _dapo(ctx):
        raise Refused("max_resp_len is read by reward_model.reward_manager=dapo")
    if as_int(value) != as_int(ctx.get("data.max_response_length")):
        raise Refused("turnrl measures the overlong buffer against the response limit (data.max_response_length); "
                      "set max_resp_len to the same value")
    return na("the response limit (data.max_response_length)")
