"""What one admission's prefill costs on the GPU: host launch time, device time and its kernels.

The multi-turn benchmark (run_gpu.sh) counts the engine worker's host time admitting requests (`admit_s`):
on an H100, 15 admissions took 1.0-1.5 s of a 2.2-2.9 s multi-turn run, and 24 admissions 0.9 s of the
offline run, where nothing competes for the GIL. This times `SlotDecoder.prefill` alone at admission shapes
of that workload, on the main thread: the wall time to launch it (host), the time until the device is done,
and `turnrl.bench.profile`'s kernel breakdown of one call.

    python benchmarks/fast_prefix/prefill_probe.py --out prefill_probe.json          (CUDA)

Compiling the prefill's layer pieces (torch.compile, dynamic shapes) was measured with this probe at commit
3577c73 (`--compile`, h100_prefill_probe_compiled_2026-12-05.json): device time fell (54 x 300 tokens: 48.7 ->
32.2 ms) but launching became as slow as the device (29.8-37.6 ms a call, the cached case 18.9 -> 37.7 ms),
and the multi-turn run did not move, so the engine's prefill stays eager.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from turnrl.bench.engine import build_model
from turnrl.bench.profile import profile_call
from turnrl.engines.fast.decoder import SlotDecoder

# (rows, new tokens per row, cached tokens before them): a first turn's admission (prompt budget 16384 /
# ~300-token contexts), a later turn's without the cache (whole context) and with it (the delta only)
CASES = ((54, 300, 0), (64, 230, 0), (64, 40, 230), (256, 40, 230))


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median host launch seconds and median seconds until the device is done."""
    launch, done = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        launch.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        done.append(time.perf_counter() - start)
    return sorted(launch)[repeats // 2], sorted(done)[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b-shape")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_model(args.model, device, torch.bfloat16)
    decoder = SlotDecoder(model, 256, 1024)
    vocab = model.config.vocab_size
    rows = []
    with torch.no_grad():
        for n, width, cached in CASES:
            ids = torch.randint(100, vocab - 100, (n, width), device=device)
            lengths = torch.full((n,), width, device=device)
            slots = torch.arange(n, device=device)
            starts = torch.full((n,), cached, device=device) if cached else None

            def call():
                return decoder.prefill(ids, lengths, slots, starts, cached + width)
            call()
            launch, done = timed(call, args.repeats)
            prof = profile_call(call, device, top=12)
            rows.append({"rows": n, "new_tokens": width, "cached_tokens": cached, "launch_ms": launch * 1e3,
                         "done_ms": done * 1e3, "tokens_per_s": n * width / done, "profile": prof})
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()
                              if k != "profile"}), flush=True)
            for kernel in prof["top"][:8]:
                print(f"    {kernel['s'] * 1e3:8.3f} ms {kernel['calls']:4d}x {kernel['name'][:90]}")
    with open(args.out, "w") as f:
        json.dump({"benchmark": "prefill_probe", "model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
