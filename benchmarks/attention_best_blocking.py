"""The fastest Triton blocking of each kernel in an attention probe's JSON (`attention_backends_probe.py` with
--triton-* sweeps), and a runner that sets them before running a command line of turnrl in this process.

    python benchmarks/attention_best_blocking.py PROBE.json                      # prints the choice
    python benchmarks/attention_best_blocking.py PROBE.json -- bench train ...   # runs `turnrl bench train ...`

Forward blockings are ranked by forward time, backward ones (keys, queries) by forward + backward time; the
default blocking (the `triton` variant) competes in each.
"""

from __future__ import annotations

import json
import runpy
import sys


def best(probe: dict) -> dict[str, tuple[int, ...]]:
    variants = probe["variants"]
    default = variants.get("triton", {})
    choice = {}
    for kernel, key in (("forward", "fwd_ms"), ("keys", "fwd_bwd_ms"), ("queries", "fwd_bwd_ms")):
        name = kernel.upper()
        candidates = [(default[key], tuple(default["blocking"][name]))] if key in default else []
        candidates += [(entry[key], tuple(int(x) for x in variant.rsplit("_", 1)[1].split(":")))
                       for variant, entry in variants.items()
                       if variant.startswith(f"triton_{kernel}_") and key in entry]
        if candidates:
            choice[name] = min(candidates)[1]
    return choice


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--") if "--" in args else len(args)
    with open(args[0]) as fh:
        choice = best(json.load(fh))
    print("blocking:", json.dumps(choice), flush=True)
    if split < len(args):
        from turnrl.train import flash_kernel
        for name, value in choice.items():
            setattr(flash_kernel, name, value)
        sys.argv = ["turnrl", *args[split + 1:]]
        runpy.run_module("turnrl", run_name="__main__")


if __name__ == "__main__":
    main()
