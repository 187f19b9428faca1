"""`turnrl bench rollout` end to end on the hf engine at toy sizes: the report's fields, not the speed."""

import json

import pytest
import torch

from turnrl.cli import main


@pytest.mark.slow
def test_bench_rollout_writes_the_report(tmp_path):
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the hf engine's worker keeps the count it starts with; one is fastest on 2 busy cores
    try:
        assert main(["bench", "rollout", "--engine", "hf", "--task", "calculator", "--prompts", "2", "--n", "1",
                     "--repeats", "2", "--max-tokens", "8", "--json", str(out),
                     "rollout.max_assistant_turns=2", "engine.dtype=float32"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "rollout" and len(report["runs"]) == 2
    for key in ("multi_turn_tokens_per_s", "offline_tokens_per_s", "ratio"):
        spread = report["summary"][key]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    for run in report["runs"]:
        multi, offline = run["multi_turn"], run["offline"]
        assert multi["policy_tokens"] > 0 and multi["turns"] >= 2
        assert offline["requests"] == multi["turns"] and offline["matched"]
        assert offline["generated_tokens"] == multi["policy_tokens"]
        assert offline["prompt_tokens"] == multi["prompt_tokens"]
        assert run["ratio"] == pytest.approx(multi["policy_tokens_per_s"] / offline["generated_tokens_per_s"])
        assert 0 < multi["loop_cpu_s"] <= multi["process_cpu_s"] and offline["process_cpu_s"] > 0
    assert report["config"]["engine"]["kind"] == "hf" and report["config"]["rollout"]["n"] == 1
    assert report["config"]["task_source"] == ["calculator"] and report["config"]["tasks"] == 2
    assert report["runs"][0]["offline"]["engine_stats"]["requests"] == report["runs"][0]["offline"]["requests"]
    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and "torch" in machine["versions"]


def test_bench_rollout_rejects_an_unknown_engine(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "rollout", "--engine", "sglang", "--json", "x.json"])
    assert "invalid choice" in capsys.readouterr().err
