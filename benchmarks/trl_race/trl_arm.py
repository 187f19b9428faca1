"""TRL's side of the race: `GRPOTrainer` with tools on turnrl's calculator task, measured from inside.

Same work as `turnrl train examples/calculator/train.yaml`: the same tasks in the same order (turnrl's
`DataOrder`), the same prompt tokens (a chat template for SmolLM2 that renders the tool list exactly as
turnrl injects it; checked token for token against turnrl's rendering before training), the same
calculator (turnrl's), the same reward (turnrl's `exact_answer` 0.8 + `tool_success` 0.2 on TRL's
completions), LoRA, optimizer, clipping, batch and token limits. What TRL is given is listed in the report
(`trl_config`); what could not be made equal is listed in `differences`.

Measured by wrapping TRL's own methods (nothing of TRL's is changed): the step time (between optimizer
steps), every generate call (rows, prompt and generated tokens, the padded slots of a plain `generate`),
the tool calls, the reward computation, the weight sync to vLLM, and every forward pass of training (its
padded and real tokens).

Run by race.py in the race's own venv: python trl_arm.py --engine hf|vllm --steps 3 --json FILE
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # turnrl itself (also installed editable in the race venv)


def load_race_config(overrides: list[str]) -> Any:
    from turnrl.config import load_config
    return load_config(ROOT / "examples/calculator/train.yaml", overrides)


def ordered_tasks(cfg: Any, steps: int) -> list[Any]:
    """The tasks turnrl's trainer takes in its first `steps` steps, in its order."""
    from turnrl.data import load_dataset
    from turnrl.train.setup import DataOrder
    d = cfg.data.train
    order = DataOrder(load_dataset(d.path, d.task, d.size, d.seed, d.options, d.max_rows), cfg.seed, cfg.data.shuffle)
    return order.take(steps * cfg.data.prompts_per_step)


def tool_chat_template() -> str:
    """SmolLM2's ChatML template, plus what TRL needs for tools: the tool list rendered into the system
    message exactly as turnrl injects it (SmolLM2's own template ignores `tools=`), and assistant
    `tool_calls` rendered as hermes `<tool_call>` blocks."""
    from turnrl.chat.templates import TOOL_PROMPT
    head, tail = TOOL_PROMPT.split("{tools}")
    tail = tail.replace("{{", "{").replace("}}", "}")
    tools = ("{{ tool_head }}{% for t in tools %}{{ t | tojson }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
             "{% endfor %}{{ tool_tail }}")
    return (
        "{%- set tool_head = " + json.dumps(head) + " -%}{%- set tool_tail = " + json.dumps(tail) + " -%}"
        "{%- for message in messages -%}"
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{%- if tools -%}{{ '<|im_start|>system\\n' }}" + tools + "{{ '<|im_end|>\\n' }}"
        "{%- else -%}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\\n' }}{%- endif -%}{%- endif -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}{%- endif -%}"
        "{%- if loop.first and message['role'] == 'system' and tools -%}{{ '\\n\\n' }}" + tools + "{%- endif -%}"
        "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
        "{%- for call in message['tool_calls'] -%}"
        "{%- set f = call['function'] if call['function'] is defined else call -%}"
        "{%- if not loop.first or (message['content'] is string and message['content']) -%}{{ '\\n' }}{%- endif -%}"
        "{{ '<tool_call>\\n' }}{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}{{ '\\n</tool_call>' }}"
        "{%- endfor -%}{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


class Meter:
    """Per-step accumulators for everything the wrappers see."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.current = self._fresh()
        self.last_end = None
        self.last_host: dict[str, float] = {}

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"generate_s": 0.0, "generate_calls": [], "tools_s": 0.0, "tool_calls": 0, "reward_s": 0.0,
                "rollout_s": 0.0, "sync_s": 0.0, "forward_passes": [], "uids": []}


def instrument(trainer: Any, meter: Meter, pad_id: int, use_vllm: bool) -> None:
    import torch

    def timed(name: str, key: str, record: Any = None) -> None:
        original = getattr(trainer, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(*args, **kwargs)
            seconds = time.perf_counter() - start
            meter.current[key] += seconds
            if record is not None:
                record(seconds, args, kwargs, out)
            return out
        setattr(trainer, name, wrapper)

    def on_generate(seconds: float, args: Any, kwargs: Any, out: Any) -> None:
        prompt_ids = args[0]
        completion_ids = out[0]
        prompts = [len(p) for p in prompt_ids]
        generated = [len(c) for c in completion_ids]
        call = {"rows": len(prompts), "seconds": seconds, "prompt_tokens": sum(prompts),
                "generated_tokens": sum(generated), "max_generated": max(generated, default=0)}
        if not use_vllm:   # plain generate: one left-padded batch, decoded until its longest row ends
            slots = len(prompts) * (max(prompts) + max(generated, default=0))
            call["padded_slots"] = slots
            call["padding_fraction"] = 1 - (sum(prompts) + sum(generated)) / slots if slots else 0.0
        meter.current["generate_calls"].append(call)

    def on_rollout(seconds: float, args: Any, kwargs: Any, out: Any) -> None:
        meter.current["uids"] += [x["uid"] for x in args[0]]

    original_logps = trainer._get_per_token_logps_and_entropies

    @functools.wraps(original_logps)
    def logps(model: Any, input_ids: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original_logps(model, input_ids, attention_mask, *args, **kwargs)
        meter.current["forward_passes"].append({
            "grad": torch.is_grad_enabled(), "rows": int(input_ids.shape[0]), "width": int(input_ids.shape[1]),
            "tokens": int(attention_mask.sum()), "seconds": time.perf_counter() - start})
        return out
    trainer._get_per_token_logps_and_entropies = logps

    timed("_generate_single_turn", "generate_s", on_generate)
    timed("_calculate_rewards", "reward_s")
    timed("_generate_and_score_completions", "rollout_s", on_rollout)
    if use_vllm:
        vg = trainer.vllm_generation
        original_sync = vg.sync_weights

        def sync() -> None:
            start = time.perf_counter()
            original_sync()
            meter.current["sync_s"] += time.perf_counter() - start
        vg.sync_weights = sync


def make_tool(meter: Meter) -> Any:
    """turnrl's calculator as the plain function TRL calls, its schema turnrl's own."""
    from turnrl.env.builtin.calculator import Calculator

    spec = Calculator.schema["function"]
    arg = spec["parameters"]["properties"]["expression"]["description"]

    def calculator(expression: str):  # noqa: ANN202 - no return annotation: the schema would grow a "return" key
        start = time.perf_counter()
        try:
            return Calculator().execute({"expression": expression}).text
        finally:
            meter.current["tools_s"] += time.perf_counter() - start
            meter.current["tool_calls"] += 1
    calculator.__doc__ = f"{spec['description']}\n\nArgs:\n    expression: {arg}\n"
    calculator.__qualname__ = "calculator"   # TRL shows the model a bad call's TypeError, which names the function
    return calculator


def last_assistant(completion: list[dict[str, Any]]) -> str:
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


def exact_answer(completions: list[Any], ground_truth: list[str], **kwargs: Any) -> list[float]:
    """turnrl's exact_answer: the last assistant message's `#### N` equals the ground truth."""
    from turnrl.rewards.answers import extract_answer, same_number
    return [1.0 if same_number(extract_answer(last_assistant(c), strict=True), g) else 0.0
            for c, g in zip(completions, ground_truth)]


SAMPLES: list[dict[str, Any]] = []   # what the policy wrote, for the report: tool results and final answers


def tool_success(completions: list[Any], **kwargs: Any) -> list[float]:
    """turnrl's tool_success: at least one tool call ran without error (TRL writes a failed call's result
    as "{'error': ...}")."""
    for c in completions:
        SAMPLES.append({"tool_results": [str(m.get("content"))[:160] for m in c if m.get("role") == "tool"],
                        "tool_calls": [json.dumps(call, default=str)[:160]
                                       for m in c for call in m.get("tool_calls") or []],
                        "final": last_assistant(c)[-160:]})
    return [1.0 if any(m.get("role") == "tool" and not str(m.get("content")).startswith("{'error'") for m in c)
            else 0.0 for c in completions]


def check_prompts(tokenizer: Any, template: str, tool: Any, tasks: list[Any], model_dir: str) -> dict[str, Any]:
    """TRL's prompt ids (its own apply_chat_template call) against turnrl's for the same tasks."""
    from turnrl.chat.session import ChatSession
    from turnrl.chat.templates import ChatTemplate
    from turnrl.env.builtin.calculator import Calculator
    from turnrl.ledger import Trajectory
    from transformers import AutoTokenizer

    ours = ChatTemplate(AutoTokenizer.from_pretrained(model_dir))
    same = 0
    for task in tasks:
        trl_ids = tokenizer.apply_chat_template(task.messages, tools=[tool], chat_template=template,
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
        traj = Trajectory(group_id=task.uid, sample_index=0, messages=[], info={})
        session = ChatSession(ours, task.messages, [Calculator.schema], traj, "error")
        same += list(trl_ids) == list(session.context_ids)
    return {"checked": len(tasks), "identical": same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["hf", "vllm"], required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", required=True)
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="turnrl config overrides applied to both sides, e.g. data.prompts_per_step=2")
    p.add_argument("--continuous-batching", action="store_true",
                   help="hf: TRL's use_transformers_continuous_batching instead of plain generate")
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from turnrl.bench.common import delta, host_counters, machine_info, spread
    from turnrl.models import resolve

    cfg = load_race_config([f"engine.kind={a.engine}", *a.overrides])
    model_dir = str(resolve(cfg.model.name))
    tasks = ordered_tasks(cfg, a.steps)
    meter = Meter()
    tool = make_tool(meter)
    template = tool_chat_template()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.chat_template = template
    # SmolLM2 writes hermes tool calls inside ChatML: the same format TRL's Qwen3 response template parses
    tokenizer.response_template = qwen3_template
    prompt_check = check_prompts(tokenizer, template, tool, tasks, model_dir)

    dataset = Dataset.from_list([{"prompt": t.messages, "ground_truth": t.ground_truth, "uid": t.uid} for t in tasks])
    r, s, o, lora = cfg.rollout, cfg.rollout.sampling, cfg.trainer.optim, cfg.model.lora
    group, prompts = r.n, cfg.data.prompts_per_step
    micro = min(8, group * prompts)   # rows per forward/backward: about turnrl's 4096-token budget here
    limit = "max_tokens" if a.engine == "vllm" else "max_new_tokens"   # vLLM's SamplingParams / GenerationConfig
    per_turn = {limit: s.max_tokens_per_turn}
    # race.py --fp32 sets both of turnrl's dtypes; TRL then trains float32 weights without bf16 autocast
    fp32 = cfg.engine.dtype == "float32" and cfg.trainer.dtype == "float32"
    trl_args = dict(
        output_dir=str(Path(a.json).with_suffix("")) + "-out", max_steps=a.steps, seed=cfg.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=group * prompts // micro,
        num_generations=group, shuffle_dataset=False, remove_unused_columns=False,
        max_completion_length=r.max_response_tokens, max_tool_calling_iterations=r.max_assistant_turns - 1,
        generation_kwargs=per_turn, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=o.weight_decay,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], max_grad_norm=o.grad_clip,
        beta=cfg.algo.kl_coef, epsilon=cfg.algo.clip_low, epsilon_high=cfg.algo.clip_high, loss_type="dapo",
        scale_rewards="group", num_iterations=1, reward_weights=list(cfg.reward.weights),
        gradient_checkpointing=cfg.model.gradient_checkpointing, bf16=not fp32, use_cpu=not torch.cuda.is_available(),
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        use_transformers_continuous_batching=a.continuous_batching,
        model_init_kwargs={"dtype": "float32"} if fp32 else None)
    if a.engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cfg.engine.cpu_kv_cache_gb)))
        trl_args.update(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=cfg.engine.max_model_len,
                        vllm_importance_sampling_correction=False)
    peft = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=lora.target_modules, task_type="CAUSAL_LM")

    logs: list[dict[str, Any]] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            meter.last_end, meter.last_host = time.perf_counter(), host_counters()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now, host = time.perf_counter(), host_counters()
            meter.current["step_s"] = now - meter.last_end
            meter.current["host"], meter.last_host = delta(host, meter.last_host), host   # cpu_s, sys_s, faults
            meter.current["loadavg_1m"] = os.getloadavg()[0]
            meter.steps.append(meter.current)
            meter.current, meter.last_end = Meter._fresh(), now

        def on_log(self, args: Any, state: Any, control: Any, logs_: Any = None, **kw: Any) -> None:
            if kw.get("logs") is not None:
                logs.append(dict(kw["logs"]))

    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[exact_answer, tool_success], args=GRPOConfig(**trl_args),
                          train_dataset=dataset, processing_class=tokenizer, peft_config=peft, tools=[tool],
                          callbacks=[StepClock()])
    setup_s = time.perf_counter() - t0
    instrument(trainer, meter, tokenizer.pad_token_id, a.engine == "vllm")
    trainer.train()

    step_logs = [entry for entry in logs if "reward" in entry]
    runs = []
    for i, m in enumerate(meter.steps):
        log = step_logs[i] if i < len(step_logs) else {}
        train_passes = [f for f in m["forward_passes"] if f["grad"]]
        calls = m["generate_calls"]
        padded_gen = sum(c.get("padded_slots", 0) for c in calls)
        padded = sum(f["rows"] * f["width"] for f in train_passes)
        real = sum(f["tokens"] for f in train_passes)
        other_rollout = m["rollout_s"] - m["generate_s"] - m["tools_s"] - m["reward_s"]
        runs.append({
            "step": i + 1, "loadavg_1m": m["loadavg_1m"], "step_s": m["step_s"], **m["host"],
            "rollout_s": m["rollout_s"],
            "generate_s": m["generate_s"] - m["sync_s"], "sync_s": m["sync_s"], "tools_s": m["tools_s"],
            "reward_s": m["reward_s"], "rollout_other_s": other_rollout, "train_s": m["step_s"] - m["rollout_s"],
            "trajectories": len(m["uids"]), "trajectories_per_s": len(m["uids"]) / m["step_s"],
            "generate_calls": len(calls), "generate_rows": [c["rows"] for c in calls],
            "generate_call_s": [c["seconds"] for c in calls],
            "generate_call_max_tokens": [c["max_generated"] for c in calls],   # decode steps of a plain generate
            "generated_tokens": sum(c["generated_tokens"] for c in calls),
            "generate_padding_fraction": 1 - sum(c["prompt_tokens"] + c["generated_tokens"] for c in calls) / padded_gen
            if padded_gen else None,
            "tool_calls": m["tool_calls"], "train_forward_passes": len(train_passes),
            "train_padding_fraction": 1 - real / padded if padded else None, "train_tokens": real,
            "reward_mean": log.get("reward"), "reward_exact_answer": log.get("rewards/exact_answer/mean"),
            "reward_tool_success": log.get("rewards/tool_success/mean"),
            "response_tokens_mean": log.get("completions/mean_length"),
            "tool_call_frequency": log.get("tools/call_frequency"), "uids": m["uids"]})
    keys = ["step_s", "cpu_s", "rollout_s", "generate_s", "tools_s", "reward_s", "train_s", "sync_s",
            "trajectories_per_s"]
    report = {"benchmark": "trl_arm", "engine": a.engine, "continuous_batching": a.continuous_batching,
              "summary": {k: spread([run[k] for run in runs]) for k in keys}, "runs": runs, "setup_s": setup_s,
              "prompt_check": prompt_check, "overrides": a.overrides, "logs": logs,
              "trl_config": {k: v for k, v in trl_args.items() if k != "output_dir"},
              "samples": SAMPLES[:16], "torch_threads": torch.get_num_threads(), "machine": machine_info()}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
