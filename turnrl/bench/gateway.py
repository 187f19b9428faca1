"""`turnrl bench gateway`: what the gateway costs per request, and agents through it against the native loop.

Overhead: S concurrent sessions each make T chat calls in a row (each call sends the conversation so far plus a
tool result, as an agent does), over HTTP (httpx, keep-alive) to the gateway, whose engine answers at once
with a fixed 16-token completion; the same S x T calls go straight to that engine. Per call, overhead =
gateway round trip - direct engine call; reported as p50/p99 over all calls at each S. The client runs in the
server's process and event loop, so its own JSON and HTTP work is counted in the overhead (an upper bound);
"no-HTTP" is the same calls made straight into `Gateway.chat`, the capture's own share.

Throughput: the same calculator tasks (one worked example each, greedy so both runs sample the same tokens)
through the native agent loop and through the gateway with the openai-SDK example agent
(examples/agents/openai_sdk), on the same real engine; policy tokens per second of each, and their ratio.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from turnrl.chat.parsers import get_parser
from turnrl.chat.templates import ChatTemplate
from turnrl.engines.base import Completion, EngineBase, Sampling
from turnrl.gateway.agents import AgentRollout
from turnrl.gateway.app import build_app
from turnrl.gateway.server import NODELAY, running
from turnrl.gateway.service import Defaults, Gateway
from turnrl.ledger import Source

EXAMPLE_AGENT = Path(__file__).resolve().parents[2] / "examples" / "agents" / "openai_sdk" / "agent.py"
REPLY = "The calculator says 42.\n#### 42"


class InstantEngine(EngineBase):
    """Answers every request at once with the same completion: the engine's cost drops out."""

    def __init__(self, template: ChatTemplate):
        self.ids = template.encode(REPLY) + [template.stop_token_ids[0]]

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        await asyncio.sleep(0)
        return Completion(list(self.ids), [-0.5] * len(self.ids), "stop")

    async def close(self) -> None:
        return None


def _quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))] * 1000  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": statistics.fmean(values) * 1000}


async def _direct(engine: InstantEngine, template: ChatTemplate, sessions: int, turns: int) -> list[float]:
    prompt = template.encode(template.render([{"role": "user", "content": "What is 6 * 7?"}], add_generation_prompt=True))
    sampling = Sampling(max_tokens=32)
    out: list[float] = []

    async def one() -> None:
        for _ in range(turns):
            t0 = time.perf_counter()
            await engine.generate(prompt, sampling)
            out.append(time.perf_counter() - t0)
    await asyncio.gather(*(one() for _ in range(sessions)))
    return out


async def _through_gateway(gateway: Gateway, url: str, sessions: int, turns: int) -> list[float]:
    import httpx
    out: list[float] = []
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY)
    async with httpx.AsyncClient(transport=transport, timeout=600) as http:
        async def one() -> None:
            session = gateway.open_session()
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
            for k in range(turns):
                t0 = time.perf_counter()
                r = await http.post(f"{url}/sessions/{session.id}/v1/chat/completions",
                                    json={"model": "bench", "messages": messages, "max_tokens": 32})
                out.append(time.perf_counter() - t0)
                r.raise_for_status()
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"And step {k}?"}]
            gateway.close_session(session.id)
        await asyncio.gather(*(one() for _ in range(sessions)))
    return out


async def _in_process(gateway: Gateway, sessions: int, turns: int) -> list[float]:
    """The same calls straight into `Gateway.chat` (no HTTP): capture, deltas, replies."""
    from turnrl.gateway.requests import parse_chat
    out: list[float] = []

    async def one() -> None:
        session = gateway.open_session()
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
        for k in range(turns):
            t0 = time.perf_counter()
            answer = await gateway.chat(parse_chat({"model": "bench", "messages": messages, "max_tokens": 32}), session)
            out.append(time.perf_counter() - t0)
            messages += [answer.replies[0].message(), {"role": "user", "content": f"And step {k}?"}]
        gateway.close_session(session.id)
    await asyncio.gather(*(one() for _ in range(sessions)))
    return out


async def bench_overhead(template: ChatTemplate, concurrency: list[int], turns: int) -> dict[str, Any]:
    engine = InstantEngine(template)
    gateway = Gateway(engine, template, get_parser("hermes"), ["bench"], Defaults(max_context=8192), "split")
    rows = []
    async with running(build_app(gateway)) as url:
        await _through_gateway(gateway, url, 4, 2)   # warm-up: imports, first renders, connections
        for sessions in concurrency:
            direct = _quantiles(await _direct(engine, template, sessions, turns))
            service = _quantiles(await _in_process(gateway, sessions, turns))
            t0 = time.perf_counter()
            via = await _through_gateway(gateway, url, sessions, turns)
            seconds = time.perf_counter() - t0
            g = _quantiles(via)
            rows.append({"sessions": sessions, "calls": len(via), "direct": direct, "gateway": g, "in_process": service,
                         "overhead_p50_ms": g["p50_ms"] - direct["p50_ms"],
                         "overhead_p99_ms": g["p99_ms"] - direct["p99_ms"],
                         "calls_per_s": len(via) / seconds})
    return {"turns_per_session": turns, "rows": rows}


async def bench_agent_throughput(engine: Any, template: ChatTemplate, loop: Any, tasks: list[Any], n: int,
                                 concurrency: int, max_context: int) -> dict[str, Any]:
    """Native agent loop vs the example agent through the gateway, same engine, tasks and greedy sampling."""
    from turnrl.rollout.scheduler import run_batch
    t0 = time.perf_counter()
    native = await run_batch(loop, tasks, n, concurrency)
    native_s = time.perf_counter() - t0
    s = loop.sampling
    gateway = Gateway(engine, template, loop.parser, ["policy"],
                      Defaults(s.temperature, s.top_p, s.top_k, s.max_tokens, s.max_tokens, max_context), "split",
                      pin_sampling=True)
    agents = AgentRollout(gateway, f"{EXAMPLE_AGENT}:run", timeout_s=3600)
    await agents.start()
    try:
        t0 = time.perf_counter()
        via = await agents.run_batch(tasks, n, concurrency)
        via_s = time.perf_counter() - t0
    finally:
        await agents.close()

    def side(trajs: list[Any], seconds: float) -> dict[str, Any]:
        tokens = sum(t.n_tokens(Source.POLICY) for t in trajs)
        return {"trajectories": len(trajs), "seconds": seconds, "policy_tokens": tokens,
                "policy_tokens_per_s": tokens / seconds, "trajectories_per_s": len(trajs) / seconds,
                "turns": sum(len(t.turns) for t in trajs), "errors": sum(len(t.errors) for t in trajs),
                "parity": {p: sum(t.parity == p for t in trajs) for p in sorted({t.parity for t in trajs})}}

    a, b = side(native, native_s), side(via, via_s)
    return {"native": a, "gateway": b, "ratio_tokens_per_s": b["policy_tokens_per_s"] / a["policy_tokens_per_s"],
            "ratio_trajectories_per_s": b["trajectories_per_s"] / a["trajectories_per_s"],
            "same_policy_tokens": a["policy_tokens"] == b["policy_tokens"]}


def format_report(report: dict[str, Any]) -> str:
    lines = ["gateway overhead (instant engine; per call: gateway round trip - direct engine call)",
             f"{'sessions':>9} {'calls':>6} {'direct p50':>11} {'gateway p50':>12} {'gateway p99':>12} "
             f"{'overhead p50':>13} {'overhead p99':>13} {'calls/s':>8} {'no-HTTP p50':>12} {'no-HTTP p99':>12}"]
    for r in report["overhead"]["rows"]:
        lines.append(f"{r['sessions']:>9} {r['calls']:>6} {r['direct']['p50_ms']:>9.3f}ms {r['gateway']['p50_ms']:>10.3f}ms "
                     f"{r['gateway']['p99_ms']:>10.3f}ms {r['overhead_p50_ms']:>11.3f}ms {r['overhead_p99_ms']:>11.3f}ms "
                     f"{r['calls_per_s']:>8.1f} {r['in_process']['p50_ms']:>10.3f}ms {r['in_process']['p99_ms']:>10.3f}ms")
    t = report.get("throughput")
    if t:
        lines.append("agent throughput, calculator tasks, greedy, same engine")
        for name in ("native", "gateway"):
            x = t[name]
            lines.append(f"  {name:8s} {x['trajectories']:>4} trajectories {x['seconds']:>7.1f}s "
                         f"{x['policy_tokens']:>6} policy tokens {x['policy_tokens_per_s']:>7.1f} tok/s "
                         f"parity {x['parity']}")
        lines.append(f"  ratio gateway/native: {t['ratio_tokens_per_s']:.3f} (tokens/s), "
                     f"{t['ratio_trajectories_per_s']:.3f} (trajectories/s); same tokens: {t['same_policy_tokens']}")
    return "\n".join(lines)
