"""`turnrl bench gateway`: what the gateway costs per request, and agents through it against the native loop.

Overhead: S concurrent sessions each make T chat calls in a row (each call sends the conversation so far plus a
new message, as an agent does) over HTTP (keep-alive) to the gateway, whose stand-in engine answers with a
fixed 16-token completion at once or after about `--engine-ms` (as a batched engine answers many sessions after
a while; at once, S sessions only queue on one event loop, and at large S a round trip measures the CPU per
call times S). Per call, overhead = round trip - the engine's time for that call (from submitting it to the
engine's completion, so what the gateway does while the engine samples is hidden only while the engine is still
sampling), which the gateway reports in its `Server-Timing` header: what the call costs beyond a direct engine call (`direct` is one, for reference).
Reported as p50/p99 over all calls, for:
- "no-HTTP": the same calls straight into `Gateway.chat` (capture, deltas, replies);
- "same loop": an httpx client on the server's own event loop, as the trainer's entry-point agents run: its
  JSON and HTTP work is counted between the server's steps;
- "httpx", "aiohttp": a client in its own process (`bench.gateway_client`), as an agent in another process
  makes them; httpx is the `openai` SDK's default transport, aiohttp the one it offers for many concurrent
  requests. "server" is the gateway's own time (request body to response body) from its header;
- "floor": that client against the same HTTP stack (FastAPI on uvicorn) answering the same routes with a
  fixed body after the same engine wait, timed as the gateway times its engine call (the clock around the
  await, so the event loop's late wake-up counts as engine time on both): what any OpenAI-compatible server
  costs that client (an engine's own server, called directly, costs at least this); "above floor" is what the
  gateway adds to it.
With `repeats` > 1 each row is measured that many times in a row: the row keeps every repeat's p50/p99
(`repeats`), and its figures are those of all the repeats' calls together.

Throughput: the same calculator tasks (one worked example each, greedy so both runs sample the same tokens;
those on which a tool call fails are left out, see `bench_agent_throughput`) through the native agent loop
and through the gateway with the openai-SDK example agent (examples/agents/openai_sdk), on the same real
engine; policy tokens per second of each, and their ratio.
"""

from __future__ import annotations

import asyncio
import random
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
    """Answers every request with the same completion, at once or after about `latency_s` (drawn from
    0.5-1.5 times it, seeded: a batched engine answers many sessions after a while, not all at the same
    instant, so the sessions do not stay in lockstep): the engine's cost drops out, its waiting can stay."""

    def __init__(self, template: ChatTemplate, latency_s: float = 0.0, seed: int = 0):
        self.ids = template.encode(REPLY) + [template.stop_token_ids[0]]
        self.latency_s = latency_s
        self.rng = random.Random(seed)

    def delay(self) -> float:
        return self.latency_s * (0.5 + self.rng.random()) if self.latency_s else 0.0

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        await asyncio.sleep(self.delay())
        return Completion(list(self.ids), [-0.5] * len(self.ids), "stop")

    async def close(self) -> None:
        return None


def _quantiles(values: list[float]) -> dict[str, float]:
    """Seconds in, milliseconds out."""
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


async def _in_process(gateway: Gateway, sessions: int, turns: int) -> list[float]:
    """The same calls straight into `Gateway.chat` (no HTTP): capture, deltas, replies; the engine's wait is
    taken out of each call."""
    from turnrl.gateway.requests import parse_chat
    out: list[float] = []

    async def one() -> None:
        session = gateway.open_session()
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
        for k in range(turns):
            t0 = time.perf_counter()
            answer = await gateway.chat(parse_chat({"model": "bench", "messages": messages, "max_tokens": 32}), session)
            out.append(time.perf_counter() - t0 - answer.engine_s)
            messages += [answer.replies[0].message(), {"role": "user", "content": f"And step {k}?"}]
        gateway.close_session(session.id)
    await asyncio.gather(*(one() for _ in range(sessions)))
    return out


async def _from_another_process(url: str, sessions: int, turns: int, client: str) -> dict[str, Any]:
    """The same calls from a client in its own process (`bench.gateway_client`), as an agent makes them."""
    import json
    import sys
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "turnrl.bench.gateway_client", url,
                                                str(sessions), str(turns), client, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the gateway client process failed ({proc.returncode}): {stderr.decode()[-2000:]}")
    return json.loads(stdout)


def _calls(measured: dict[str, Any]) -> dict[str, Any]:
    """A client's calls: round trips, and per call the round trip less the engine's time (the overhead)."""
    trips = measured["latencies_s"]
    engine = [ms / 1000 for ms in measured["engine_ms"]]
    return {"round_trip": _quantiles(trips), "overhead": _quantiles([t - e for t, e in zip(trips, engine)]),
            "calls_per_s": len(trips) / measured["seconds"],
            **({"server": _quantiles([ms / 1000 for ms in measured["gateway_ms"]])} if measured["gateway_ms"] else {})}


def floor_app(chat_body: dict[str, Any], engine: InstantEngine) -> Any:
    """The HTTP stack alone (FastAPI on uvicorn, as the gateway): the same routes answering a fixed chat body
    after the stand-in engine's wait (said in `Server-Timing`, as the gateway says it), so a client measures
    what its calls cost any OpenAI-compatible server before the gateway does anything."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    app = FastAPI()

    @app.post("/sessions")
    async def open_session() -> dict[str, Any]:
        return {"id": "floor"}

    async def chat(request: Request, sid: str) -> Any:
        await request.json()
        start = time.perf_counter()
        await asyncio.sleep(engine.delay())
        waited = time.perf_counter() - start   # as `Gateway.chat` times its engine: a late wake-up is the engine's
        return JSONResponse(chat_body, headers={"server-timing": f"engine;dur={waited * 1000:.3f}"})
    chat.__annotations__["request"] = Request   # a class, not the string this module's annotations are
    app.post("/sessions/{sid}/v1/chat/completions")(chat)

    @app.post("/sessions/{sid}/close")
    async def close(sid: str) -> dict[str, Any]:
        return {}
    return app


def _pooled(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one client measurement as one: all their calls, their seconds added."""
    return {"latencies_s": [x for p in parts for x in p["latencies_s"]], "seconds": sum(p["seconds"] for p in parts),
            "gateway_ms": [x for p in parts for x in p["gateway_ms"]],
            "engine_ms": [x for p in parts for x in p["engine_ms"]]}


async def bench_overhead(template: ChatTemplate, concurrency: list[int], turns: int,
                         engine_ms: list[float] = (0.0,), clients: list[str] = ("httpx", "aiohttp"), repeats: int = 1,
                         on_row: Any = None) -> dict[str, Any]:
    """One row per (engine latency, sessions); `on_row(report so far)` after each (a long run that is stopped
    keeps the rows it finished)."""
    from turnrl.bench.gateway_client import measure
    rows: list[dict[str, Any]] = []
    report = {"turns_per_session": turns, "repeats": repeats, "rows": rows}
    for latency in engine_ms:
        engine = InstantEngine(template, latency / 1000)
        gateway = Gateway(engine, template, get_parser("hermes"), ["bench"], Defaults(max_context=8192), "split")
        async with running(build_app(gateway)) as url:
            await measure(url, 4, 2)   # warm-up: imports, first renders, connections
            import httpx
            hi = {"model": "bench", "messages": [{"role": "user", "content": "Hi"}]}
            async with httpx.AsyncClient() as http:
                sid = (await http.post(f"{url}/sessions", json={})).json()["id"]
                body = (await http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=hi)).json()
            for sessions in concurrency:
                row: dict[str, Any] = {"sessions": sessions, "engine_ms": latency, "calls": sessions * turns * repeats,
                                       "direct": _quantiles(await _direct(engine, template, sessions, turns)),
                                       "no_http": _quantiles(await _in_process(gateway, sessions, turns)),
                                       "same_loop": _calls(await measure(url, sessions, turns)), "clients": {}}
                for client in clients:
                    sides, floors = [], []
                    async with running(floor_app(body, InstantEngine(template, latency / 1000, seed=1))) as floor:
                        for _ in range(repeats):   # alternating, so a drift of the machine reaches both alike
                            sides.append(await _from_another_process(url, sessions, turns, client))
                            floors.append(await _from_another_process(floor, sessions, turns, client))
                    side = _calls(_pooled(sides))
                    side["floor"] = _calls(_pooled(floors))
                    side["above_floor_p50_ms"] = side["overhead"]["p50_ms"] - side["floor"]["overhead"]["p50_ms"]
                    side["above_floor_p99_ms"] = side["overhead"]["p99_ms"] - side["floor"]["overhead"]["p99_ms"]
                    if repeats > 1:
                        side["repeats"] = [{"overhead": _calls(g)["overhead"], "floor": _calls(f)["overhead"]}
                                           for g, f in zip(sides, floors)]
                    row["clients"][client] = side
                rows.append(row)
                if on_row is not None:
                    on_row(report)
    return report


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
    lines = ["gateway overhead per call: round trip - the engine's time for that call (its Server-Timing), ms p50/p99",
             "  no-HTTP: Gateway.chat alone; same loop: httpx client on the server's event loop; httpx, aiohttp: "
             "a client in another process; floor: that client against a bare FastAPI server; server: the "
             "gateway's own time (Server-Timing)",
             f"{'engine':>7} {'sessions':>8} {'no-HTTP':>15} {'same loop':>15} {'client':>8} {'overhead':>15} "
             f"{'floor':>15} {'above floor':>15} {'server':>15} {'calls/s':>8}"]
    pair = lambda q: f"{q['p50_ms']:.2f}/{q['p99_ms']:.2f}"  # noqa: E731
    for r in report["overhead"]["rows"]:
        first = True
        for client, c in r["clients"].items():
            head = (f"{r['engine_ms']:>5.0f}ms {r['sessions']:>8} {pair(r['no_http']):>15} "
                    f"{pair(r['same_loop']['overhead']):>15}") if first else " " * 48
            first = False
            above = f"{c['above_floor_p50_ms']:.2f}/{c['above_floor_p99_ms']:.2f}"
            lines.append(f"{head} {client:>8} {pair(c['overhead']):>15} {pair(c['floor']['overhead']):>15} "
                         f"{above:>15} {pair(c['server']) if 'server' in c else '-':>15} {c['calls_per_s']:>8.1f}")
            if "repeats" in c:
                each = ", ".join(f"{x['overhead']['p50_ms']:.2f} (floor {x['floor']['p50_ms']:.2f})" for x in c["repeats"])
                lines.append(f"{'':>48} {'':>8} p50 of each repeat: {each}")
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
