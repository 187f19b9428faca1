"""The policy update on real ledgers: only policy tokens get gradient; advantages per estimator."""

import pytest
import torch

from turnrl.algo.losses import ppo_policy_loss
from turnrl.chat.parity import SYNTHETIC, replay_conversation
from turnrl.ledger import Source
from turnrl.train.batching import to_rows
from turnrl.models import prepare
from turnrl.train.policy import forward_logprobs, load_policy
from turnrl.train.update import UpdateSettings, compute_advantages


@pytest.fixture(scope="module")
def tiny_policy():
    torch.manual_seed(0)
    return load_policy(str(prepare("tiny-random")), torch.device("cpu"))


@pytest.fixture(scope="module")
def tool_batch(smol_template):
    msgs, tools = SYNTHETIC["parallel_calls"]
    report, traj = replay_conversation(smol_template, msgs, tools)
    assert report.result == "exact"
    user = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]
    _, traj2 = replay_conversation(smol_template, user, [])
    traj.reward, traj2.reward = 1.0, 0.0
    traj2.group_id = traj.group_id
    return [traj, traj2]


def test_tool_and_user_tokens_get_zero_gradient(tiny_policy, tool_batch):
    batch = to_rows(tool_batch)
    seg0 = tool_batch[0].segment
    assert {Source.TOOL, Source.POLICY, Source.TEMPLATE} <= set(seg0.sources)
    captured = {}

    def keep(module, args, output):
        output.logits.retain_grad()
        captured["logits"] = output.logits
    handle = tiny_policy.register_forward_hook(keep)
    try:
        lp, _ = forward_logprobs(tiny_policy, batch.input_ids, batch.attention_mask, batch.position_ids)
    finally:
        handle.remove()
    advantages = torch.where(batch.loss_mask > 0, torch.tensor(1.0), torch.tensor(0.0))
    out = ppo_policy_loss(lp, lp.detach(), advantages, batch.loss_mask)
    tiny_policy.zero_grad()
    out.loss.backward()
    grad = captured["logits"].grad  # [B, T, V]: position i-1 predicts token i
    for row, traj in enumerate(tool_batch):
        seg = traj.segment
        for i in range(1, len(seg)):
            g = grad[row, i - 1].abs().sum().item()
            if seg.sources[i] == Source.POLICY:
                assert g > 0, f"policy token {i} got no gradient"
            else:
                assert g == 0, f"{Source(seg.sources[i]).name} token {i} got gradient {g}"
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny_policy.parameters())


def test_grpo_advantages_follow_trajectories(tool_batch):
    batch = to_rows(tool_batch)
    valid = torch.tensor([True, True])
    adv = compute_advantages(UpdateSettings(advantage="grpo"), batch, valid,
                             torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    # group {1, 0}: mean 0.5, unbiased std 0.7071 -> +-0.7071 on the policy tokens only
    assert torch.allclose(adv[0][batch.loss_mask[0] > 0], torch.tensor(0.70710), atol=1e-4)
    assert torch.allclose(adv[1][batch.loss_mask[1] > 0], torch.tensor(-0.70710), atol=1e-4)
    assert (adv[batch.loss_mask == 0] == 0).all()


def test_masked_trajectory_is_left_out_of_the_group(tool_batch):
    batch = to_rows(tool_batch)
    valid = torch.tensor([True, False])
    adv = compute_advantages(UpdateSettings(advantage="grpo"), batch, valid,
                             torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert (adv == 0).all()  # the valid trajectory is alone in its group: no relative signal


def test_each_update_setting_has_one_default():
    """UpdateSettings, the config and the loss function agree on every default (clip_high had 0.2 and 0.28)."""
    import inspect

    from turnrl.config.schema import AlgoConfig
    algo, settings = AlgoConfig(), UpdateSettings()
    for name in ("advantage", "gamma", "lam", "turn_level", "clip_low", "clip_high", "dual_clip", "loss_agg",
                 "kl_coef", "kl_type", "kl_in_reward", "entropy_coef", "tis_cap", "value_clip", "value_coef"):
        assert getattr(settings, name) == getattr(algo, name), name
    loss = inspect.signature(ppo_policy_loss).parameters
    assert (loss["clip_low"].default, loss["clip_high"].default) == (algo.clip_low, algo.clip_high)
