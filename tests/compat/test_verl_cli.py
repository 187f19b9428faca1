"""`turnrl verl`: verl command lines translated key by key, and the issue's command line run end to end.

The end-to-end test builds what a verl user brings (a verl-format parquet with tools_kwargs and
interaction_kwargs rows, verl-format tool and interaction YAMLs whose classes follow verl's interfaces, see
verl_env.py) and runs the command line of the verl issue (`../shared/context/verl-issue.md`) through
`turnrl verl` on vLLM for two steps, with its $VARS set small, the embedded model and `rollout.name=vllm`.
"""

import importlib.util
import json
import os
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from turnrl.cli import main
from turnrl.compat.verl_cli import DEFAULT, ERROR, HONOURED, IGNORED, NA, key_table, lookup, translate
from turnrl.config import ConfigError
from verl_data import INTERACTION_YAML, TOOLS_YAML, verl_row

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
