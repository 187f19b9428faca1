"""How far the trainer's logprobs are from the engine's on the tokens the engine sampled.

The engine (vLLM, the embedded engines) and the trainer compute the same policy with different kernels and
precisions, so their logprobs of a sampled token differ a little; a large gap means the update is off-policy
(a weight-sync or template bug, or numerics). With p the engine's distribution (the tokens were sampled from
it), q the trainer's and d = log q(x) - log p(x) per sampled token x:
- `mismatch/mean_abs`, `mismatch/max_abs`: mean and max of |d| over the policy tokens;
- `mismatch/kl`: Schulman's k3 estimator of KL(p || q) = E_p[log p - log q], the mean of
  exp(d) - d - 1 (unbiased, always >= 0, low variance since E_p[exp(d)] = 1). Reference: J. Schulman,
  "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

import torch

from turnrl.algo.masked import as_bool_mask


def mismatch_metrics(trainer_logprobs: torch.Tensor,  # [B, T] the trainer's logprobs of the sampled tokens
                     engine_logprobs: torch.Tensor,   # [B, T] the engine's logprobs of the same tokens
                     mask: torch.Tensor,              # [B, T] 1 on the policy tokens to compare
                     ) -> dict[str, float]:
    """The mismatch metrics over the masked tokens; {} when there are none."""
    m = as_bool_mask(mask, trainer_logprobs, "trainer_logprobs")
    if not m.any():
        return {}
    d = (trainer_logprobs.float() - engine_logprobs.float())[m]
    return {"mismatch/mean_abs": float(d.abs().mean()), "mismatch/max_abs": float(d.abs().max()),
            "mismatch/kl": float((torch.exp(d) - d - 1).mean())}
