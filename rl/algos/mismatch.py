"""Rollout/trainer mismatch: the engine that sampled (vLLM) and the trainer compute log-probs with other
kernels (and dtypes), so its behaviour policy pi_vllm is not exactly the trainer's pi_old. Truncated
importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; TRL's `vllm_importance_sampling_correction`, verl's `rollout_is`) reweights each token's loss by

    w_t = pi_old(o_t) / pi_vllm(o_t) = exp(old_t - behaviour_t)

    token_truncate     min(w_t, cap)                        (TRL's default)
    token_mask         w_t where w_t <= cap, else 0
    sequence_truncate  min(prod_t w_t, cap) for every token of the sequence
    sequence_mask      prod_t w_t where it is <= cap, else 0

The weights carry no gradient. Metrics (TRL's names): sampling/sampling_logp_difference/{mean,max} is
|old_t - behaviour_t| over completion tokens, sampling/importance_sampling_ratio/{min,mean,max} the applied
weights, .../clipped_frac the fraction of tokens (sequence modes: sequences) whose raw ratio passed the cap.
"""

from __future__ import annotations

import torch

from rl.algos.reduce import masked_mean

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float,
                       mode: str = "token_truncate") -> tuple[torch.Tensor, dict]:
    """(B, N) weights and the mismatch metrics; old_logp, behaviour_logp, mask (B, N), mask 1 on completion
    tokens (weights are 0 elsewhere)."""
    if mode not in IS_MODES:
        raise ValueError(f"importance sampling mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    mask = mask.to(old_logp.dtype)
    diff = (old_logp.detach() - behaviour_logp.detach()) * mask
    if mode.startswith("sequence"):
        raw = torch.exp(diff.sum(-1, keepdim=True)).expand_as(diff)
        counted = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)  # one vote per sequence
    else:
        raw = torch.exp(diff)
        counted = mask
    over = raw > cap
    w = raw.clamp(max=cap) if mode.endswith("truncate") else raw.masked_fill(over, 0.0)
    w = w * mask
    real = mask.bool()
    any_tok = bool(real.any())
    metrics = {
        "sampling/sampling_logp_difference/mean": masked_mean(diff.abs(), mask),
        "sampling/sampling_logp_difference/max": diff.abs().max() if any_tok else diff.new_zeros(()),
        "sampling/importance_sampling_ratio/min": w[real].min() if any_tok else w.new_ones(()),
        "sampling/importance_sampling_ratio/mean": masked_mean(w, mask),
        "sampling/importance_sampling_ratio/max": w[real].max() if any_tok else w.new_ones(()),
        "sampling/importance_sampling_ratio/clipped_frac":
            (over.to(mask.dtype) * counted)[:, :1].sum() / counted[:, :1].sum().clamp(min=1)
            if mode.startswith("sequence") else masked_mean(over.to(mask.dtype), mask),
    }
    return w, metrics
