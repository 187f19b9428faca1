"""GPU probe: training throughput of turnrl's real update path on a random-init Qwen2.5-0.5B-shaped model.

Variants: fp32 master weights + bf16 autocast (the default), bf16 weights, torch.compile per decoder layer,
fused AdamW, the chunked fused logprob head. Run on the device machine from the repo root:
    PYTHONPATH=. python3 benchmarks/gpu_train_probe.py
Prints one line per variant and writes $OUT/train_probe.json.
"""

from __future__ import annotations

import json
import os
import time
import traceback

import torch

from turnrl.train.batching import Rows
from turnrl.train.update import UpdateSettings, policy_update

PEAK = 790e12
B, T = 32, 1024


def qwen05():
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def rows(device) -> Rows:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 151000, (B, T), generator=g).to(device)
    attn = torch.ones_like(ids)
    pos = torch.arange(T, device=device).expand(B, T).contiguous()
    mask = torch.zeros(B, T, device=device)
    mask[:, 256:512] = 1   # policy turn 1
    mask[:, 640:1000] = 1  # policy turn 2 (tool tokens between)
    lp = torch.full((B, T), -1.0, device=device) * mask
    adv = torch.randn(B, 1, generator=g).to(device) * mask
    return Rows(ids, attn, pos, mask, lp.clone(), lp, adv)


def variant(name, dtype, compile_layers, fused, amp, fused_head=False, tokens=16384):
    device = torch.device("cuda")
    model = qwen05().to(device, dtype)
    model.config.use_cache = False
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-6, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    s = UpdateSettings(micro_batch_tokens=tokens, fused_head=fused_head)
    r = rows(device)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # warm-up (compilation)
        policy_update(model, opt, sched, r, s, amp, gen, params)
    torch.cuda.synchronize()
    iters = 6
    t0 = time.perf_counter()
    for _ in range(iters):
        policy_update(model, opt, sched, r, s, amp, gen, params)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    tps = B * T / dt
    mfu = 6 * n_params * tps / PEAK
    mem = torch.cuda.max_memory_allocated() / 2**30
    print(f"{name:40s} {tps:9.0f} tok/s  MFU(6N) {mfu:6.1%}  {dt * 1000:7.1f} ms/step  peak mem {mem:5.1f} GiB",
          flush=True)
    del model, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {"tokens_per_s": tps, "mfu_6n": mfu, "ms_per_step": dt * 1000, "n_params": n_params, "peak_gib": mem}


def main():
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    out = {}
    for name, args in [
        ("fp32 master + bf16 autocast (eager)", (torch.float32, False, True, torch.bfloat16)),
        ("fp32+autocast+compile+fused_head", (torch.float32, True, True, torch.bfloat16, True)),
        ("bf16 weights+compile+fused_head", (torch.bfloat16, True, True, None, True)),
        ("fp32+autocast+compile+fused_head mb32k", (torch.float32, True, True, torch.bfloat16, True, 32768)),
    ]:
        try:
            out[name] = variant(name, *args)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next variant
            print(name, "ERROR", repr(exc)[:300], " / ".join(traceback.format_exc().splitlines()[-4:])[:600],
                  flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "train_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
