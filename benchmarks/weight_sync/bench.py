"""Weight sync into vLLM on CPUs: vLLM's own RL API against turnrl's Ray sync, same weights, same machine.

    .venv/bin/python benchmarks/weight_sync/bench.py --rounds 3 --json runs/weight_sync.json

The payload is SmolLM2-135M-Instruct's full state dict in bf16 (what the trainer sends after a full
fine-tuning step, cast to the engine's dtype). Two paths, each into one vLLM engine holding the model:

- `vllm_rl_api`: a vLLM server (`python -m turnrl.engines.vllm_launch`), updated through vLLM's RL API
  (`/pause`, `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
  `/finish_weight_update`, `/resume`) with the `turnrl_file` transfer engine: the trainer writes one
  safetensors file to /dev/shm, the server memory-maps it and reloads layer by layer. What
  `engine.kind=vllm_server` does every step.
- `ray_object_store`: turnrl's own sync on CPUs (`trainer.weight_sync=auto` without GPUs): the tensors go
  into Ray's object store and an engine replica (an `EngineReplica` actor holding the in-process vLLM
  engine) fetches them and reloads in place (`VLLMEngine.update_weights`). What `ReplicaPool.update_weights`
  does.

Each path is timed end to end per round (the first round included: it has no warm-up in real runs either);
the table shows the median and the JSON every round. Both engines then answer the same greedy request,
which must give the same tokens (the same weights arrived).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def payload(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    # a real update changes every value: perturb, so no path can skip unchanged data
    return {n: (t.float() * 1.001).to(torch.bfloat16) for n, t in tensors.items()}


async def probe(engine, prompt):
    from turnrl.engines.base import Sampling
    out = await engine.generate(prompt, Sampling(max_tokens=8, temperature=0.0, stop_token_ids=(2,)))
    return out.token_ids


def bench_server(model_dir: Path, tensors: dict[str, torch.Tensor], rounds: int, prompt: list[int]) -> dict:
    from turnrl.engines.vllm_launch import launch, stop
    from turnrl.engines.vllm_server import VLLMServer
    servers = launch(str(model_dir), 1, Path(tempfile.mkdtemp(prefix="turnrl-bench-")),
                     dict(dtype="bfloat16", max_model_len=2048), cpu_kv_cache_gb=1.0)
    try:
        server = VLLMServer(servers[0].url, transfer_dtype=torch.bfloat16)

        async def go():
            await server.connect()
            await server.set_version(0)
            times = []
            for r in range(1, rounds + 1):
                t0 = time.perf_counter()
                await server.update_weights(tensors.items(), r)
                times.append(time.perf_counter() - t0)
            tokens = await probe(server, prompt)
            await server.close()
            return times, tokens
        times, tokens = asyncio.run(go())
    finally:
        stop(servers)
    return {"seconds": times, "tokens": tokens}


def bench_ray(model_dir: Path, tensors: dict[str, torch.Tensor], rounds: int, prompt: list[int]) -> dict:
    import ray

    from turnrl.config.schema import EngineConfig
    from turnrl.distributed.replicas import EngineReplica, ReplicaPool
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cls = ray.remote(EngineReplica)
        cfg = EngineConfig(kind="vllm", dtype="bfloat16", max_model_len=2048, cpu_kv_cache_gb=1.0)
        pool = ReplicaPool(lambda slot, gen: cls.options(num_cpus=1).remote(f"r{slot}", str(model_dir), cfg, 1), 1)

        async def go():
            await pool.start()
            times = []
            for r in range(1, rounds + 1):
                t0 = time.perf_counter()
                await pool.update_weights(tensors, r)
                times.append(time.perf_counter() - t0)
            from turnrl.engines.base import Sampling
            out = await pool.replicas[0].handle.generate.remote(prompt, Sampling(max_tokens=8, temperature=0.0,
                                                                                 stop_token_ids=(2,)))
            await pool.close()
            return times, out.token_ids
        times, tokens = asyncio.run(go())
    finally:
        ray.shutdown()
    return {"seconds": times, "tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", default="vllm_rl_api,ray_object_store")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from turnrl.models import resolve
    from turnrl.rollout.factory import load_template
    model_dir = Path(resolve("smollm2-135m-instruct"))
    tensors = payload(model_dir)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    template = load_template(model_dir)
    prompt = template.encode(template.render([{"role": "user", "content": "What is 12 times 7?"}], None, True))
    runs = {}
    for name in args.paths.split(","):
        fn = {"vllm_rl_api": bench_server, "ray_object_store": bench_ray}[name]
        runs[name] = fn(model_dir, tensors, args.rounds, prompt)
        print(f"[bench] {name}: {[round(s, 2) for s in runs[name]['seconds']]} s", file=sys.stderr, flush=True)
    same = len({tuple(r["tokens"]) for r in runs.values()}) == 1
    print(f"\nweight sync into vLLM, CPU, SmolLM2-135M full weights bf16 ({nbytes / 2**20:.0f} MiB), "
          f"{args.rounds} rounds")
    print(f"{'path':<18} {'median s':>9} {'MiB/s':>8} {'rounds':>20}")
    for name, r in runs.items():
        med = statistics.median(r["seconds"])
        print(f"{name:<18} {med:>9.2f} {nbytes / 2**20 / med:>8.0f} {str([round(s, 2) for s in r['seconds']]):>20}")
    print(f"same greedy tokens after the last update on every path: {same}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"bytes": nbytes, "rounds": args.rounds, "same_tokens": same,
                                               "runs": runs}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
