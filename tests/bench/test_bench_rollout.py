"""`turnrl bench rollout` end to end on the hf engine at toy sizes: the report's fields, not the speed."""

import json

import pytest
import torch

from turnrl.bench.rollout import format_report
from turnrl.cli import main


@pytest.mark.slow
def test_bench_rollout_writes_the_report(tmp_path):
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the hf engine's worker keeps the count it starts with; one is fastest on 2 busy cores
    try:
        assert main(["bench", "rollout", "--engine", "hf", "--task", "calculator", "--prompts", "2", "--n", "1",
                     "--repeats", "1", "--warmup-repeats", "1", "--max-tokens", "8", "--json", str(out),
                     "rollout.max_assistant_turns=2", "engine.dtype=float32"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "rollout" and len(report["runs"]) == 2
    assert [run["warmup"] for run in report["runs"]] == [True, False]   # the summary is the second run's
    assert report["summary"]["ratio"] == {"min": report["runs"][1]["ratio"], "median": report["runs"][1]["ratio"],
                                          "max": report["runs"][1]["ratio"]}
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
        for phase in (multi, offline):   # the collector's pauses in the phase (README "The spread was the ...")
            gc = phase["gc"]
            assert gc["gc/collections"] >= gc["gc/full_collections"] >= 0
            assert gc["time/gc_pause_s"] >= gc["gc/full_pause_s"] >= 0
    assert "gc s m/o" in format_report(report)
    assert report["config"]["engine"]["kind"] == "hf" and report["config"]["rollout"]["n"] == 1
    assert report["config"]["task_source"] == ["calculator"] and report["config"]["tasks"] == 2
    assert report["runs"][0]["offline"]["engine_stats"]["requests"] == report["runs"][0]["offline"]["requests"]
    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and "torch" in machine["versions"]


def test_bench_rollout_rejects_an_unknown_engine(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "rollout", "--engine", "sglang", "--json", "x.json"])
    assert "invalid choice" in capsys.readouterr().err


def _traj(prompt, turns):
    """A trajectory over one segment per entry of `turns`: (segment, generated, environment tokens after)."""
    from turnrl.ledger import Segment, Source, Trajectory, Turn

    traj = Trajectory(group_id="g", sample_index=0, messages=[], segments=[])
    for index, (segment, generated, env) in enumerate(turns):
        if segment == len(traj.segments):   # a split: the new segment re-renders the context so far
            seg = Segment()
            seg.append(list(prompt) if not traj.segments else traj.segments[-1].token_ids, Source.PROMPT, index)
            traj.segments.append(seg)
        seg = traj.segments[segment]
        start = len(seg)
        seg.append(list(range(100, 100 + generated)), Source.POLICY, index, [0.0] * generated)
        traj.turns.append(Turn(index=index, segment=segment, start=start, end=len(seg), finish_reason="length",
                               text=""))
        seg.append([7] * env, Source.USER, index)
    return traj


def test_prefill_accounting_sets_context_against_new_tokens_per_turn():
    from turnrl.bench.rollout import prefill_accounting

    a = _traj([1, 2, 3, 4], [(0, 5, 3), (0, 5, 2), (0, 5, 0)])   # contexts 4, 12, 19; new 4, 3, 2
    b = _traj([1, 2, 9], [(0, 2, 6), (1, 4, 0)])                 # a split before turn 1: contexts 3, 11; new 3, 11
    report = prefill_accounting([a, b], engine_prefill=40)
    assert report["per_turn"] == [
        {"turn": 0, "requests": 2, "context_tokens": 7, "new_tokens": 7, "generated_tokens": 7},
        {"turn": 1, "requests": 2, "context_tokens": 23, "new_tokens": 14, "generated_tokens": 9},
        {"turn": 2, "requests": 1, "context_tokens": 19, "new_tokens": 2, "generated_tokens": 5}]
    assert report["context_tokens"] == 49 and report["new_tokens"] == 23
    assert report["shared_first_turn_tokens"] == 5   # [1, 2] shared, then [3, 4] and [9]
    assert report["later_turns"] == 3
    assert report["later_context_tokens_per_turn"] == pytest.approx(42 / 3)
    assert report["later_new_tokens_per_turn"] == pytest.approx(16 / 3)
    assert report["engine_prefill_tokens"] == 40
    assert report["engine_prefill_per_later_turn"] == {"low": pytest.approx(33 / 3), "high": pytest.approx(35 / 3)}
    assert prefill_accounting([a], engine_prefill=None)["engine_prefill_per_later_turn"] is None
    single = prefill_accounting([_traj([1], [(0, 3, 0)])], engine_prefill=1)
    assert single["later_turns"] == 0 and single["later_new_tokens_per_turn"] is None
    assert single["engine_prefill_per_later_turn"] is None


@pytest.mark.slow
@pytest.mark.parametrize("cache", [True, False])
def test_bench_rollout_prefill_shows_the_prefix_cache(tmp_path, cache):
    """The plain HF engine (it has a prefix cache) on guess_number, whose user answers every turn: with the cache
    later turns prefill less than their context, without it their whole context (the bounds hold it; the engine
    prefills identical prompts of one batch once, so the first turns' samples can share their prompt even so)."""
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["bench", "rollout", "--engine", "hf", "--task", "guess_number", "--prompts", "2", "--n", "2",
                     "--repeats", "1", "--max-tokens", "8", "--json", str(out), "model.name=tiny-random",
                     "rollout.max_assistant_turns=3", "engine.dtype=float32", "engine.fast=off",
                     f"engine.enable_prefix_caching={str(cache).lower()}"]) == 0
    finally:
        torch.set_num_threads(threads)
    multi = json.loads(out.read_text())["runs"][0]["multi_turn"]
    prefill = multi["prefill"]
    assert [row["turn"] for row in prefill["per_turn"]] == [0, 1, 2] and prefill["later_turns"] == 8
    assert prefill["context_tokens"] == multi["prompt_tokens"]
    assert prefill["later_new_tokens_per_turn"] < prefill["later_context_tokens_per_turn"]
    assert prefill["engine_prefill_tokens"] == multi["engine_stats"]["prefill_tokens"]
    bounds = prefill["engine_prefill_per_later_turn"]
    assert bounds["low"] <= bounds["high"]
    assert prefill["engine_prefill_tokens"] <= prefill["context_tokens"]
    if cache:
        assert bounds["high"] < prefill["later_context_tokens_per_turn"]
    else:
        assert bounds["low"] <= prefill["later_context_tokens_per_turn"] <= bounds["high"]
