"""Where the host spends an update of `turnrl bench train` (the README's GPU workload), and where the device waits
for it: a timeline of one update's phases on the host (perf_counter) and on the device (CUDA events), and a
cProfile of the host over a few updates.

    PYTHONPATH=. python benchmarks/update_host_probe.py --json OUT.json [bench train overrides...]

The bench's setup (`turnrl.bench.train`): Qwen2.5-0.5B shape, random init, 64 rows of 512-1024 tokens, packed,
compiled layers, bf16 weights with fp32 masters. Phases: prep (batching and packing, up to the micro-batch), the
forward (to the loss), the backward, the optimizer step, the metrics read at the end (the update's one sync).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from turnrl.bench.train import bench_policy, synthetic_rows
from turnrl.config import load_config
from turnrl.train import update as up
from turnrl.train.master import master_weights
from turnrl.train.optim import build_optimizer
from turnrl.train.policy import autocast_dtype, trainable_parameters
from turnrl.train.trainer import settings_from

DEFAULTS = ["model.name=qwen2.5-0.5b-shape", "model.lora.rank=0", "trainer.compile=true", "trainer.packing=true",
            "trainer.micro_batch_tokens=65536", "trainer.param_dtype=bfloat16", "trainer.packed_attention=triton"]


class Timeline:
    """Host and device stamps at named points of one update."""

    def __init__(self) -> None:
        self.points: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.points.append((name, time.perf_counter(), event))

    def report(self) -> list[dict]:
        torch.cuda.synchronize()
        first_host, first_event = self.points[0][1], self.points[0][2]
        return [{"point": name, "host_ms": (host - first_host) * 1e3, "device_ms": first_event.elapsed_time(event)}
                for name, host, event in self.points]


def instrument(timeline: Timeline) -> None:
    """Stamps around the update's phases, patched into turnrl.train.update (the compiled layers are left alone:
    a hook in them would break their graphs)."""
    forward, step, micro = up.forward_logprobs, up.clip_and_step, up.micro_step

    def timed_forward(*args, **kwargs):
        timeline.mark("forward_start")
        out = forward(*args, **kwargs)
        timeline.mark("forward_issued")
        return out

    def timed_micro(*args, **kwargs):
        out = micro(*args, **kwargs)
        timeline.mark("backward_issued")
        return out

    def timed_step(*args, **kwargs):
        out = step(*args, **kwargs)
        timeline.mark("step_issued")
        return out

    up.forward_logprobs, up.micro_step, up.clip_and_step = timed_forward, timed_micro, timed_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(None, DEFAULTS + args.overrides)
    device = torch.device("cuda")
    settings = settings_from(cfg, device)
    amp = autocast_dtype(cfg.trainer.dtype, device)
    model, _, _ = bench_policy(cfg, device, settings)
    master = master_weights([model], cfg.trainer.param_dtype, amp, settings.exact)   # as the bench and trainer
    params = master.masters if master else trainable_parameters(model)
    optimizer, scheduler = build_optimizer(params, cfg.trainer.optim, 100, master)
    rows = synthetic_rows(64, 1024, model.config.vocab_size, device, 0, 0.5, 0.5, 3, cfg.rollout.n)
    generator = torch.Generator().manual_seed(0)

    def update() -> None:
        model.train()
        up.policy_update(model, optimizer, scheduler, rows, settings, amp, generator, params)

    for _ in range(2):
        update()
    torch.cuda.synchronize()
    timeline = Timeline()
    instrument(timeline)
    runs = []
    for _ in range(args.updates):
        timeline.points.clear()
        timeline.mark("call")
        update()
        timeline.mark("returned")
        runs.append(timeline.report())
    walls = [run[-1]["host_ms"] for run in runs]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        update()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
    report = {"gpu": torch.cuda.get_device_name(), "update_ms": walls, "median_update_ms": statistics.median(walls),
              "timelines": runs, "cprofile_3_updates": text.getvalue()}
    for run in runs:
        print(" ".join(f"{p['point']}={p['host_ms']:.2f}/{p['device_ms']:.2f}" for p in run), flush=True)
    print(text.getvalue()[:6000])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
