"""Shared-prefix training: each group's prompt runs once, and logprobs, entropy and gradients equal the plain
forward over whole rows."""

import pytest
import torch

from turnrl.models import prepare
from turnrl.train.policy import forward_logprobs, load_policy
from turnrl.train import shared_prefix as sp
from turnrl.train.shared_prefix import prefix_groups, shared_hidden, shared_micro_batches, suffix_lanes


def rows(prompts=((40, 3), (50, 3), (45, 1)), seed=0):
    """Right-padded rows: for each (prompt length, samples) the samples share the prompt, then differ; the
    loss covers each row's own tokens after the prompt (with a tool-like masked stretch in the middle)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for plen, n in prompts:
        prompt = torch.randint(5, 300, (plen,), generator=gen)
        for _ in range(n):
            own = torch.randint(5, 300, (int(torch.randint(6, 30, (1,), generator=gen)),), generator=gen)
            out.append((torch.cat([prompt, own]), plen))
    width = max(len(ids) for ids, _ in out)
    b = len(out)
    input_ids = torch.zeros(b, width, dtype=torch.long)
    attention = torch.zeros(b, width, dtype=torch.long)
    loss = torch.zeros(b, width, dtype=torch.long)
    for r, (ids, plen) in enumerate(out):
        input_ids[r, :len(ids)] = ids
        attention[r, :len(ids)] = 1
        loss[r, plen:len(ids)] = 1
        loss[r, plen + 2:plen + 4] = 0
    positions = (attention.cumsum(1) - 1).clamp(min=0) * attention
    return input_ids, attention, positions, loss


def test_groups_are_rows_with_the_same_prefix_before_their_first_policy_token():
    ids, attn, pos, loss = rows()
    group, prefix = prefix_groups(ids, attn, pos, loss)
    assert group.tolist() == [0, 0, 0, 1, 1, 1, -1]
    assert prefix.tolist() == [39] * 3 + [49] * 3 + [0]
    group, prefix = prefix_groups(ids, attn, pos, loss, min_prefix=45)     # short shared prompts run whole
    assert group.tolist() == [-1] * 3 + [0] * 3 + [-1] and prefix.tolist() == [0] * 3 + [49] * 3 + [0]
    shifted = pos.clone()
    shifted[3] += 1                                                         # not plain positions: runs whole
    group, _ = prefix_groups(ids, attn, shifted, loss)
    assert group.tolist() == [0, 0, 0, -1, 1, 1, -1]


def test_micro_batches_keep_groups_together_and_count_each_prefix_once():
    ids, attn, pos, loss = rows()
    group, prefix = prefix_groups(ids, attn, pos, loss)
    lengths = attn.sum(1)
    batches = shared_micro_batches(torch.arange(7), lengths, group, prefix, token_budget=200)
    assert sorted(r for rows_, _ in batches for r in rows_.tolist()) == list(range(7))
    for rows_, width in batches:
        assert width == int(lengths[rows_].max())
        groups = {int(group[r]) for r in rows_ if group[r] >= 0}
        for g in groups:                                                    # whole groups only
            assert set((group == g).nonzero().squeeze(1).tolist()) <= set(rows_.tolist())
    # a budget smaller than a group splits it; every part still fits
    small = shared_micro_batches(torch.arange(7), lengths, group, prefix, token_budget=90)
    assert sorted(r for rows_, _ in small for r in rows_.tolist()) == list(range(7)) and len(small) > len(batches)


def test_suffix_lanes_are_the_cheapest_split_of_the_sorted_lengths():
    assert suffix_lanes([5, 100, 6, 98], lane_cost=10) == [[0, 2], [3, 1]]   # 2*6 + 2*100 + 20 = 232 < 410
    assert suffix_lanes([5, 100, 6, 98], lane_cost=1000) == [[0, 2, 3, 1]]
    assert suffix_lanes([5, 100, 6, 98], lane_cost=0) == [[0], [2], [3], [1]]
    assert suffix_lanes([7, 7, 7], lane_cost=0) == [[0, 1, 2]]                 # equal lengths: one lane
    assert suffix_lanes([], lane_cost=64) == []


def test_micro_batches_count_suffixes_padded_within_lanes():
    lengths = torch.tensor([50, 50, 300, 300, 60, 60])   # one group of 4 sharing 40 tokens, two plain rows
    group, prefix = torch.tensor([0, 0, 0, 0, -1, -1]), torch.tensor([40, 40, 40, 40, 0, 0])
    # suffixes 10, 10, 260, 260, 60, 60 in three lanes: 20 + 120 + 520 padded tokens, plus the prefix's 40
    # (one lane would be 6 * 260 + 40)
    (rows_, _), = shared_micro_batches(torch.arange(6), lengths, group, prefix, token_budget=700, lane_cost=8)
    assert sorted(rows_.tolist()) == list(range(6))
    assert len(shared_micro_batches(torch.arange(6), lengths, group, prefix, token_budget=699, lane_cost=8)) > 1


@pytest.mark.parametrize("lora,temperature,fused,lanes", [(0, 1.0, False, "few"), (8, 0.7, False, "one per length"),
                                                          (0, 0.7, True, "one per length"), (8, 1.0, True, "few")])
def test_logprobs_entropy_and_gradients_equal_the_plain_forward(lora, temperature, fused, lanes, monkeypatch):
    import turnrl.train.policy as policy
    if lanes == "one per length":
        monkeypatch.setitem(sp.LANE_COST, "cpu", 0)
    calls = []
    monkeypatch.setattr(policy, "shared_hidden", lambda *a: calls.append(1) or shared_hidden(*a))
    torch.manual_seed(0)
    model = load_policy(str(prepare("tiny-random")), torch.device("cpu"), lora_rank=lora)
    if lora:   # peft starts B at zero: make the adapter matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
    ids, attn, pos, loss = rows()
    shared = prefix_groups(ids, attn, pos, loss)
    select = loss > 0
    results = {}
    for mode in ("plain", "shared"):
        model.zero_grad()
        lp, ent = forward_logprobs(model, ids, attn, pos, temperature, None, with_entropy=True, select=select,
                                   shared=shared if mode == "shared" else None, fused_head=fused)
        ((lp * loss).sum() + 0.1 * (ent * loss).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[mode] = (lp * loss, ent * loss, grads)
    assert calls == [1]                                   # the shared path ran (once, for the shared mode)
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results["plain"], results["shared"]
    assert (lp_a - lp_b).abs().max() < 1e-4 and (ent_a - ent_b).abs().max() < 1e-4
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=1e-5, rtol=1e-3), name


def test_a_whole_update_is_the_same_with_and_without_sharing():
    from turnrl.train.batching import Rows
    from turnrl.train.update import UpdateSettings, policy_update

    ids, attn, pos, loss = rows(((40, 4), (36, 4)), seed=3)
    results = []
    for sharing in (False, True):
        torch.manual_seed(0)
        model = load_policy(str(prepare("tiny-random")), torch.device("cpu"))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        zeros = torch.zeros(ids.shape)
        advantages = torch.linspace(-1, 1, ids.shape[0])[:, None] * loss
        batch = Rows(ids, attn, pos, loss, zeros.clone(), zeros.clone(), advantages)
        settings = UpdateSettings(micro_batch_tokens=160, shared_prefix=sharing)
        metrics = policy_update(model, optimizer, scheduler, batch, settings, None, torch.Generator().manual_seed(0),
                                params)
        results.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}, batch.old_logprobs))
    (m_a, w_a, old_a), (m_b, w_b, old_b) = results
    assert m_a["grad_norm"] == pytest.approx(m_b["grad_norm"], rel=1e-4)
    assert ((old_a - old_b) * loss).abs().max() < 1e-4
    worst = max(float((w_a[n] - w_b[n]).abs().max()) for n in w_a)
    assert worst < 2e-5, worst          # Adam steps are ~1e-3 (lr): tiny gradient noise stays far below
