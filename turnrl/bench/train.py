"""Training throughput of the real update path: `policy_update` on synthetic rows, tokens/s and MFU.

The rows look like a multi-turn RL batch: right-padded rows of varied length (uniform in
[min_fraction * T, T]), each a prompt (loss mask 0), then policy turns (loss mask 1) separated by tool
results (loss mask 0), with engine logprobs on the policy tokens and GRPO advantages of random rewards over
groups of `group` rows. The update is exactly the trainer's (`turnrl.train.update.policy_update`): the same
model setup as `Trainer.__init__` (`load_policy`, LoRA or full, packed attention with `trainer.packing`,
`compile_layers` with `trainer.compile` and `trainer.fuse_linears`, `settings_from(cfg, device)` with its
fused-head choice), optimizer, token-budget micro-batches (padded, or packed rows), autocast, loss, entropy
metric and clipping. The forward-only `logprob_pass` (the trainer's reference / old-logprob pass) is timed too.

FLOPs, per trained token (tokens = real, unpadded tokens; padding is reported, not counted as work):
- `6N` (the issue's figure, Kaplan et al. 2020): N = every parameter of the base model, tied embeddings
  counted once, LoRA adapters excluded. With tied embeddings this equals the matmul parameters (the LM head
  is the embedding). With LoRA the frozen weights get no weight gradient, so the work done is nearer 4N;
  6N is kept as the conventional yardstick and the LoRA discount is left to the reader.
- attention-inclusive (PaLM, Chowdhery et al. 2022, appendix B): 6N + 12 * L * H * d_head * S for a token of
  a row of length S, with no discount for the causal mask.
- executed (what the kernels compute, the figure to lead with): the body's matmuls 6 * N_body per token
  (N_body: the parameters outside the embedding and LM head), the LM head where it runs (the fused head:
  policy tokens only, 8 * V * h each, its backward recomputing the logits; the logits path: every token,
  6 * V * h), causal attention 12 * L * H * d_head * (i + 1) for the token at position i, which attends to
  i + 1 keys (PaLM's count with the causal mask: QK^T and PV cost 2 d_head FLOPs a head and query-key pair
  each, forward; the backward twice that; the flash backward's recomputation of the scores is not counted).
MFU = flops/s / peak. The peak is `--peak-tflops`, or 790 TFLOP/s (bf16 dense matmul as measured) on an
H200; elsewhere it is unknown and MFU is left out.

Shape models (`SHAPES`) are random-init models of a published config, built from a config dict without any
download and written to a temporary directory so that the trainer's own `load_policy` loads them.
"""

from __future__ import annotations

import contextlib
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from turnrl.algo.advantages import broadcast, grpo
from turnrl.bench.common import machine_info, spread
from turnrl.bench.profile import format_breakdown, host_syncs, profile_call
from turnrl.config import Config, to_dict
from turnrl.engines.hf import resolve_device
from turnrl.models import resolve
from turnrl.observe.gc_heap import freeze_heap, gc_pauses
from turnrl.train import flash_kernel
from turnrl.train.batching import Rows, micro_batches
from turnrl.train.master import master_weights
from turnrl.train.optim import build_optimizer
from turnrl.train.packing import packed_tokens, use_packed_attention
from turnrl.train.policy import autocast_dtype, compile_layers, load_policy, trainable_parameters
from turnrl.train.trainer import settings_from, use_fused_modules
from turnrl.train.update import logprob_pass, policy_update

# Random-init models of published configs (no download). Keys are AutoConfig.for_model arguments.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-shape": dict(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
        max_position_embeddings=32768, rms_norm_eps=1e-6),
    "smollm2-135m-shape": dict(
        model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=1e5,
        max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny-shape": dict(   # for tests: seconds on a CPU
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=4096),
}
PEAK_TFLOPS = {"H200": 790.0}   # bf16 dense matmul measured on the lent H200 (the spec sheet says 989)


@contextlib.contextmanager
def model_directory(spec: str) -> Iterator[Path]:
    """A local HF directory for `spec`: a shape model written to a temporary directory, or `resolve(spec)`."""
    if spec not in SHAPES:
        yield resolve(spec)
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**SHAPES[spec])
    with tempfile.TemporaryDirectory(prefix=f"turnrl-{spec}-") as tmp:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        yield Path(tmp)


def default_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def model_counts(model: Any) -> dict[str, int]:
    """Parameters of the base model (tied weights once, LoRA adapters out) and the attention shape."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    n = sum(p.numel() for name, p in base.named_parameters() if "lora_" not in name)
    embedding = base.get_input_embeddings().weight.numel()
    c = base.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head = base.get_output_embeddings()
    tied = head is not None and head.weight is base.get_input_embeddings().weight
    body = n - embedding - (0 if tied or head is None else head.weight.numel())
    return {"n_params": n, "n_params_non_embedding": n - embedding, "n_params_body": body, "n_trainable": trainable,
            "layers": c.num_hidden_layers, "attention_width": c.num_attention_heads * head_dim,
            "vocab": c.vocab_size, "hidden": c.hidden_size}


def synthetic_rows(batch: int, seq_len: int, vocab: int, device: torch.device, seed: int = 0,
                   min_fraction: float = 0.5, prompt_fraction: float = 0.5, turns: int = 3, group: int = 8) -> Rows:
    """Rows shaped like a multi-turn batch: prompt (masked), `turns` policy spans with tool spans between.

    Of the tokens after the prompt, three quarters are policy tokens (split over the turns) and one quarter
    tool results (split over the gaps between turns)."""
    if batch < 1 or seq_len < 4 or not 0 < min_fraction <= 1 or not 0 <= prompt_fraction < 1 or turns < 1:
        raise ValueError("synthetic rows need batch >= 1, seq_len >= 4, 0 < min_fraction <= 1, "
                         "0 <= prompt_fraction < 1 and turns >= 1")
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    attention = torch.zeros(batch, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(batch, seq_len)
    low = max(4, int(min_fraction * seq_len))
    for row in range(batch):
        length = int(torch.randint(low, seq_len + 1, (1,), generator=g))
        attention[row, :length] = 1
        start = max(1, int(prompt_fraction * length))
        rest = length - start
        tool = rest // 4 if turns > 1 else 0
        policy = rest - tool
        cursor = start
        for k in range(turns):
            span = policy // turns + (1 if k < policy % turns else 0)
            loss_mask[row, cursor:cursor + span] = 1
            cursor += span
            if k < turns - 1:
                cursor += tool // (turns - 1) + (1 if k < tool % (turns - 1) else 0)
    input_ids = input_ids * attention
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0) * attention
    engine = -torch.rand(batch, seq_len, generator=g) * 3 * loss_mask
    rewards = torch.rand(batch, generator=g).round()
    advantages = broadcast(grpo(rewards, torch.arange(batch) // group), loss_mask)
    rows = Rows(input_ids, attention, positions, loss_mask, engine.clone(), engine, advantages)
    return rows.to(device)   # as the trainer moves its rows: host counts kept, no sync in the update


def work(rows: Rows, micro_batch_tokens: int, counts: dict[str, int], packing: bool = False,
         fused_head: bool = True) -> dict[str, float]:
    """Tokens and FLOPs of one pass over `rows` (per update: x1; the forward-only pass is a third of it).
    `padded_tokens`: what the micro-batches compute on (rows x width, or packed lengths with `packing`)."""
    lengths = rows.lengths.cpu()
    tokens = int(lengths.sum())
    groups = micro_batches(torch.arange(len(lengths)), lengths, micro_batch_tokens, packing)
    padded = sum(packed_tokens(lengths[index]) if packing else len(index) * width for index, width in groups)
    six_n = 6.0 * counts["n_params"] * tokens
    attention = 12.0 * counts["layers"] * counts["attention_width"] * float((lengths.double() ** 2).sum())
    policy = int(rows.loss_mask.sum())
    head = counts["vocab"] * counts["hidden"] * (8.0 * policy if fused_head else 6.0 * tokens)
    pairs = float((lengths.double() * (lengths.double() + 1)).sum() / 2)     # (query, key) pairs under the mask
    causal = 12.0 * counts["layers"] * counts["attention_width"] * pairs
    executed = 6.0 * counts["n_params_body"] * tokens + head + causal
    return {"tokens": tokens, "padded_tokens": padded, "padding_fraction": 1 - tokens / padded,
            "policy_tokens": policy, "flops_6n": six_n, "flops_with_attention": six_n + attention,
            "flops_executed": executed,
            "rows": len(lengths), "mean_length": tokens / len(lengths)}


def _fused_groups() -> int:
    """Linear groups `trainer.fuse_linears` fused in this process (0 without trainer.compile)."""
    from turnrl.train.fuse_linears import FuseParallelLinears
    return FuseParallelLinears.fused


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB -> GiB, the whole process


def bench_policy(cfg: Config, device: torch.device, settings: Any) -> tuple[Any, str | None, dict[str, Any]]:
    """(model, packed-attention kernel or None, what was fused) of `cfg.model.name`, set up as the trainer sets its
    policy up: loaded, packed attention, fused MLPs or projections, compiled layers (before the optimizer)."""
    lora = cfg.model.lora
    with model_directory(cfg.model.name) as model_dir:
        model = load_policy(str(model_dir), device, lora.rank, lora.alpha, lora.dropout, lora.target_modules,
                            cfg.model.gradient_checkpointing)
        kernel = use_packed_attention(model, cfg.trainer.packed_attention) if settings.packing else None
        fused = use_fused_modules(model, cfg, device, settings.exact)
        if cfg.trainer.compile:
            compile_layers(model, cfg.trainer.fuse_linears)
    return model, kernel, fused


def bench_train(cfg: Config, batch: int, seq_len: int, steps: int, repeats: int, warmup: int = 1,
                peak_tflops: float | None = None, min_fraction: float = 0.5, prompt_fraction: float = 0.5,
                turns: int = 3, seed: int = 0, profile: bool = False) -> dict[str, Any]:
    if steps < 1 or repeats < 1 or warmup < 0:
        raise ValueError("the train benchmark needs --steps >= 1, --repeats >= 1 and --warmup >= 0")
    device = resolve_device(cfg.trainer.device)
    settings = settings_from(cfg, device)
    amp = autocast_dtype(cfg.trainer.dtype, device)
    t0 = time.perf_counter()
    model, kernel, fused = bench_policy(cfg, device, settings)
    setup_s = time.perf_counter() - t0
    master = master_weights([model], cfg.trainer.param_dtype, amp, settings.exact)   # as the trainer
    params = master.masters if master else trainable_parameters(model)
    total = (warmup + steps * repeats) * settings.epochs * settings.mini_batches
    optimizer, scheduler = build_optimizer(params, cfg.trainer.optim, total, master)
    generator = torch.Generator().manual_seed(seed)
    counts = model_counts(model)
    rows = synthetic_rows(batch, seq_len, counts["vocab"], device, seed, min_fraction, prompt_fraction, turns,
                          cfg.rollout.n)
    per_update = work(rows, settings.micro_batch_tokens, counts, settings.packing, settings.fused_head)
    if peak_tflops is None:
        peak_tflops = default_peak_tflops(device)

    def update() -> dict[str, float]:
        model.train()
        return policy_update(model, optimizer, scheduler, rows, settings, amp, generator, params)

    def forward() -> None:
        model.eval()
        logprob_pass(model, rows, settings, amp)

    for _ in range(warmup):
        update()
        forward()
    if warmup and cfg.engine.gc_freeze:   # as the trainer after its first step: what compiling made stays out
        freeze_heap()                     # of the collector's full passes (turnrl/observe/gc_heap.py)
    syncs = {"update": host_syncs(update, device), "logprob_pass": host_syncs(forward, device)}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = []
    for r in range(repeats):
        load = os.getloadavg()[0]
        _sync(device)
        gc_before = gc_pauses().snapshot()
        start = time.perf_counter()
        stats, ends = [], []
        for _ in range(steps):   # an update ends reading its metrics back: each end is its work's end
            stats.append(update())
            ends.append(time.perf_counter())
        _sync(device)
        update_s = (time.perf_counter() - start) / steps
        each = [b - a for a, b in zip([start] + ends, ends)]
        gc_pause = gc_pauses().since(gc_before)["time/gc_pause_s"]   # inside the timed updates
        start = time.perf_counter()
        for _ in range(steps):
            forward()
        _sync(device)
        forward_s = (time.perf_counter() - start) / steps
        runs.append({"repeat": r, "loadavg_1m": load, "update_s": update_s, "update_steps_s": each,
                     "update_gc_pause_s": gc_pause,
                     "logprob_pass_s": forward_s,
                     "loss": stats[-1].get("loss/policy"), "grad_norm": stats[-1].get("grad_norm"),
                     **_rates(per_update, update_s, forward_s, peak_tflops)})
    # every kernel of any weight in the JSON (the console shows the top 12)
    profiled = {"update": profile_call(update, device, top=100),
                "logprob_pass": profile_call(forward, device, top=100)} if profile else None
    keys = [k for k in runs[0] if k not in ("repeat", "loadavg_1m", "loss", "grad_norm", "update_steps_s",
                                            "update_gc_pause_s")]
    summary = {k: spread([run[k] for run in runs]) for k in keys if runs[0][k] is not None}
    return {"benchmark": "train", "summary": summary, "runs": runs, "work_per_update": per_update,
            "model": counts, "peak_tflops": peak_tflops, "peak_memory_gb": _peak_memory_gb(device),
            "setup_s": setup_s, **({"profile": profiled} if profiled else {}),
            "host_syncs": syncs,   # where one update / logprob pass waits for the device (CUDA only)
            **fused,   # MLPs trainer.fused_mlp switched (swiglu_kernel.py); attentions and MLPs fused_projections did
            "fused_linear_groups": _fused_groups(),   # groups trainer.fuse_linears fused (per compiled graph)
            "flops_note": "6N: N = all base-model parameters (tied embeddings once, LoRA adapters excluded); "
                          "with attention: + 12*L*H*d_head*S per token of a row of length S (PaLM, no causal "
                          "discount); executed: 6*N_body per token + the LM head where it runs + causal "
                          "attention 12*L*H*d_head*(i+1) for the token at position i (the keys it attends); "
                          "tokens are real (unpadded) tokens; with LoRA the work done is nearer 4N",
            "config": {"model": cfg.model.name, "lora": to_dict(cfg.model.lora), "batch": batch, "seq_len": seq_len,
                       "min_fraction": min_fraction, "prompt_fraction": prompt_fraction, "turns": turns,
                       "group": cfg.rollout.n, "steps": steps, "repeats": repeats, "warmup": warmup,
                       "device": str(device), "autocast": str(amp).removeprefix("torch.") if amp else "float32",
                       "weights": "bfloat16, fp32 masters" if master else "float32",
                       "gradient_checkpointing": cfg.model.gradient_checkpointing, "seed": seed,
                       "algo": to_dict(cfg.algo), "trainer": to_dict(cfg.trainer),
                       "packed_attention": kernel,
                       **({"triton_attention": flash_kernel.blocking()} if kernel == "triton" else {})},
            "machine": machine_info()}


def _rates(w: dict[str, float], update_s: float, forward_s: float, peak: float | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        "update_tokens_per_s": w["tokens"] / update_s,
        "update_tflops_6n": w["flops_6n"] / update_s / 1e12,
        "update_tflops_with_attention": w["flops_with_attention"] / update_s / 1e12,
        "update_tflops_executed": w["flops_executed"] / update_s / 1e12,
        "logprob_tokens_per_s": w["tokens"] / forward_s,
        "logprob_tflops_2n": w["flops_6n"] / 3 / forward_s / 1e12}
    for key in ("update_tflops_executed", "update_tflops_6n", "update_tflops_with_attention", "logprob_tflops_2n"):
        out[key.replace("tflops", "mfu")] = out[key] / peak if peak else None
    return out


def format_report(report: dict[str, Any]) -> str:
    cfg, w, m = report["config"], report["work_per_update"], report["model"]
    lora = f"LoRA r={cfg['lora']['rank']}" if cfg["lora"]["rank"] else "full fine-tuning"
    lines = [f"train benchmark: {cfg['model']} ({m['n_params'] / 1e6:.1f}M params, {m['n_trainable'] / 1e6:.2f}M "
             f"trainable, {lora}) on {cfg['device']} ({cfg['autocast']}, weights {cfg.get('weights', 'float32')}), "
             f"{cfg['batch']} rows x <= "
             f"{cfg['seq_len']} tokens: {w['tokens']} tokens/update ({w['policy_tokens']} in the loss), "
             f"padding {w['padding_fraction']:.1%}, micro-batch budget {cfg['trainer']['micro_batch_tokens']}",
             f"{'repeat':>6} {'update s':>9} {'tok/s':>9} {'MFU exec':>9} {'TFLOP/s 6N':>11} {'MFU 6N':>7} {'MFU attn':>9} "
             f"{'logprob s':>10} {'tok/s':>9} {'load':>5}"]
    pct = lambda v: f"{v:.1%}" if v is not None else "-"   # noqa: E731
    for run in report["runs"]:
        lines.append(f"{run['repeat']:>6} {run['update_s']:>9.3f} {run['update_tokens_per_s']:>9.1f} "
                     f"{pct(run['update_mfu_executed']):>9} "
                     f"{run['update_tflops_6n']:>11.3f} {pct(run['update_mfu_6n']):>7} "
                     f"{pct(run['update_mfu_with_attention']):>9} {run['logprob_pass_s']:>10.3f} "
                     f"{run['logprob_tokens_per_s']:>9.1f} {run['loadavg_1m']:>5.1f}")
    lines.append(f"  {'over repeats':<28} {'min':>10} {'median':>10} {'max':>10}")
    for key, spread in report["summary"].items():
        lines.append(f"  {key:<28} {spread['min']:>10.4g} {spread['median']:>10.4g} {spread['max']:>10.4g}")
    peak = report["peak_tflops"]
    mach = report["machine"]
    lines.append(f"peak {f'{peak} TFLOP/s' if peak else 'unknown (MFU left out; give --peak-tflops)'}; peak memory "
                 f"{report['peak_memory_gb']:.2f} GiB; machine: {mach['cpus_usable']}/{mach['cpu_count']} cpus, "
                 f"gpu={mach['gpu']}, load {mach['loadavg'][0]:.2f}; "
                 f"{', '.join(f'{k} {v}' for k, v in mach['versions'].items())}")
    for name, part in report.get("profile", {}).items():
        lines.append(format_breakdown(part, f"profile of one {name}"))
    return "\n".join(lines)
