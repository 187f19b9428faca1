"""`turnrl serve CFG|RUN_DIR`: an OpenAI-compatible endpoint over the policy (see turnrl/gateway/serve.py)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from turnrl.cli import command


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="a YAML config, or a run directory written by `turnrl train` (its latest checkpoint)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.sampling.temperature=0.7")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: a run's latest)")
    p.add_argument("--model-name", default=None, help="the model name clients ask for (default: the run "
                   "directory's name, else model.name)")
    p.add_argument("--record", default=None, help="append every closed session to DIR/trajectories.jsonl")


@command("serve", "OpenAI-compatible server over the policy; sessions record token-exact trajectories", _serve_args)
def cmd_serve(a: argparse.Namespace) -> int:
    from turnrl.gateway.app import build_app
    from turnrl.gateway.serve import build_gateway, recorder, resolve_target
    from turnrl.gateway.server import check_host, serve_until_stopped

    try:
        check_host(a.host, a.allow_remote)
        served = resolve_target(a.target, a.overrides, a.checkpoint, a.model_name)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None

    async def main() -> None:
        gateway, engine = await build_gateway(served)
        app = build_app(gateway, recorder(Path(a.record) if a.record else None))
        print(f"[turnrl] serving '{served.model_name}' at http://{a.host}:{a.port}/v1 "
              f"(sessions: POST /sessions)", flush=True)
        try:
            await serve_until_stopped(app, a.host, a.port, a.allow_remote)
        finally:
            await engine.close()

    asyncio.run(main())
    return 0
