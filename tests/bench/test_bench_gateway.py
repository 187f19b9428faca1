"""`turnrl bench gateway` end to end at toy sizes: the report's fields and that both sides did the same work."""

import json

import pytest
import torch

from turnrl.cli import main


@pytest.mark.slow
def test_bench_gateway_writes_the_report(tmp_path):
    out = tmp_path / "gateway.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["bench", "gateway", "--sessions", "1,4", "--turns", "3", "--engine-ms", "0,50",
                     "--prompts", "2", "--n", "1",
                     "--json", str(out), "engine.kind=hf", "engine.dtype=float32"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    rows = report["overhead"]["rows"]
    assert [(r["engine_ms"], r["sessions"], r["calls"]) for r in rows] == [(0, 1, 3), (0, 4, 12), (50, 1, 3),
                                                                            (50, 4, 12)]
    for r in rows:
        assert r["direct"]["p50_ms"] >= r["engine_ms"] / 2
        for q in [r["no_http"], r["same_loop"]["round_trip"], r["same_loop"]["overhead"]]:
            assert 0 < q["p50_ms"] <= q["p99_ms"]
        assert r["same_loop"]["round_trip"]["p50_ms"] > r["same_loop"]["overhead"]["p50_ms"]
        assert set(r["clients"]) == {"httpx", "aiohttp"}
        for c in r["clients"].values():
            for q in [c["round_trip"], c["overhead"], c["server"], c["floor"]["overhead"]]:
                assert 0 < q["p50_ms"] <= q["p99_ms"]
            # the engine's wait is in the round trip, not in the overhead; the gateway's own time is a part of it
            assert c["round_trip"]["p50_ms"] >= r["engine_ms"] / 2 > c["overhead"]["p50_ms"] - 50
            assert c["server"]["p50_ms"] < c["overhead"]["p50_ms"] and c["calls_per_s"] > 0
            assert "server" not in c["floor"]
    t = report["throughput"]
    assert t["native"]["trajectories"] == t["gateway"]["trajectories"] == t["tasks"]["timed"] >= 1
    # greedy, float32, the same tasks: the agent through the gateway sampled exactly what the native loop did
    assert t["same_policy_tokens"] and t["native"]["policy_tokens"] > 0
    assert t["gateway"]["parity"] == {"exact": t["tasks"]["timed"]}


def test_repeats_keep_each_repeat_and_rows_are_reported_as_they_finish(smol_template):
    import asyncio

    from turnrl.bench.gateway import bench_overhead

    seen = []
    report = asyncio.run(bench_overhead(smol_template, [1, 2], 2, [0.0, 20.0], ["aiohttp"], repeats=2,
                                        on_row=lambda part: seen.append(len(part["rows"]))))
    assert seen == [1, 2, 3, 4] and report["repeats"] == 2
    for r in report["rows"]:
        assert r["calls"] == r["sessions"] * 2 * 2
        c = r["clients"]["aiohttp"]
        assert len(c["repeats"]) == 2
        for each in c["repeats"]:
            assert 0 < each["overhead"]["p50_ms"] <= each["overhead"]["p99_ms"]
            assert 0 < each["floor"]["p50_ms"] <= each["floor"]["p99_ms"]
        # the pooled figures lie within the repeats' own
        p50s = [each["overhead"]["p50_ms"] for each in c["repeats"]]
        assert min(p50s) <= c["overhead"]["p50_ms"] <= max(p50s)
        if r["engine_ms"]:
            # the floor reports the wait it measured, as the gateway does: never less than the 0.5x it drew
            assert c["floor"]["round_trip"]["p50_ms"] - c["floor"]["overhead"]["p50_ms"] >= 20 * 0.5


def test_the_floor_reports_the_wait_it_measured_not_the_one_it_asked_for(smol_template):
    """The gateway times its engine call with the clock around the await; the floor must too, or the sleep's
    late wake-up counts as the floor's overhead (it did: the floor reported the wait it asked for)."""
    import asyncio

    import httpx

    from turnrl.bench.gateway import InstantEngine, floor_app

    engine = InstantEngine(smol_template)
    engine.delay = lambda: 0.0105   # noqa: E731 - a fixed wait
    app = floor_app({"id": "x"}, engine)

    async def call() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://floor") as http:
            r = await http.post("/sessions/s/v1/chat/completions", json={"model": "bench", "messages": []})
            return r.headers["server-timing"]
    header = asyncio.run(call())
    waited_ms = float(header.partition("engine;dur=")[2])
    assert waited_ms > 10.5   # asked 10.5 ms: a sleep never ends on time, and the floor says by how much
