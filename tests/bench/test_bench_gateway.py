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
        assert main(["bench", "gateway", "--sessions", "1,4", "--turns", "3", "--prompts", "2", "--n", "1",
                     "--json", str(out), "engine.kind=hf", "engine.dtype=float32"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    rows = report["overhead"]["rows"]
    assert [r["sessions"] for r in rows] == [1, 4] and [r["calls"] for r in rows] == [3, 12]
    for r in rows:
        for side in ("direct", "gateway", "in_process", "other_process"):
            assert 0 < r[side]["p50_ms"] <= r[side]["p99_ms"]
        assert r["gateway"]["p50_ms"] > r["direct"]["p50_ms"] and r["other_process"]["calls_per_s"] > 0
        assert 0 < r["other_process"]["http_floor"]["p50_ms"] <= r["other_process"]["http_floor"]["p99_ms"]
    t = report["throughput"]
    assert t["native"]["trajectories"] == t["gateway"]["trajectories"] == t["tasks"]["timed"] >= 1
    # greedy, float32, the same tasks: the agent through the gateway sampled exactly what the native loop did
    assert t["same_policy_tokens"] and t["native"]["policy_tokens"] > 0
    assert t["gateway"]["parity"] == {"exact": t["tasks"]["timed"]}
