"""verl's loss modes, rollout correction and DAPO keys through `turnrl verl`'s translation, down to a Config."""

import pytest

from turnrl.compat.verl_cli import translate

AR = "actor_rollout_ref.actor"
RC = "algorithm.rollout_correction"
OB = "reward_model.reward_kwargs.overlong_buffer_cfg"
BASE = ["trainer.total_training_steps=2"]   # steps without a data file


def assign(*args):
    t = translate([*BASE, *args], {})
    assert not t.errors, [(r.key, r.note) for r in t.errors]
    return t


def error(*args) -> str:
    t = translate([*BASE, *args], {})
    assert t.errors, "expected an error"
    return " ".join(r.note for r in t.errors)


def test_loss_modes():
    t = assign(f"{AR}.policy_loss.loss_mode=gspo", f"{AR}.clip_ratio_low=3e-4", f"{AR}.clip_ratio_high=4e-4")
    a = t.assign
    assert (a["algo.loss_mode"], a["algo.loss_agg"], a["algo.clip_low"]) == ("gspo", "seq-mean-token-mean", 3e-4)
    assert "algo.dual_clip" not in a          # verl's default clip_ratio_c=3.0 is vanilla's only
    cfg = t.config()
    assert (cfg.algo.loss_mode, cfg.algo.dual_clip, cfg.algo.loss_agg) == ("gspo", None, "seq-mean-token-mean")
    # verl ignores loss_agg_mode for gspo / geo_mean: not applicable, not a conflict
    t = assign(f"{AR}.policy_loss.loss_mode=geo_mean", f"{AR}.loss_agg_mode=token-mean")
    assert t.assign["algo.loss_mode"] == "gmpo" and t.config().algo.loss_agg == "seq-mean-token-mean"
    t = assign(f"{AR}.policy_loss.loss_mode=cispo", f"{AR}.loss_agg_mode=token-mean")
    assert (t.config().algo.loss_mode, t.config().algo.loss_agg) == ("cispo", "token-mean")
    assert assign(f"{AR}.policy_loss.loss_mode=vanilla").config().algo.dual_clip == 3.0
    assert "supported: vanilla, gspo, cispo, geo_mean" in error(f"{AR}.policy_loss.loss_mode=clip_cov")


def test_rollout_correction_first_generation_keys():
    cfg = assign(f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=3.0", f"{RC}.rollout_rs=geometric",
                 f"{RC}.rollout_rs_threshold=1.002", f"{RC}.rollout_rs_threshold_lower=0.998",
                 f"{RC}.rollout_token_veto_threshold=1e-4").config().algo.correction
    assert (cfg.is_level, cfg.is_cap, cfg.rs_level, cfg.rs_low, cfg.rs_high, cfg.veto) == (
        "sequence", 3.0, "geometric", 0.998, 1.002, 1e-4)
    # no upper bound: rollout_is_threshold's; no lower bound: its reciprocal
    cfg = assign(f"{RC}.rollout_is=token", f"{RC}.rollout_rs=token").config().algo.correction
    assert (cfg.rs_low, cfg.rs_high) == (0.5, 2.0)


def test_rollout_correction_k1_options_bound_minus_log_ratio():
    # verl keeps -log r in [log 0.5, log 4]: ratios in [1/4, 2]
    cfg = assign(f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=0.5_4.0").config().algo.correction
    assert (cfg.rs_level, cfg.rs_low, cfg.rs_high) == ("geometric", 0.25, 2.0)
    cfg = assign(f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=2.0").config().algo.correction
    assert (cfg.rs_level, cfg.rs_low, cfg.rs_high) == ("token", 0.5, 2.0)
    assert "k2/k3" in error(f"{RC}.rollout_rs=seq_max_k2", f"{RC}.rollout_rs_threshold=2.0")
    assert "one rejection criterion" in error(f"{RC}.rollout_rs=token_k1,seq_sum_k1", f"{RC}.rollout_rs_threshold=2")
    assert "needs rollout_rs_threshold" in error(f"{RC}.rollout_rs=token_k1")
    assert "bypass_mode=false" in error(f"{RC}.bypass_mode=true")
    assert "batch-normalised" in error(f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true")


def test_rollout_is_and_the_actor_cap_together_are_a_clear_error():
    t = translate([*BASE, f"{RC}.rollout_is=token", f"{AR}.tis_imp_ratio_cap=2.0"], {})
    with pytest.raises(Exception, match="tis_cap"):
        t.config()


def test_dapo_recipe_keys():
    t = assign("algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
               "algorithm.filter_groups.max_num_gen_batches=10", "data.train_batch_size=8", "data.gen_batch_size=24",
               f"{AR}.ppo_mini_batch_size=8",
               "reward_model.reward_manager=dapo", f"+{OB}.enable=True", f"+{OB}.len=64",
               f"+{OB}.penalty_factor=0.5", f"+{OB}.log=False", "+reward_model.reward_kwargs.max_resp_len=512",
               "data.max_response_length=512", f"{AR}.clip_ratio_high=0.28")
    cfg = t.config()
    fg = cfg.algo.filter_groups
    assert (fg.enable, fg.metric, fg.max_rounds, fg.prompts_per_round) == (True, "accuracy", 10, 24)
    assert (cfg.reward.overlong.buffer, cfg.reward.overlong.penalty) == (64, 0.5)
    assert cfg.data.prompts_per_step == 8
    # the recipe's older key names
    cfg = assign("reward_model.reward_manager=dapo", "+reward_model.overlong_buffer.enable=True",
                 "+reward_model.overlong_buffer.len=32").config()
    assert (cfg.reward.overlong.buffer, cfg.reward.overlong.penalty) == (32, 1.0)
    assert assign("algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=score",
                  "algorithm.filter_groups.max_num_gen_batches=0").config().algo.filter_groups.max_rounds == 0
    assert "reward_manager=dapo" in error(f"+{OB}.enable=True", f"+{OB}.len=64")
    assert "max_response_length" in error("reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.max_resp_len=9")
    assert "gen_batch_size" in error("data.train_batch_size=8", "data.gen_batch_size=24")
    assert "metric is required" in error("algorithm.filter_groups.enable=True")


def test_a_dapo_gspo_recipe_line_trains_through_turnrl_verl(tmp_path, torch_threads, capsys):
    """A verl DAPO-style line (GSPO loss, dynamic sampling on accuracy, overlong buffer, token-level IS with
    a rejection band) run end to end by `turnrl verl` on tiny-random: every mode's metrics are logged."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from turnrl.cli import main
    rows = [{"data_source": "sums", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
            for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    score = tmp_path / "score.py"   # partial credit, so that some groups differ and some do not
    score.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                     "    return float(len(solution_str) % 3 == 0)\n")
    line = ["algorithm.adv_estimator=grpo", f"data.train_files={tmp_path / 'train.parquet'}",
            "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=24",
            "actor_rollout_ref.model.path=tiny-random", "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"{AR}.policy_loss.loss_mode=gspo", f"{AR}.clip_ratio_low=3e-4", f"{AR}.clip_ratio_high=4e-4",
            "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
            "algorithm.filter_groups.max_num_gen_batches=3",
            "reward_model.reward_manager=dapo", f"{OB}.enable=True", f"{OB}.len=8", f"{OB}.penalty_factor=1.0",
            f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0", f"{RC}.rollout_rs=token",
            f"{RC}.rollout_rs_threshold=1.5", f"custom_reward_function.path={score}",
            "custom_reward_function.name=score", "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path / 'save'}", "trainer.logger=['console']"]
    with torch_threads(1):
        assert main(["verl", *line, "--set", "engine.dtype=float32", "--set", "trainer.dtype=float32",
                     "--set", "logging.progress=off"]) == 0
    capsys.readouterr()
    steps = [json.loads(x) for x in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert 1 <= m["filter_groups/rounds"] <= 3 and m["filter_groups/kept"] + m["filter_groups/filled"] >= 2
        assert "correction/weight_mean" in m and "correction/rejected_token_fraction" in m
        assert "reward/overlong" in m and m["grad_norm"] >= 0
