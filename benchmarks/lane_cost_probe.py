"""What one more suffix lane costs in the shared-prefix pass, in padded tokens (`shared_prefix.LANE_COST`).

Times `shared_hidden` forward + backward (the trainer's autocast) on 2 groups of 8 rows sharing a prefix:
1. every suffix of length L in one lane, for several L: the slope is the time of one more padded suffix
   token, b;
2. suffixes of L and L - 1 split into two lanes (lane cost 0) against one lane (a huge lane cost): two lanes
   save 8 padded tokens and pay one more call, so the call costs a = t2 - t1 + 8b.
Prints a / b (the lane cost in tokens) and writes $OUT/lane_cost.json (or ./lane_cost.json). From the repo root:
    PYTHONPATH=. python3 benchmarks/lane_cost_probe.py [--model qwen2.5-0.5b-shape] [--prefix 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from turnrl.bench.train import model_directory
from turnrl.train import shared_prefix
from turnrl.train.policy import autocast_dtype, load_policy


def rows(prefix: int, suffixes: list[int], vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    width = prefix + max(suffixes)
    n = len(suffixes)
    ids = torch.randint(0, vocab, (n, width), generator=g)
    ids[n // 2:, :prefix] = ids[n // 2, :prefix]
    ids[:n // 2, :prefix] = ids[0, :prefix]
    mask = torch.zeros(n, width, dtype=torch.long)
    for r, s in enumerate(suffixes):
        mask[r, :prefix + s] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0) * mask
    group = torch.tensor([0] * (n // 2) + [1] * (n - n // 2))
    return (ids * mask).to(device), mask.to(device), positions.to(device), group, torch.full((n,), prefix)


def timed(decoder, batch, lane_cost: int, amp, device, repeats: int) -> float:
    shared_prefix.LANE_COST[device.type] = lane_cost
    ids, mask, pos, group, prefix = batch

    def once():
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            hidden = shared_prefix.shared_hidden(decoder, ids, mask, pos, group, prefix)
        hidden.float().square().mean().backward()

    once()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b-shape")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--lengths", default="64,128,256,512")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = autocast_dtype("bfloat16", device) if device.type == "cuda" else None
    with model_directory(a.model) as path:
        model = load_policy(str(path), device)
    decoder, vocab = model.get_decoder(), model.config.vocab_size
    lengths = [int(x) for x in a.lengths.split(",")]
    one_lane = {L: timed(decoder, rows(a.prefix, [L] * 16, vocab, device), 1 << 30, amp, device, a.repeats)
                for L in lengths}
    xs, ys = [16 * L for L in lengths], [one_lane[L] for L in lengths]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    split = {}
    for L in lengths:
        batch = rows(a.prefix, [L] * 8 + [L - 1] * 8, vocab, device)
        t1 = timed(decoder, batch, 1 << 30, amp, device, a.repeats)
        t2 = timed(decoder, batch, 0, amp, device, a.repeats)
        split[L] = {"one_lane_s": t1, "two_lanes_s": t2, "lane_s": t2 - t1 + 8 * slope,
                    "lane_cost_tokens": (t2 - t1 + 8 * slope) / slope}
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "model": a.model,
              "prefix": a.prefix, "rows": 16, "one_lane_s": one_lane, "s_per_suffix_token": slope,
              "split": split,
              "lane_cost_tokens_median": statistics.median(v["lane_cost_tokens"] for v in split.values())}
    print(json.dumps(report, indent=1))
    with open(os.path.join(os.environ.get("OUT", "."), "lane_cost.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
