"""Why generation costs what it costs in the race: the same decode work on four model/engine set-ups.

Every variant generates exactly `--new` tokens (no stop token) for each of the race's first-step rollout
prompts (2 tasks x 8 samples, rendered by turnrl's chat template), sampling at the race's temperature:
- `trl-generate`: what TRL's plain-`generate` path runs on: the training model itself, fp32 weights with the
  LoRA adapters unmerged (peft), one left-padded `generate` call;
- `trl-generate-autocast`: the same under bf16 autocast (what accelerate wraps the model's forward in when
  training with bf16; whether TRL's generate goes through that wrapper is recorded by trl_arm.py);
- `merged-bf16-generate`: a bf16 copy with the adapters merged (the weights turnrl's engine holds), one
  `generate` call: the weights' effect alone;
- `turnrl-hf-engine`: turnrl's HF engine on that bf16 copy, the requests submitted concurrently.
Prints tokens/s per variant and writes JSON. python decode_cost.py --json FILE (in the race's venv)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new", type=int, default=64, help="tokens generated per row (the race's per-turn limit)")
    p.add_argument("--json", required=True)
    a = p.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turnrl.bench.common import cpu_seconds, machine_info
    from turnrl.chat.session import ChatSession
    from turnrl.chat.templates import ChatTemplate
    from turnrl.engines.base import Sampling
    from turnrl.engines.hf import HFEngine
    from turnrl.env.builtin.calculator import Calculator
    from turnrl.ledger import Trajectory
    from turnrl.models import resolve

    sys.path.insert(0, str(Path(__file__).parent))
    from trl_arm import load_race_config, ordered_tasks

    cfg = load_race_config(["data.prompts_per_step=2"])
    model_dir = str(resolve(cfg.model.name))
    template = ChatTemplate(AutoTokenizer.from_pretrained(model_dir))
    prompts = []
    for task in ordered_tasks(cfg, 1):
        session = ChatSession(template, task.messages, [Calculator.schema],
                              Trajectory(group_id=task.uid, sample_index=0, messages=[], info={}), "error")
        prompts += [list(session.context_ids)] * cfg.rollout.n
    temperature = cfg.rollout.sampling.temperature
    lora = cfg.model.lora

    def policy() -> Any:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                                task_type="CAUSAL_LM")).eval()

    def generate(model: Any, autocast: bool, new: int) -> int:
        pad = template.tokenizer.pad_token_id
        width = max(len(x) for x in prompts)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in prompts])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts])
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=True, temperature=temperature, top_k=0, pad_token_id=pad)
        return int(out.shape[1] - width) * len(prompts)

    def timed(name: str, run: Any) -> dict[str, Any]:
        start, cpu = time.perf_counter(), cpu_seconds()
        tokens = run()
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        row = {"variant": name, "seconds": seconds, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / seconds}
        print(f"{name:<24} {seconds:>8.2f} s {cpu:>8.1f} cpu-s {tokens:>6} tokens {tokens / seconds:>8.1f} tok/s",
              flush=True)
        return row

    rows = []
    torch.manual_seed(0)
    model = policy()
    for autocast in (False, True):
        generate(model, autocast, 4)   # warm-up: kernels for these shapes
        rows.append(timed("trl-generate" + ("-autocast" if autocast else ""), lambda: generate(model, autocast, a.new)))
    merged = model.merge_and_unload().to(torch.bfloat16).eval()
    generate(merged, False, 4)
    rows.append(timed("merged-bf16-generate", lambda: generate(merged, False, a.new)))

    async def engine_run() -> int:
        engine = HFEngine(model_dir, device="cpu", dtype="bfloat16", model=merged)
        try:
            sampling = Sampling(max_tokens=4, temperature=temperature)
            await asyncio.gather(*(engine.generate(x, sampling) for x in prompts[:4]))   # warm-up
            sampling = Sampling(max_tokens=a.new, temperature=temperature)
            start, cpu = time.perf_counter(), cpu_seconds()
            outs = await asyncio.gather(*(engine.generate(x, sampling.with_(seed=i)) for i, x in enumerate(prompts)))
            return sum(len(o.token_ids) for o in outs), time.perf_counter() - start, cpu_seconds() - cpu
        finally:
            await engine.close()
    tokens, seconds, cpu = asyncio.run(engine_run())
    rows.append({"variant": "turnrl-hf-engine", "seconds": seconds, "cpu_s": cpu, "tokens": tokens,
                 "tokens_per_s": tokens / seconds})
    print(f"{'turnrl-hf-engine':<24} {seconds:>8.2f} s {cpu:>8.1f} cpu-s {tokens:>6} tokens "
          f"{tokens / seconds:>8.1f} tok/s")
    report = {"benchmark": "decode_cost", "rows": len(prompts), "new_tokens": a.new,
              "prompt_tokens": [len(x) for x in prompts], "temperature": temperature, "variants": rows,
              "loadavg": list(os.getloadavg()), "machine": machine_info()}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
