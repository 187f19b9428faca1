"""`turnrl verl`: each family of verl keys translated to turnrl's config (or refused with a reason), and the
prompt-length check that stands in for verl's filter_overlong_prompts / truncation=error."""

import asyncio
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from turnrl.compat.verl_cli import HONOURED, check_prompts, translate
from turnrl.data import DataError
from verl_data import TOOLS_YAML, verl_row

HERE = Path(__file__).parent


# -- key categories ------------------------------------------------------------------------------------
def test_algorithm_keys():
    def adv(*args):
        return translate(list(args), {}).assign.get("algo.advantage")
    assert adv("algorithm.adv_estimator=grpo") == "grpo"
    assert adv("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False") == "drgrpo"
    assert adv("algorithm.adv_estimator=rloo") == "rloo"
    assert adv("algorithm.adv_estimator=reinforce_plus_plus") == "reinforce_pp"
    assert adv("algorithm.adv_estimator=reinforce_plus_plus_baseline") == "reinforce_pp_baseline"
    assert adv("trainer.save_freq=1") == "gae"                   # verl's default estimator
    t = translate(["algorithm.adv_estimator=remax"], {})
    assert t.errors and "supported: grpo, rloo" in t.errors[0].note
    t = translate(["actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                   "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.ppo_epochs=2",
                   "actor_rollout_ref.actor.entropy_coeff=0.01", "algorithm.gamma=0.9"], {})
    a = t.assign
    assert (a["algo.clip_low"], a["algo.clip_high"], a["algo.loss_agg"]) == (0.2, 0.28, "seq-mean-token-mean")
    assert (a["trainer.epochs_per_step"], a["algo.entropy_coef"], a["algo.gamma"]) == (2, 0.01, 0.9)
    t = translate(["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"], {})
    assert t.errors and "token-mean" in t.errors[0].note


def test_mixed_precision_param_dtype_keys():
    key = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
    assert translate([f"{key}=bf16"], {}).assign["trainer.param_dtype"] == "auto"
    assert translate([f"{key}=fp32"], {}).assign["trainer.param_dtype"] == "float32"
    t = translate([f"{key}=fp16"], {})
    assert t.errors and "float16 weights" in t.errors[0].note


def test_kl_keys():
    a = translate(["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=kl"], {}).assign
    assert (a["algo.kl_coef"], a["algo.kl_type"]) == (0.001, "k1")      # verl's default coefficient
    a = translate(["actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.kl_loss_coef=0.5"], {}).assign
    assert a["algo.kl_coef"] == 0.0
    a = translate(["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.02",
                   "algorithm.kl_penalty=low_var_kl"], {}).assign
    assert (a["algo.kl_in_reward"], a["algo.kl_coef"], a["algo.kl_type"]) == (True, 0.02, "low_var_kl")
    t = translate(["algorithm.use_kl_in_reward=True", "actor_rollout_ref.actor.use_kl_loss=True"], {})
    assert t.errors and "not both" in t.errors[0].note
    t = translate(["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive"], {})
    assert t.errors and "adaptive" in t.errors[0].note


def test_rollout_and_multi_turn_keys():
    t = translate(["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.top_k=-1",
                   "actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
                   "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=100",
                   "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
                   "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=ignore_strippable",
                   "data.max_response_length=300"], {})
    a = t.assign
    assert (a["engine.kind"], a["rollout.sampling.top_k"], a["rollout.sampling.top_p"]) == ("hf", 0, 0.9)
    assert (a["engine.gpu_memory_utilization"], a["rollout.max_tool_response_tokens"]) == (0.8, 100)
    assert (a["rollout.truncate_side"], a["rollout.on_mismatch"]) == ("tail", "warn")
    # verl's unlimited turns (null) are bounded by the response budget; one tool call at a time by default
    assert a["rollout.max_assistant_turns"] == a["rollout.max_user_turns"] == 300
    assert a["rollout.max_parallel_calls"] == 1 and a["rollout.n"] == 1
    t = translate(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.top_p=0.9"], {})
    assert t.errors and "use rollout.name=hf" in t.errors[0].note
    t = translate(["actor_rollout_ref.rollout.do_sample=False", "actor_rollout_ref.rollout.temperature=0.7"], {})
    assert t.assign["rollout.sampling.temperature"] == 0.0
    t = translate(["actor_rollout_ref.rollout.multi_turn.format=gpt-oss"], {})
    assert t.errors and "hermes" in t.errors[0].note


def test_data_and_schedule_keys(tmp_path):
    rows = [verl_row(i, 3, "tool_agent") for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    base = [f"data.train_files={tmp_path / 'd.parquet'}", "data.train_batch_size=4"]
    assert translate([*base, "trainer.total_epochs=3"], {}).assign["trainer.steps"] == 3 * (10 // 4)
    assert translate([*base, "trainer.total_epochs=3", "data.train_max_samples=8"], {}).assign["trainer.steps"] == 6
    assert translate([*base, "trainer.total_training_steps=5"], {}).assign["trainer.steps"] == 5
    t = translate([*base, "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_epochs=2",
                   "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5", "trainer.total_training_steps=4",
                   "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "trainer.save_freq=-1",
                   f"data.val_files={tmp_path / 'd.parquet'}", "trainer.test_freq=5", "data.val_max_samples=3"], {})
    a = t.assign
    assert a["trainer.mini_batches"] == 2 and a["trainer.optim.warmup_steps"] == 2 * 2 * 2   # 2 steps x 2 x 2 updates
    assert (a["trainer.optim.schedule"], a["trainer.save_every"], a["trainer.eval_every"]) == ("cosine", 0, 5)
    assert (a["data.eval.path"], a["data.eval.max_rows"]) == (str(tmp_path / "d.parquet"), 3)
    t = translate([*base, "actor_rollout_ref.actor.ppo_mini_batch_size=3"], {})
    assert t.errors and "multiple of ppo_mini_batch_size" in t.errors[0].note
    t = translate([base[0], "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], {})
    assert t.errors and "must be in 1..data.train_batch_size=2" in t.errors[0].note
    t = translate([f"data.train_files={tmp_path / 'd.parquet'}", "data.train_batch_size=64",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=64"], {})
    assert t.errors and "fewer than data.train_batch_size=64" in t.errors[0].note
    t = translate([*base, "data.truncation=left"], {})
    assert t.errors and "never cuts a prompt" in t.errors[0].note
    t = translate([f"data.train_files=[{tmp_path / 'd.parquet'},{tmp_path / 'd.parquet'}]"], {})
    assert t.errors and "concatenate" in t.errors[0].note


def test_checkpoint_dirs_and_resume(tmp_path):
    a = translate(["trainer.project_name=p", "trainer.experiment_name=e"], {}).assign
    assert a["output_dir"] == "checkpoints/p/e"                  # verl's default_local_dir
    out = tmp_path / "run"
    t = translate([f"trainer.default_local_dir={out}"], {})
    assert "trainer.resume" not in t.assign                        # auto, nothing saved yet: a fresh start
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_3")
    assert translate([f"trainer.default_local_dir={out}"], {}).assign["trainer.resume"] == "latest"
    assert "trainer.resume" not in translate([f"trainer.default_local_dir={out}", "trainer.resume_mode=disable"],
                                             {}).assign
    t = translate(["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/verl/global_step_3"], {})
    assert t.errors and "not a turnrl checkpoint" in t.errors[0].note
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "trainer_state.json").write_text("{}")
    t = translate(["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'ck'}"], {})
    assert t.assign["trainer.resume"] == str(tmp_path / "ck")


def test_scale_out_and_logging_keys():
    a = translate(["trainer.nnodes=1", "trainer.n_gpus_per_node=1", "trainer.logger=[console,tensorboard]"], {}).assign
    assert "trainer.placement" not in a and a["logging.sinks"] == ["console", "tensorboard"]
    a = translate(["trainer.nnodes=1", "trainer.n_gpus_per_node=8"], {}).assign
    assert (a["trainer.placement"], a["trainer.gpus_per_node"]) == ("colocated", 8)
    t = translate(["trainer.logger=[console,swanlab]"], {})
    assert t.errors and "swanlab" in t.errors[0].note


def test_reward_function_with_reward_kwargs(tmp_path):
    fn = tmp_path / "score.py"
    fn.write_text("def score(data_source, solution_str, ground_truth, extra_info, scale=1.0):\n"
                  "    return scale * float(ground_truth in solution_str)\n")
    t = translate([f"custom_reward_function.path={fn}", "custom_reward_function.name=score",
                   "+custom_reward_function.reward_kwargs.scale=2.5", "data.max_response_length=64"], {})
    cfg = t.config(["data.train.task=calculator"])
    assert cfg.reward.functions == [f"{fn}:score"] and cfg.reward.function_kwargs == [{"scale": 2.5}]
    from turnrl.ledger import Trajectory
    from turnrl.rewards.build import reward_functions
    (rf,) = reward_functions(cfg)
    traj = Trajectory("g", 0, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "it is 7"}],
                      info={"ground_truth": "7", "data_source": "x"})
    assert asyncio.run(rf(traj)) == 2.5
    t = translate([f"custom_reward_function.path={tmp_path / 'missing.py'}"], {})
    assert t.errors and "does not exist" in t.errors[0].note


def test_collabllm_reward_keys():
    t = translate(["reward_model.reward_manager=collabllm", "+reward_model.reward_kwargs.metric_weights.bleu=0.5",
                   "+reward_model.reward_kwargs.llm_judge_kwargs.model=gpt-4.1-mini",
                   "+reward_model.reward_kwargs.llm_judge_kwargs.api_base=http://127.0.0.1:4000/v1",
                   "+reward_model.reward_kwargs.llm_judge_kwargs.api_key=env:JUDGE_KEY",
                   "+reward_model.reward_kwargs.llm_judge_kwargs.top_p=0.9"], {})
    judge = t.config(["data.train.task=calculator"]).reward.judge
    assert judge.metric_weights == {"bleu": 0.5}
    assert (judge.llm.model, judge.llm.base_url, judge.llm.api_key) == ("gpt-4.1-mini", "http://127.0.0.1:4000/v1",
                                                                        "env:JUDGE_KEY")
    assert judge.llm.extra_body == {"top_p": 0.9}
    t = translate(["reward_model.reward_manager=collabllm",
                   "+reward_model.reward_kwargs.llm_judge_kwargs.api_key=sk-secret-123"], {})
    assert t.errors and "env:NAME" in t.errors[0].note
    from turnrl.compat.verl_cli import format_table
    assert "sk-secret-123" not in format_table(t)
    t = translate(["reward_model.reward_manager=prime"], {})
    assert t.errors and "naive, collabllm, dapo" in t.errors[0].note
    t = translate(["+reward_model.reward_kwargs.metric_weights.accuracy=1"], {})
    assert t.errors and "collabllm" in t.errors[0].note


def test_agent_loop_registry_accepts_only_loops_turnrl_runs(tmp_path):
    registry = tmp_path / "loops.yaml"
    registry.write_text("- name: tool_agent\n  _target_: x.Y\n- name: my_react_agent\n  _target_: my.React\n")
    t = translate([f"actor_rollout_ref.rollout.agent.agent_loop_config_path={registry}"], {})
    assert t.errors and "['my_react_agent']" in t.errors[0].note


def test_chat_template_kwargs_the_template_reads_are_honoured(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% if enable_thinking %}<think>{% endif %}{{ messages }}"}))
    t = translate([f"actor_rollout_ref.model.path={model}", "+data.apply_chat_template_kwargs.enable_thinking=False"],
                  {})
    row = next(r for r in t.rows if r.key == "data.apply_chat_template_kwargs.enable_thinking")
    assert row.status == HONOURED and "model.chat_template_kwargs.enable_thinking" in row.turnrl
    assert t.assign["model.chat_template_kwargs.enable_thinking"] is False


# -- the prompt check (filter_overlong_prompts, truncation=error) --------------------------------------
def test_over_long_prompts_are_dropped_or_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    rows = [verl_row(0, 3, "tool_agent"), {**verl_row(1, 3, "single_turn_agent", tools=False, interaction=False),
                                           "prompt": [{"role": "user", "content": "Count to 3."}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "tools.yaml").write_text(TOOLS_YAML)
    args = [f"data.train_files={tmp_path / 'd.parquet'}", "data.train_batch_size=1", "data.max_prompt_length=100",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
            "trainer.total_epochs=2"]
    t = translate([*args, "data.filter_overlong_prompts=True"], {})
    assert t.prompt_check() == ("filter", 100)
    cfg = t.config()
    report, kept = check_prompts(cfg, 100, "filter", tmp_path / "out")
    assert kept == 1 and "1 of 2 rows over 100 tokens" in report[0]
    assert pq.read_table(cfg.data.train.path).column("agent_name").to_pylist() == ["single_turn_agent"]
    assert t.steps_for(kept) == 2 * 1
    t = translate(args, {})
    assert t.prompt_check() == ("error", 100)                   # verl's truncation default is error
    with pytest.raises(DataError, match="row 0"):
        check_prompts(t.config(), 100, "error", tmp_path / "out")
