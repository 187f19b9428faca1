"""Builds the packed trainer's Triton attention kernels (`turnrl/train/flash_triton.py`) for a GPU offline, on any
machine with Triton (its NVIDIA backend ships ptxas and cuobjdump), and reports each blocking's registers per
thread, spilled bytes (stack) and shared memory. No GPU needed: it compiles, it runs nothing. A blocking that
spills is slow whatever the sweep on a GPU says about its neighbours; this picks what the GPU sweep
(`benchmarks/attention_backends_probe.py --triton-*`) then times.

    PYTHONPATH=. python benchmarks/flash_kernel_build_probe.py --json OUT.json \
        --forward 128:64:8:3,128:64:4:3 --keys 64:32:8:3 --queries 64:64:8:3 [--arch 90]

Blockings: program block:step block:warps:stages[:register cap] (as `flash_kernel.FORWARD`, `KEYS`, `QUERIES`).
On sm_90 it also reports how many programs fit an SM at once (registers, shared memory): the dK/dV kernel's
per-head walk took 196 registers under Triton 3.6, 2 programs an SM; its flat walk 122, 4 (`FLAT_KEYS`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

BF16, F32, I32 = "*bf16", "*fp32", "*i32"
COMMON = {"H": "constexpr", "KV": "constexpr", "D": "constexpr", "WIDEN": "constexpr", "ACROSS": "constexpr"}
SIGNATURES = {
    "forward": {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "o_ptr": BF16, "lse_ptr": F32, "cu_ptr": I32,
                "N": "i32", "n_blocks": "i32", "scale2": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"},
    "keys": {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "do_ptr": BF16, "lse_ptr": F32, "delta_ptr": F32,
             "dk_ptr": BF16, "dv_ptr": BF16, "dq_ptr": F32, "cu_ptr": I32, "N": "i32", "scale": "fp32",
             "scale2": "fp32", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr", "ATOMIC_DQ": "constexpr",
             "FLAT": "constexpr"},
    "queries": {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "do_ptr": BF16, "lse_ptr": F32, "delta_ptr": F32,
                "dq_ptr": BF16, "cu_ptr": I32, "N": "i32", "n_blocks": "i32", "scale": "fp32", "scale2": "fp32",
                "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"},
}


# Hopper's (sm_90) limits an SM: registers, shared memory (228 KiB, 1 KiB of it reserved a program), warps
HOPPER = {"registers": 65536, "shared": 233472, "reserved": 1024, "warps": 64, "programs": 32}


def programs_per_sm(registers: int, warps: int, shared: int, limits: dict[str, int] = HOPPER) -> int:
    """How many programs of a kernel fit one SM at once: registers are given out a warp at a time, in units of
    256 (8 a thread), and the shared memory a program at a time."""
    per_warp = -(-registers // 8) * 8 * 32
    by_registers = limits["registers"] // per_warp // warps
    by_shared = limits["shared"] // (shared + limits["reserved"])
    return min(by_registers, by_shared, limits["warps"] // warps, limits["programs"])


def build(kernel: str, blocking: tuple[int, ...], heads: int, kv: int, dim: int, arch: int,
          atomic: bool = False, flat: bool = True) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from turnrl.train import flash_triton

    outer, inner, warps, stages = blocking[:4]
    signature = {**{k: v for k, v in SIGNATURES[kernel].items() if v != "constexpr"}, **COMMON,
                 **{k: v for k, v in SIGNATURES[kernel].items() if v == "constexpr"}}
    constants = {"H": heads, "KV": kv, "D": dim, "WIDEN": False, "ACROSS": True}
    if kernel == "keys":
        constants.update(BLOCK_N=outer, BLOCK_M=inner, ATOMIC_DQ=atomic, FLAT=flat)
    else:
        constants.update(BLOCK_M=outer, BLOCK_N=inner)
    fn = getattr(flash_triton, kernel)
    # as the launcher specializes them at run time: torch's allocations are 16-byte aligned
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
               if kind.startswith("*")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned)
    options = {"num_warps": warps, "num_stages": stages}
    if len(blocking) == 5 and blocking[4]:
        options["maxnreg"] = blocking[4]   # the register cap of flash_kernel's five-entry blockings
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(compiled.asm["cubin"])
        fh.flush()
        usage = subprocess.run([tool, "-res-usage", fh.name], capture_output=True, text=True, check=True).stdout
    fields = dict(item.split(":") for line in usage.splitlines() if "REG:" in line for item in line.split()
                  if ":" in item and item.split(":")[1].isdigit())
    ptx = compiled.asm["ptx"]
    registers, shared = int(fields["REG"]), int(compiled.metadata.shared)
    occupancy = {"programs_per_sm": programs_per_sm(registers, warps, shared)} if arch == 90 else {}
    return {"registers": registers, "spilled_bytes": int(fields["STACK"]), "shared_bytes": shared, **occupancy,
            "warpgroup_mma": ptx.count("wgmma.mma_async"),
            "async_copies": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "global_loads": {kind: ptx.count(kind) for kind in ("ld.global.v4", "ld.global.v2", "ld.global.b16")
                             if kind in ptx}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--forward", default="128:64:8:3,128:64:4:3,128:128:8:3")
    ap.add_argument("--keys", default="64:32:8:3,64:64:8:3,64:64:4:3,64:32:4:3")
    ap.add_argument("--queries", default="64:64:8:3,64:64:4:3,128:32:8:3")
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--per-head-keys", action="store_true", help="the dK/dV kernel's per-head loops (FLAT_KEYS off)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import triton
    report = {"benchmark": "flash_kernel_build_probe", "triton": triton.__version__, "arch": args.arch,
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "builds": []}
    for kernel in ("forward", "keys", "queries"):
        for spec in filter(None, getattr(args, kernel).split(",")):
            blocking = tuple(int(x) for x in spec.split(":"))
            try:
                entry = build(kernel, blocking, args.heads, args.kv_heads, args.head_dim, args.arch,
                              flat=not args.per_head_keys)
            except Exception as exc:  # a blocking that does not build is a result too
                entry = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            entry = {"kernel": kernel, "blocking": spec, **entry}
            report["builds"].append(entry)
            print(json.dumps(entry), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
