"""The ledger's invariants run on every finished trajectory (issue 16, item 4): a broken one becomes an
`internal` error on that trajectory (masked out of the loss), and the rest of the batch goes on."""

import asyncio

from turnrl.data import Task
from turnrl.ledger import LedgerError, Trajectory
from turnrl.rollout.scheduler import run_batch


def test_every_finished_trajectory_is_checked_and_a_broken_one_is_an_internal_error(scripted, make_loop,
                                                                                        monkeypatch):
    checked = []
    real_check = Trajectory.check

    def check(self):
        real_check(self)   # the real invariants hold on what the loop built
        checked.append(self.sample_index)
        if self.sample_index == 1:
            raise LedgerError("segment 0 token 3: loss mask on a non-policy token")
    monkeypatch.setattr(Trajectory, "check", check)
    engine = scripted({"hello": ["Hi there."]})
    task = Task(uid="hello", messages=[{"role": "user", "content": "[case:hello] go"}])
    trajs = asyncio.run(run_batch(make_loop(engine), [task], n=3, concurrency=3))
    assert sorted(checked) == [0, 1, 2]
    good, bad = [t for t in trajs if t.sample_index != 1], next(t for t in trajs if t.sample_index == 1)
    assert all(not t.masked and not t.errors for t in good)
    assert bad.masked and [e.kind for e in bad.errors] == ["internal"]
    assert "loss mask on a non-policy token" in bad.errors[0].message
