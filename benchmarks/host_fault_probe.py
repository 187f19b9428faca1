"""What a page fault costs on this machine as a process's memory grows: blocks of fresh memory touched in turn.

    python benchmarks/host_fault_probe.py [--block-gb 2] [--blocks 6] [--json out.json]

Each block is allocated (torch.empty), written once (every page faults in) and kept, so the process grows by
`--block-gb` each time; the system CPU time and minor faults of each touch are read with getrusage. On this
project's 2-core VM the first ~4-5 GB faulted in at ~1.4 us a page and memory beyond at ~6-14 us (the guest's
fresh pages are backed by the host on first touch), which is what made the race's vLLM arm slow in the steps
where its heap grew (README "The race against TRL").
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from turnrl.bench.common import delta, host_counters, machine_info


def touch_blocks(block_bytes: int, blocks: int) -> list[dict[str, float]]:
    kept, rows = [], []
    for i in range(blocks):
        before, start = host_counters(), time.perf_counter()
        block = torch.empty(block_bytes // 4, dtype=torch.float32)
        block.fill_(1.0)
        seconds, used = time.perf_counter() - start, delta(host_counters(), before)
        kept.append(block)
        faults, sys_s = used["minor_faults"], used["sys_s"]
        rows.append({"block": i, "held_gb": (i + 1) * block_bytes / 2**30, "seconds": seconds, "sys_s": sys_s,
                     "minor_faults": faults, "us_per_fault": 1e6 * sys_s / max(faults, 1),
                     "gb_per_s": block_bytes / 2**30 / seconds})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-gb", type=float, default=2.0)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--json")
    a = p.parse_args()
    rows = touch_blocks(int(a.block_gb * 2**30), a.blocks)
    for r in rows:
        print(f"block {r['block']} (held {r['held_gb']:.0f} GB): {r['seconds']:.2f} s, sys {r['sys_s']:.2f} s, "
              f"{r['minor_faults']} faults, {r['us_per_fault']:.1f} us a fault, {r['gb_per_s']:.2f} GB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "host_fault_probe", "threads": torch.get_num_threads(), "blocks": rows,
                       "machine": machine_info()}, f, indent=1)


if __name__ == "__main__":
    main()
