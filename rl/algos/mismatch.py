"""Rollout/trainer mismatch: the engine that sampled (vLLM) and the trainer compute log-probs with other
kernels (and dtypes), so its behaviour policy pi_vllm is not exactly the trainer's pi_old. Truncated
importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; TRL's `vllm_importance_sampling_correction`, verl's `rollout_is`) reweights each token's loss by

    w_t = pi_old(o_t) / pi_vllm(o_t) = exp(old_t - behaviour_t)

    token_truncate     clamp(w_t, clip_min, cap)
    token_mask         w_t where clip_min <= w_t <= cap, else 0
    sequence_truncate  clamp(prod_t w_t, clip_min, cap) for every token of the sequence
    sequence_mask      prod_t w_t where clip_min <= it <= cap, else 0   (TRL 1.16's default mode)

`cap` is TRL's `vllm_importance_sampling_clip_max` (3.0), `clip_min` its `vllm_importance_sampling_clip_min`
(None: no lower bound; a mask mode with clip_min set is IcePop's two-sided mask). The weights carry no
gradient. Metrics (TRL's names): sampling/sampling_logp_difference/{mean,max} is |old_t - behaviour_t| over
completion tokens, sampling/importance_sampling_ratio/{min,mean,max} the applied weights (per token; sequence
modes: per sequence, as TRL), .../clipped_frac the fraction of tokens (sequence modes: sequences) whose raw
ratio fell outside [clip_min, cap].
"""

from __future__ import annotations

import math

import torch

from rl.algos.reduce import masked_mean

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float,
                       mode: str = "sequence_mask", clip_min: float | None = None) -> tuple[torch.Tensor, dict]:
    """(B, N) weights and the mismatch metrics; old_logp, behaviour_logp, mask (B, N), mask 1 on completion
    tokens (weights are 0 elsewhere)."""
    if mode not in IS_MODES:
        raise ValueError(f"importance sampling mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    mask = mask.to(old_logp.dtype)
    diff = (old_logp.detach() - behaviour_logp.detach()) * mask
    sequence = mode.startswith("sequence")
    raw = torch.exp(diff.sum(-1, keepdim=True)).expand_as(diff) if sequence else torch.exp(diff)
    low = -math.inf if clip_min is None else clip_min
    outside = (raw > cap) | (raw < low)
    unmasked = raw.clamp(min=clip_min, max=cap) if mode.endswith("truncate") else raw.masked_fill(outside, 0.0)
    w = unmasked * mask
    if sequence:  # one vote per sequence that has tokens (every column holds the sequence's ratio)
        rows = mask.sum(-1) > 0
        applied, clipped = unmasked[:, 0][rows], outside[:, 0][rows]
    else:
        real = mask.bool()
        applied, clipped = w[real], outside[real]
    any_tok = applied.numel() > 0
    metrics = {
        "sampling/sampling_logp_difference/mean": masked_mean(diff.abs(), mask),
        "sampling/sampling_logp_difference/max": diff.abs().max() if any_tok else diff.new_zeros(()),
        "sampling/importance_sampling_ratio/min": applied.min() if any_tok else w.new_ones(()),
        "sampling/importance_sampling_ratio/mean": applied.mean() if any_tok else w.new_ones(()),
        "sampling/importance_sampling_ratio/max": applied.max() if any_tok else w.new_ones(()),
        "sampling/importance_sampling_ratio/clipped_frac":
            clipped.to(mask.dtype).mean() if any_tok else w.new_zeros(()),
    }
    return w, metrics


def rollout_correction(cfg, old_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, float]]:
    """A trainer's view of the above for one rollout: with use_vllm, (the weights of its policy-gradient term, or
    None when `vllm_importance_sampling_correction` is off; the metrics as floats); else (None, {}). Reads the keys
    vllm_importance_sampling_{correction, mode, cap, clip_min} of `cfg` (clip_min: None where the config has none)."""
    if not getattr(cfg, "use_vllm", False):
        return None, {}
    w, metrics = importance_weights(old_logp, behaviour_logp, mask, cfg.vllm_importance_sampling_cap,
                                    cfg.vllm_importance_sampling_mode,
                                    getattr(cfg, "vllm_importance_sampling_clip_min", None))
    return (w if cfg.vllm_importance_sampling_correction else None), {k: float(v) for k, v in metrics.items()}
