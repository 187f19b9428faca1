"""`turnrl verl`: verl command lines translated key by key, and the issue's command line run end to end.

The end-to-end test builds what a verl user brings (a verl-format parquet with tools_kwargs and
interaction_kwargs rows, verl-format tool and interaction YAMLs whose classes follow verl's interfaces, see
verl_env.py) and runs the command line of the verl issue (`../shared/context/verl-issue.md`) through
`turnrl verl` on vLLM for two steps, with its $VARS set small, the embedded model and `rollout.name=vllm`.
"""

import asyncio
import importlib.util
import json
import os
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from turnrl.cli import main
from turnrl.compat.verl_cli import DEFAULT, ERROR, HONOURED, IGNORED, NA, check_prompts, key_table, lookup, translate
from turnrl.config import ConfigError
from turnrl.data import DataError

HERE = Path(__file__).parent

# The command line of the issue, as written (only `python3 -m verl.trainer.main_ppo` left out).
ISSUE = """
algorithm.adv_estimator=grpo
data.train_files=''
data.val_files=''
reward_model.reward_manager=collabllm
+reward_model.reward_kwargs.metric_weights.intention=1
+reward_model.reward_kwargs.metric_weights.token_amount=-0.0001
+reward_model.reward_kwargs.llm_judge_kwargs.model=azure/gpt-4.1
+reward_model.reward_kwargs.llm_judge_kwargs.max_tokens=2048
+reward_model.reward_kwargs.llm_judge_kwargs.temperature=0
data.train_batch_size=$TRAIN_BATCH_SIZE
data.val_batch_size=$MICRO_BATCH_SIZE
data.train_max_samples=32
data.val_max_samples=32
data.max_prompt_length=2048
data.max_response_length=2048
data.filter_overlong_prompts=True
data.truncation='error'
actor_rollout_ref.model.path=$DEBUG_MODEL
actor_rollout_ref.actor.strategy=fsdp2
actor_rollout_ref.rollout.dtype=bfloat16
actor_rollout_ref.actor.fsdp_config.model_dtype=bf16
actor_rollout_ref.ref.fsdp_config.model_dtype=bf16
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=$MICRO_BATCH_SIZE
actor_rollout_ref.rollout.tensor_model_parallel_size=$GPU_NUMS
actor_rollout_ref.actor.ulysses_sequence_parallel_size=2
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1
actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.lora_rank=64
actor_rollout_ref.model.lora_alpha=64
actor_rollout_ref.model.target_modules=all-linear
actor_rollout_ref.actor.fsdp_config.fsdp_size=-1
actor_rollout_ref.model.enable_gradient_checkpointing=False
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.ref.fsdp_config.param_offload=False
actor_rollout_ref.rollout.name=sglang
actor_rollout_ref.rollout.multi_turn=true
actor_rollout_ref.rollout.gpu_memory_utilization=0.65
actor_rollout_ref.rollout.n=$ROLL_NUM
actor_rollout_ref.rollout.load_format=safetensors
actor_rollout_ref.rollout.layered_summon=True
actor_rollout_ref.rollout.temperature=1.0
actor_rollout_ref.rollout.enable_chunked_prefill=False
+actor_rollout_ref.rollout.multi_turn.format=hermes
+actor_rollout_ref.rollout.multi_turn.max_user_turns=3
+actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4
+actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=1
+actor_rollout_ref.rollout.agent.agent_loop_config_path=$AGENTLOOP_CONFIG_PATH
algorithm.use_kl_in_reward=False
trainer.critic_warmup=0
trainer.logger='["wandb"]'
actor_rollout_ref.rollout.trace.backend=weave
actor_rollout_ref.rollout.trace.token2text=True
trainer.project_name=$PRJ_NAME
trainer.experiment_name=$EXP_NAME
trainer.nnodes=1
trainer.n_gpus_per_node=$GPU_NUMS
trainer.save_freq=30
trainer.test_freq=30
trainer.total_epochs=20
custom_reward_function.path=recipe/collabllm_jiuan/reward_function.py
custom_reward_function.name=conversation_level_reward_func
+actor_rollout_ref.rollout.multi_turn.interaction_config_path="$PROJECT_DIR/recipe/collabllm/config/collabllm_interaction_config.yaml"
trainer.log_val_generations=1023
trainer.val_before_train=False
trainer.default_local_dir=$SAVE_DIR
trainer.resume_from_path=$RESUME_PATH
+data.apply_chat_template_kwargs.enable_thinking=False
"""

CALL = '<tool_call>\n{"name": "counter", "arguments": {}}\n</tool_call>'
TOOLS_YAML = """tools:
  - class_name: verl_env.CounterTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: counter
        description: Add one (or `step`) to a running count and return the count.
        parameters:
          type: object
          properties:
            step: {type: integer, description: how much to add (default 1)}
          required: []
"""
INTERACTION_YAML = """interaction:
  - name: retry
    class_name: verl_env.RetryInteraction
    config:
      tries: 2
"""


def demo(k: int) -> list[dict]:
    """A worked example: k counter calls, then the count (small models call tools when shown how)."""
    msgs = [{"role": "user", "content": f"Call the counter tool {k} times, then tell me the count."}]
    for i in range(1, k + 1):
        msgs += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": f"count={i} (call {i})"}]
    return msgs + [{"role": "assistant", "content": f"The count is {k}."}]


def verl_row(i: int, n: int, agent: str, tools: bool = True, interaction: bool = True) -> dict:
    """A verl row; a row without tools (interaction) carries an empty `tools_kwargs` (`interaction_kwargs`), as
    verl's preprocessing scripts write them: in a parquet file whose rows mix modes, pyarrow reads these back
    null-filled (`{counter: None}`, `{name: None, ground_truth: None}`)."""
    extra = {"index": i, "split": "train",
             "tools_kwargs": {"counter": {"create_kwargs": {"start": 0}}} if tools else {},
             "interaction_kwargs": {"name": "retry", "ground_truth": str(n)} if interaction else {}}
    return {"data_source": "counter", "agent_name": agent, "ability": "tool",
            "prompt": [{"role": "system", "content": "You are a helpful assistant."}, *demo(4), *demo(5),
                       {"role": "user", "content": f"Call the counter tool {n} times, then tell me the count."}],
            "reward_model": {"style": "rule", "ground_truth": str(n)}, "extra_info": extra}


@pytest.fixture
def verl_project(tmp_path, monkeypatch):
    """What a verl user brings: data, tool and interaction configs, an agent-loop registry, and their $VARS."""
    monkeypatch.syspath_prepend(str(HERE))          # the YAMLs name `verl_env.CounterTool`, as verl configs do
    rows = [verl_row(0, 3, "tool_agent", interaction=False), verl_row(1, 4, "tool_agent"),   # modes mixed
            verl_row(2, 3, "single_turn_agent"), verl_row(3, 4, "collabllm_agent", tools=False)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "tools.yaml").write_text(TOOLS_YAML)
    config_dir = tmp_path / "recipe/collabllm/config"
    config_dir.mkdir(parents=True)
    (config_dir / "collabllm_interaction_config.yaml").write_text(INTERACTION_YAML)
    (tmp_path / "agent_loops.yaml").write_text(
        "- name: collabllm_agent\n  _target_: recipe.collabllm.collabllm_agent_loop.CollabLLMAgentLoop\n")
    env = {"TRAIN_BATCH_SIZE": "2", "MICRO_BATCH_SIZE": "2", "ROLL_NUM": "2", "GPU_NUMS": "1",
           "DEBUG_MODEL": "smollm2-135m-instruct", "AGENTLOOP_CONFIG_PATH": str(tmp_path / "agent_loops.yaml"),
           "PRJ_NAME": "verl-compat", "EXP_NAME": "e2e", "PROJECT_DIR": str(tmp_path),
           "SAVE_DIR": str(tmp_path / "save"), "RESUME_PATH": str(tmp_path / "no-checkpoint")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return tmp_path, env


def issue_args(values: dict[str, str]) -> list[str]:
    """The issue's tokens (shell-split: quotes go as in a shell), with values replaced (or keys added)."""
    args = shlex.split(ISSUE)
    for key, value in values.items():
        at = [i for i, a in enumerate(args) if a.partition("=")[0].lstrip("+") == key.lstrip("+")]
        if at:
            args[at[0]] = f"{args[at[0]].partition('=')[0]}={value}"
        else:
            args.append(f"{key}={value}")
    return args


def runnable(root: Path) -> list[str]:
    """The issue's line with the data file it left empty, vLLM, a valid CollabLLM metric, and our tools."""
    args = issue_args({"data.train_files": str(root / "train.parquet"), "actor_rollout_ref.rollout.name": "vllm",
                       "+actor_rollout_ref.rollout.multi_turn.tool_config_path": str(root / "tools.yaml")})
    return [a.replace("metric_weights.intention=", "metric_weights.accuracy=") for a in args]


def rows_by_key(t) -> dict:
    return {r.key: r for r in t.rows}


# -- the issue's keys ----------------------------------------------------------------------------------
def test_every_key_of_the_issue_has_a_rule():
    keys = [a.partition("=")[0].lstrip("+") for a in shlex.split(ISSUE)]
    assert [k for k in keys if lookup(k) is None] == []


def test_the_issue_line_translates_key_by_key(verl_project):
    root, env = verl_project
    t = translate(runnable(root), env)
    assert t.errors == []
    rows = rows_by_key(t)
    cfg = t.config()
    # honoured, with unit conversions
    assert rows["algorithm.adv_estimator"].status == HONOURED and cfg.algo.advantage == "grpo"
    assert cfg.data.prompts_per_step == 2 and cfg.rollout.n == 2 and cfg.trainer.mini_batches == 1
    assert cfg.rollout.max_response_tokens == 2048 and cfg.rollout.max_context_tokens == 4096
    assert cfg.engine.max_model_len == 4096 and cfg.engine.kind == "vllm" and cfg.engine.dtype == "bfloat16"
    assert (cfg.algo.kl_coef, cfg.algo.kl_type, cfg.algo.kl_in_reward) == (0.001, "low_var_kl", False)
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (64, 64.0, "all-linear")
    assert (cfg.rollout.max_user_turns, cfg.rollout.max_assistant_turns, cfg.rollout.tool_parser) == (3, 4, "hermes")
    assert cfg.trainer.optim.lr == 1e-6 and cfg.trainer.dtype == "auto"
    assert cfg.logging.sinks == ["wandb"] and (cfg.logging.project, cfg.logging.run_name) == ("verl-compat", "e2e")
    assert cfg.output_dir == env["SAVE_DIR"] and cfg.trainer.save_every == 30 and cfg.trainer.eval_every == 0
    assert cfg.trainer.steps == 20 * (4 // 2)                     # total_epochs x (rows // train_batch_size)
    assert cfg.data.eval is None and cfg.data.train.max_rows == 32
    j = cfg.reward.judge
    assert j.metric_weights == {"accuracy": 1.0, "token_amount": -0.0001} and j.num_repeat_rollouts == 1
    assert (j.llm.backend, j.llm.model, j.llm.max_tokens, j.llm.temperature) == ("openai", "azure/gpt-4.1", 2048, 0.0)
    assert cfg.reward.functions == []                             # CollabLLM's function is replaced by reward.judge
    # verl's own defaults, where they differ from turnrl's
    assert rows["actor_rollout_ref.actor.clip_ratio"].status == DEFAULT and cfg.algo.clip_high == 0.2
    assert cfg.algo.dual_clip == 3.0 and cfg.trainer.optim.weight_decay == 0.01
    # not applicable, each with its reason
    for key in ("actor_rollout_ref.actor.fsdp_config.fsdp_size", "actor_rollout_ref.rollout.layered_summon",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.trace.backend",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "data.val_batch_size",
                "data.apply_chat_template_kwargs.enable_thinking", "trainer.resume_from_path",
                "custom_reward_function.path", "actor_rollout_ref.rollout.multi_turn"):
        assert rows[key].status == NA and rows[key].note, key
    assert "micro-batches by tokens" in rows["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"].note


def test_sglang_and_the_unknown_intention_metric_are_errors(verl_project):
    root, env = verl_project
    t = translate(issue_args({"data.train_files": str(root / "train.parquet")}), env)
    errors = {r.key: r.note for r in t.errors}
    assert set(errors) == {"actor_rollout_ref.rollout.name", "reward_model.reward_kwargs.metric_weights.intention"}
    assert "rollout.name=vllm" in errors["actor_rollout_ref.rollout.name"]
    assert "unknown CollabLLM metric 'intention'" in errors["reward_model.reward_kwargs.metric_weights.intention"]
    assert "accuracy, interactivity, token_amount, bleu, pass_rate" in errors[
        "reward_model.reward_kwargs.metric_weights.intention"]


def test_the_original_issue_line_stops_with_the_table_and_the_errors(verl_project, capsys):
    root, _ = verl_project
    assert main(["verl", *issue_args({"data.train_files": str(root / "train.parquet")}), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "verl key" in out and "metric_weights.intention" in out and "error: unknown CollabLLM metric" in out
    assert "2 verl key(s) cannot be honoured" in err and "'intention'" in err and "SGLang" in err


def test_empty_train_files_is_an_error(verl_project):
    root, env = verl_project
    row = rows_by_key(translate(issue_args({}), env))["data.train_files"]
    assert row.status == ERROR and "give the training parquet file" in row.note


# -- the command line: $VARS, +, unknown keys, --set, --dry-run ----------------------------------------
def test_unset_variables_are_errors_naming_each_one():
    with pytest.raises(ConfigError) as exc:
        translate(["data.train_batch_size=$NOPE_A", "actor_rollout_ref.rollout.n=${NOPE_B}", "trainer.nnodes=1"], {})
    assert "$NOPE_A (in data.train_batch_size)" in str(exc.value)
    assert "$NOPE_B (in actor_rollout_ref.rollout.n)" in str(exc.value)


def test_variables_expand_in_every_form():
    t = translate(["actor_rollout_ref.rollout.n=$N", "data.max_response_length=${LEN}",
                   "actor_rollout_ref.model.path=${oc.env:MODEL,smollm2-135m-instruct}",
                   "trainer.default_local_dir=$ROOT/save"], {"N": "8", "LEN": "64", "ROOT": "/tmp/x"})
    assert t.assign["rollout.n"] == 8 and t.assign["rollout.max_response_tokens"] == 64
    assert t.assign["model.name"] == "smollm2-135m-instruct" and t.assign["output_dir"] == "/tmp/x/save"
    with pytest.raises(ConfigError, match="interpolations"):
        translate(["actor_rollout_ref.rollout.response_length=${data.max_response_length}"], {})


def test_plus_prefixes_name_the_same_key():
    plain = translate(["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"], {})
    for prefix in ("+", "++"):
        t = translate([prefix + "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"], {})
        assert t.assign["rollout.max_assistant_turns"] == plain.assign["rollout.max_assistant_turns"] == 3
    with pytest.raises(ConfigError, match="given twice"):
        translate(["trainer.save_freq=1", "+trainer.save_freq=2"], {})


def test_unknown_keys_are_errors_unless_allowed_and_always_listed(verl_project, capsys):
    root, _ = verl_project
    args = [*runnable(root), "actor_rollout_ref.actor.optim.lrr=1e-5", "trainer.my_own_flag=1"]
    t = translate(args, dict(os.environ))
    errors = {r.key: r.note for r in t.errors}
    assert set(errors) == {"actor_rollout_ref.actor.optim.lrr", "trainer.my_own_flag"}
    assert "Did you mean 'actor_rollout_ref.actor.optim.lr'?" in errors["actor_rollout_ref.actor.optim.lrr"]
    assert main(["verl", *args, "--dry-run"]) == 2
    assert "--allow-unknown" in capsys.readouterr().out
    assert main(["verl", *args, "--allow-unknown", "--dry-run", "--set", "logging.sinks=[console]"]) == 0
    out = capsys.readouterr().out
    assert out.count(IGNORED) >= 2 and "trainer.my_own_flag" in out
    assert "2 ignored (unknown)" in out and "logging.sinks=[console]" in out and "\nmodel:\n" in out


def test_turnrl_overrides_apply_after_the_translation(verl_project):
    root, env = verl_project
    t = translate(runnable(root), env)
    cfg = t.config(["reward.judge.llm.backend=local", "reward.judge.llm.model=smollm2-135m-instruct",
                    "rollout.n=3"])
    assert (cfg.reward.judge.llm.backend, cfg.reward.judge.llm.model, cfg.rollout.n) == (
        "local", "smollm2-135m-instruct", 3)
    with pytest.raises(ConfigError, match="Did you mean"):
        t.config(["rollout.nn=3"])


def test_a_missing_logger_package_fails_before_the_model_loads(verl_project, capsys):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    root, _ = verl_project
    assert main(["verl", *runnable(root), "--dry-run"]) == 2
    assert "pip install wandb" in capsys.readouterr().err


def test_list_keys_prints_the_migration_table(capsys):
    assert main(["verl", "--list-keys"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| verl key | turnrl | notes |")
    assert "| `data.train_batch_size` | `data.prompts_per_step` |" in out
    assert "`actor_rollout_ref.actor.fsdp_config.**` | not applicable |" in out
    assert key_table() == out.strip()
    readme = (HERE.parents[1] / "README.md").read_text()
    start, end = readme.index("<!-- verl-keys:start -->\n"), readme.index("\n<!-- verl-keys:end -->")
    assert readme[start + len("<!-- verl-keys:start -->\n"):end] == key_table(), \
        "README's verl key table is stale: paste `turnrl verl --list-keys` between its markers"


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


# -- the issue's command line, run: multi-turn on vLLM, tool state across calls, the table printed --------
@pytest.mark.vllm
@pytest.mark.slow
def test_the_issue_command_line_runs_multi_turn_on_vllm(verl_project, capsys):
    pytest.importorskip("vllm")
    import verl_env
    verl_env.EVENTS.clear()
    root, env = verl_project
    local_judge = ["--set", "reward.judge.llm.backend=local", "--set", "reward.judge.llm.model=smollm2-135m-instruct",
                   "--set", "reward.judge.llm.max_tokens=8", "--set", "reward.judge.json_prefill=true"]
    small = ["--set", "logging.sinks=[console]",             # the issue logs to wandb, not installed here
             "--set", "rollout.sampling.max_tokens_per_turn=48"]
    assert main(["verl", *runnable(root), "trainer.total_training_steps=2", *local_judge, *small]) == 0
    out = capsys.readouterr().out
    # the translation table was printed, every key of the issue in it
    assert out.startswith("verl key") and "engine.kind=vllm" in out and "honoured" in out
    for key in [a.partition("=")[0].lstrip("+") for a in runnable(root)]:
        assert f"\n{key} " in out, key
    save = Path(env["SAVE_DIR"])
    steps = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    trajs = [json.loads(line) for line in (save / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 * 2 * 2                                   # steps x prompts x rollout.n
    assert sum(len(t["turns"]) for t in trajs) / len(trajs) > 1    # multi-turn: more than one assistant turn
    # every trajectory got its own counter (single_turn_agent rows too: they ask for tools)
    created = [e[1] for e in verl_env.EVENTS if e[0] == "create"]
    assert len(created) == len(trajs) == len(set(created))
    for instance in created:                                         # calc_reward and release, once each
        assert ("calc_reward", instance) in verl_env.EVENTS and ("release", instance) in verl_env.EVENTS
    started = [e[1] for e in verl_env.EVENTS if e[0] == "start_interaction"]
    assert started and all(("finalize_interaction", i) in verl_env.EVENTS and ("calculate_score", i) in verl_env.EVENTS
                           for i in started)
    # tool state persists across calls: the second successful call sees the first call's count
    counts = [[r["text"] for turn in t["turns"] for r in turn["tool_results"] if not r["error"]] for t in trajs]
    assert any(c[:2] == ["count=1 (call 1)", "count=2 (call 2)"] for c in counts), counts
    executed = {}
    for e in verl_env.EVENTS:
        if e[0] == "execute":
            executed.setdefault(e[1], []).append(e[3])
    assert any(len(v) >= 2 for v in executed.values())
    assert all(v == list(range(1, len(v) + 1)) for v in executed.values())
