"""`turnrl bench gateway`: what the gateway costs per request, and agents through it against the native loop.

Overhead: S concurrent sessions each make T chat calls in a row (each call sends the conversation so far plus a
tool result, as an agent does), over HTTP (httpx, keep-alive) to the gateway, whose engine answers at once
with a fixed 16-token completion; the same S x T calls go straight to that engine. Per call, overhead =
gateway round trip - direct engine call; reported as p50/p99 over all calls at each S. The client runs in the
server's process and event loop, so its own JSON and HTTP work is counted in the overhead (an upper bound);
"no-HTTP" is the same calls made straight into `Gateway.chat`, the capture's own share, and "another process"
the same calls from a client in its own process (`bench.gateway_client`), as an agent in another process
makes them: its HTTP and JSON work runs beside the server's instead of between its steps. "HTTP floor" is
that client against the same HTTP stack (FastAPI on uvicorn) answering the same routes with a fixed body at
once: what any HTTP server costs such a client; "above floor" is what the gateway adds to it.

Throughput: the same calculator tasks (one worked example each, greedy so both runs sample the same tokens;
those on which a tool call fails are left out, see `bench_agent_throughput`) through the native agent loop
and through the gateway with the openai-SDK example agent (examples/agents/openai_sdk), on the same real
engine; policy tokens per second of each, and their ratio.
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
from turnrl.gateway.server import running
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


async def _through_gateway(url: str, sessions: int, turns: int) -> tuple[list[float], float]:
    """The calls over HTTP from a client on this process's event loop (the one the server runs on)."""
    from turnrl.bench.gateway_client import measure
    out = await measure(url, sessions, turns)
    return out["latencies_s"], out["seconds"]


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


async def _from_another_process(url: str, sessions: int, turns: int) -> dict[str, Any]:
    """The same calls from a client in its own process (`bench.gateway_client`), as an agent makes them."""
    import json
    import sys
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "turnrl.bench.gateway_client", url,
                                                str(sessions), str(turns), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the gateway client process failed ({proc.returncode}): {stderr.decode()[-2000:]}")
    return json.loads(stdout)


def floor_app(chat_body: dict[str, Any]) -> Any:
    """The HTTP stack alone (FastAPI on uvicorn, as the gateway): the same routes answering a fixed chat body at
    once, so a client measures what its calls cost before the gateway does anything."""
    from fastapi import FastAPI, Request
    app = FastAPI()

    @app.post("/sessions")
    async def open_session() -> dict[str, Any]:
        return {"id": "floor"}

    async def chat(request: Request, sid: str) -> dict[str, Any]:
        await request.json()
        return chat_body
    chat.__annotations__["request"] = Request   # a class, not the string this module's annotations are
    app.post("/sessions/{sid}/v1/chat/completions")(chat)

    @app.post("/sessions/{sid}/close")
    async def close(sid: str) -> dict[str, Any]:
        return {}
    return app


async def bench_overhead(template: ChatTemplate, concurrency: list[int], turns: int) -> dict[str, Any]:
    engine = InstantEngine(template)
    gateway = Gateway(engine, template, get_parser("hermes"), ["bench"], Defaults(max_context=8192), "split")
    rows = []
    async with running(build_app(gateway)) as url:
        await _through_gateway(url, 4, 2)   # warm-up: imports, first renders, connections
        import httpx
        async with httpx.AsyncClient() as http:
            sid = (await http.post(f"{url}/sessions", json={})).json()["id"]
            body = (await http.post(f"{url}/sessions/{sid}/v1/chat/completions",
                                    json={"model": "bench", "messages": [{"role": "user", "content": "Hi"}]})).json()
        for sessions in concurrency:
            direct = _quantiles(await _direct(engine, template, sessions, turns))
            service = _quantiles(await _in_process(gateway, sessions, turns))
            via, seconds = await _through_gateway(url, sessions, turns)
            g = _quantiles(via)
            other = await _from_another_process(url, sessions, turns)
            o = _quantiles(other["latencies_s"])
            async with running(floor_app(body)) as floor_url:
                floor = _quantiles((await _from_another_process(floor_url, sessions, turns))["latencies_s"])
            rows.append({"sessions": sessions, "calls": len(via), "direct": direct, "gateway": g, "in_process": service,
                         "overhead_p50_ms": g["p50_ms"] - direct["p50_ms"],
                         "overhead_p99_ms": g["p99_ms"] - direct["p99_ms"],
                         "calls_per_s": len(via) / seconds,
                         "other_process": {**o, "overhead_p50_ms": o["p50_ms"] - direct["p50_ms"],
                                           "overhead_p99_ms": o["p99_ms"] - direct["p99_ms"],
                                           "calls_per_s": len(other["latencies_s"]) / other["seconds"],
                                           "http_floor": floor,
                                           "above_floor_p50_ms": o["p50_ms"] - floor["p50_ms"] - direct["p50_ms"],
                                           "above_floor_p99_ms": o["p99_ms"] - floor["p99_ms"] - direct["p99_ms"]}})
    return {"turns_per_session": turns, "rows": rows}


async def bench_agent_throughput(engine: Any, template: ChatTemplate, loop: Any, tasks: list[Any], n: int,
                                 concurrency: int, max_context: int) -> dict[str, Any]:
    """Native agent loop vs the example agent through the gateway, same engine, tasks and greedy sampling.

    The two run the same conversation only while the model's tool calls parse and run: on a failed call the
    native loop answers with turnrl's tool error and goes on, while the example agent gets no `tool_calls` (or
    its own tool's error text) and stops, so the two do different work from there (measured: 436 policy tokens
    natively, 39 through the gateway, on one such task). A first untimed native pass picks the tasks whose
    trajectories have no error; both sides are then timed on those, and the report says how many were kept."""
    from turnrl.rollout.scheduler import run_batch
    probe = await run_batch(loop, tasks, 1, concurrency)
    clean = [task for task, traj in zip(tasks, probe) if not traj.errors]
    kept = clean or tasks
    tasks_total, tasks = len(tasks), kept
    await engine.reset_prefix_cache()   # each side starts cold: the second would reuse the first's prompts' KV
    t0 = time.perf_counter()
    native = await run_batch(loop, tasks, n, concurrency)
    native_s = time.perf_counter() - t0
    s = loop.sampling
    gateway = Gateway(engine, template, loop.parser, ["policy"],
                      Defaults(s.temperature, s.top_p, s.top_k, s.max_tokens, s.max_tokens, max_context), "split",
                      pin_sampling=True)
    agents = AgentRollout(gateway, f"{EXAMPLE_AGENT}:run", timeout_s=3600)
    await agents.start()
    await engine.reset_prefix_cache()
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
            "same_policy_tokens": a["policy_tokens"] == b["policy_tokens"],
            "tasks": {"given": tasks_total, "timed": len(tasks), "left_out_for_tool_errors": tasks_total - len(clean)}}


def format_report(report: dict[str, Any]) -> str:
    lines = ["gateway overhead (instant engine; per call: gateway round trip - direct engine call)",
             f"{'sessions':>9} {'calls':>6} {'direct p50':>11} {'gateway p50':>12} {'gateway p99':>12} "
             f"{'overhead p50':>13} {'overhead p99':>13} {'calls/s':>8} {'no-HTTP p50':>12} {'no-HTTP p99':>12}"]
    for r in report["overhead"]["rows"]:
        lines.append(f"{r['sessions']:>9} {r['calls']:>6} {r['direct']['p50_ms']:>9.3f}ms {r['gateway']['p50_ms']:>10.3f}ms "
                     f"{r['gateway']['p99_ms']:>10.3f}ms {r['overhead_p50_ms']:>11.3f}ms {r['overhead_p99_ms']:>11.3f}ms "
                     f"{r['calls_per_s']:>8.1f} {r['in_process']['p50_ms']:>10.3f}ms {r['in_process']['p99_ms']:>10.3f}ms")
    lines.append("the same calls from a client in another process (as an agent makes them)")
    lines.append(f"{'sessions':>9} {'overhead p50':>13} {'overhead p99':>13} {'calls/s':>8} {'HTTP floor p50':>15} "
                 f"{'HTTP floor p99':>15} {'above floor p50':>16} {'above floor p99':>16}")
    for r in report["overhead"]["rows"]:
        o = r.get("other_process")
        if o:
            f = o["http_floor"]
            lines.append(f"{r['sessions']:>9} {o['overhead_p50_ms']:>11.3f}ms {o['overhead_p99_ms']:>11.3f}ms "
                         f"{o['calls_per_s']:>8.1f} {f['p50_ms']:>13.3f}ms {f['p99_ms']:>13.3f}ms "
                         f"{o['above_floor_p50_ms']:>14.3f}ms {o['above_floor_p99_ms']:>14.3f}ms")
    t = report.get("throughput")
    if t:
        k = t.get("tasks", {})
        lines.append(f"agent throughput, calculator tasks, greedy, same engine ({k.get('timed')} of {k.get('given')} "
                     "tasks: those whose native trajectories had no tool error)")
        for name in ("native", "gateway"):
            x = t[name]
            lines.append(f"  {name:8s} {x['trajectories']:>4} trajectories {x['seconds']:>7.1f}s "
                         f"{x['policy_tokens']:>6} policy tokens {x['policy_tokens_per_s']:>7.1f} tok/s "
                         f"parity {x['parity']}")
        lines.append(f"  ratio gateway/native: {t['ratio_tokens_per_s']:.3f} (tokens/s), "
                     f"{t['ratio_trajectories_per_s']:.3f} (trajectories/s); same tokens: {t['same_policy_tokens']}")
    return "\n".join(lines)
