"""mismatch/kl estimates KL(engine || trainer) on tokens the engine sampled (issue 16, item 3)."""

import torch

from turnrl.algo.mismatch import mismatch_metrics


def test_kl_matches_the_exact_kl_of_a_categorical():
    torch.manual_seed(0)
    p = torch.tensor([0.70, 0.20, 0.05, 0.05])   # the engine: tokens are sampled from it
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])   # the trainer
    exact_pq = float((p * (p / q).log()).sum())  # KL(engine || trainer) = 0.4832...
    exact_qp = float((q * (q / p).log()).sum())  # the other direction  = 0.7057...
    tokens = torch.multinomial(p, 400_000, replacement=True).reshape(200, 2000)
    out = mismatch_metrics(q.log()[tokens], p.log()[tokens], torch.ones(200, 2000))
    assert abs(out["mismatch/kl"] - exact_pq) < 0.01, (out["mismatch/kl"], exact_pq, exact_qp)
    d = q.log()[tokens] - p.log()[tokens]
    assert out["mismatch/mean_abs"] == float(d.abs().mean())
    assert out["mismatch/max_abs"] == float(d.abs().max())


def test_only_masked_tokens_count_and_none_gives_nothing():
    trainer = torch.tensor([[-1.0, -5.0]])
    engine = torch.tensor([[-1.0, -0.1]])
    assert mismatch_metrics(trainer, engine, torch.tensor([[1.0, 0.0]]))["mismatch/kl"] == 0.0
    assert mismatch_metrics(trainer, engine, torch.zeros(1, 2)) == {}
