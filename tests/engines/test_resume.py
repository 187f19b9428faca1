"""`turnrl.engines.resume.generate`: interrupted pieces join into one completion, with the versions that
sampled each run of tokens, what is left of the token budget, and a seed per piece. The engine here is a
script of answers (the real engines' interruptions are in tests/engines/test_partial_rollout.py)."""

import asyncio

import pytest

from turnrl.engines.base import Completion, EngineBase, EngineError, Sampling
from turnrl.ledger import Turn
from turnrl.engines import resume


class Scripted(EngineBase):
    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = []

    async def generate(self, prompt_ids, sampling):
        self.calls.append((list(prompt_ids), sampling))
        return self.answers.pop(0)


def run(coro):
    return asyncio.run(coro)


def test_pieces_join_with_their_versions_budget_and_seeds():
    engine = Scripted([Completion([5, 6], [-0.1, -0.2], "interrupted", 3),
                       Completion([7], [-0.3], "interrupted", 4),
                       Completion([8, 2], [-0.4, -0.5], "stop", 5)])
    out = run(resume.generate(engine, [1, 2, 3], Sampling(max_tokens=10, seed=11, stop_token_ids=(2,))))
    c = out.completion
    assert (c.token_ids, c.logprobs, c.finish_reason, c.version) == ([5, 6, 7, 8, 2], [-0.1, -0.2, -0.3, -0.4, -0.5],
                                                                     "stop", 3)
    assert out.versions == [(0, 3), (2, 4), (3, 5)] and out.interruptions == 2
    prompts = [p for p, _ in engine.calls]
    assert prompts == [[1, 2, 3], [1, 2, 3, 5, 6], [1, 2, 3, 5, 6, 7]]      # each piece continues the last
    assert [s.max_tokens for _, s in engine.calls] == [10, 8, 7]
    seeds = [s.seed for _, s in engine.calls]
    assert seeds[0] == 11 and len(set(seeds)) == 3                          # the first piece keeps the request's seed
    assert seeds == [resume.piece_seed(11, k) for k in range(3)]


def test_an_uninterrupted_request_is_one_call_and_one_span():
    engine = Scripted([Completion([5, 2], [-0.1, -0.2], "stop", 7)])
    out = run(resume.generate(engine, [1], Sampling(max_tokens=4)))
    assert len(engine.calls) == 1 and out.versions == [(0, 7)] and out.interruptions == 0
    # an engine that does not say its version: one span of None
    engine = Scripted([Completion([5], [-0.1], "length")])
    assert run(resume.generate(engine, [1], Sampling(max_tokens=1))).versions == [(0, None)]


def test_an_interruption_that_used_the_budget_or_ended_on_a_stop_token_ends_the_request():
    engine = Scripted([Completion([5, 6], [-0.1, -0.2], "interrupted", 0)])
    assert run(resume.generate(engine, [1], Sampling(max_tokens=2))).completion.finish_reason == "length"
    engine = Scripted([Completion([5, 2], [-0.1, -0.2], "interrupted", 0)])
    out = run(resume.generate(engine, [1], Sampling(max_tokens=9, stop_token_ids=(2,))))
    assert out.completion.finish_reason == "stop" and len(engine.calls) == 1


def test_an_empty_interrupted_piece_adds_no_span_and_same_versions_merge():
    engine = Scripted([Completion([], [], "interrupted", 0), Completion([5], [-0.1], "interrupted", 1),
                       Completion([6], [-0.2], "length", 1)])
    out = run(resume.generate(engine, [1], Sampling(max_tokens=2)))
    assert out.versions == [(0, 1)] and out.completion.token_ids == [5, 6] and out.completion.version == 1


def test_an_engine_that_never_stops_interrupting_is_an_engine_error():
    class Forever(EngineBase):
        async def generate(self, prompt_ids, sampling):
            return Completion([], [], "interrupted", 0)
    with pytest.raises(EngineError, match="interrupted"):
        run(resume.generate(Forever(), [1], Sampling(max_tokens=4)))


def test_a_turn_spells_out_each_token_s_version():
    turn = Turn(index=0, segment=0, start=10, end=15, finish_reason="stop", text="", versions=[(0, 3), (2, 4)])
    assert turn.token_versions(default=0) == [3, 3, 4, 4, 4]
    assert Turn(index=0, segment=0, start=0, end=3, finish_reason="stop", text="").token_versions(9) == [9, 9, 9]
