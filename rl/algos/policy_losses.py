"""Policy-gradient losses on the sampled tokens (never over the whole vocabulary), and the value loss.

Registered under "policy_loss", one signature:
    fn(logp, old_logp, advantages, mask, *, normalization="token_mean", num_items=None, max_length=None,
       **hyper) -> (loss, metrics)
logp / old_logp / mask: (B, N) per-token log-probs of the current policy and of the sampler, mask 1
on counted tokens (N = scored positions, T-1 for a full sequence). advantages: (B, N) per token or (B,)
per sequence, broadcast over its tokens. The reduction over tokens is `rl.algos.reduce.aggregate`.
Metrics are detached scalars with TRL's names (`loss/policy`, `policy/clipfrac`, `policy/approx_kl`,
`policy/ratio_mean`). Objectives follow Tinker's built-in losses (tinker-docs:
losses/{importance_sampling,ppo,cispo,dro}), GSPO follows its paper; Tinker sums over tokens, here the sum is one option.
"""

from __future__ import annotations

import torch

from rl.algos.kl import k2_kl, k3_kl
from rl.algos.reduce import aggregate, masked_mean
from rl.algos.registry import get, register

KIND = "policy_loss"
LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "constant")  # GRPO's `loss_aggregation` choices


def per_token(x: torch.Tensor | float | None, like: torch.Tensor, name: str) -> torch.Tensor | None:
    """Broadcast a scalar or (B,) per-sequence tensor to `like` (B, N); check (B, N) shapes."""
    if x is None:
        return None
    x = torch.as_tensor(x, device=like.device, dtype=torch.float32)
    if x.dim() == 0:
        return x.expand_as(like)
    if x.dim() == 1:
        if x.shape[0] != like.shape[0]:
            raise ValueError(f"{name} has {x.shape[0]} entries but the batch has {like.shape[0]} sequences")
        return x[:, None].expand_as(like)
    if x.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(like.shape)} (per token, aligned "
                         f"with labels[:, 1:]) or ({like.shape[0]},) per sequence")
    return x


def ratio_metrics(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """policy/approx_kl (k2 of the ratio, TRL PPO's approxkl), policy/ratio_mean, policy/ratio_max."""
    logp, old_logp = logp.detach(), old_logp.detach()
    ratio = torch.exp(logp - old_logp)
    return {"policy/approx_kl": masked_mean(k2_kl(logp, old_logp), mask),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/ratio_max": torch.where(mask > 0, ratio, torch.zeros_like(ratio)).max()}


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # GRPO's `importance_sampling_level` (TRL's name)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio (Zheng et al. 2025, eq. 7), (B, N) -> (B, 1):
        log s_i = 1/|y_i| sum_t (logp_t - old_logp_t)  over the sequence's counted tokens.
    Its gradient is the token mean of grad logp_t, so every token of a sequence shares one weight s_i."""
    mask = mask.to(logp.dtype)
    return (((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]


@register("grpo_policy_loss", "clip")
def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                      clip_high: float, level: str = "token", mask: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7; asymmetric clip, DAPO):
        loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),  r_t = exp(logp - old_logp).
    With level "sequence" r_t is GSPO's s_i for every token of sequence i (`sequence_log_ratio`, needs
    `mask`): the clip then keeps or drops whole sequences. logp, old_logp, adv: (B, N). Returns (loss_t
    (B, N), ratio (B, N) or (B, 1) per sequence, taken_clipped (B, N) bool: the clipped term is the
    minimum, so no gradient flows there)."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be token or sequence, got {level!r}")
    ratio = torch.exp(logp - old_logp if level == "token" else sequence_log_ratio(logp, old_logp, mask))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    return -torch.min(unclipped, clipped), ratio, (clipped < unclipped).detach()


@register("grpo_policy_loss", "cispo")
def cispo_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                    clip_high: float, level: str = "token", mask: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO's per-token term (MiniMax-M1, Chen et al. 2025): loss_t = -sg(clip(r_t, 1-clip_low, 1+clip_high))
    * A_t * logp_t; every token keeps its gradient, only the importance weight is clipped. Same signature
    and returns as `clipped_surrogate` (taken_clipped: where the weight was clipped)."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be token or sequence, got {level!r}")
    ratio = torch.exp(logp - old_logp if level == "token" else sequence_log_ratio(logp, old_logp, mask))
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    return -weight * adv * logp, ratio, ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).expand_as(logp)


@register(KIND, "importance_sampling")
def importance_sampling_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
                             normalization: str = "token_mean", *, num_items=None, max_length=None,
                             ) -> tuple[torch.Tensor, dict]:
    """REINFORCE with an importance weight (Tinker `importance_sampling`): loss_t = -(p/q * A_t).

    The gradient is -A * p/q * grad log p, the unbiased off-policy policy gradient. Shapes: module doc."""
    adv = per_token(advantages, logp, "advantages")
    ratio = torch.exp(logp - old_logp)
    loss = aggregate(-ratio * adv, mask, normalization, num_items=num_items, max_length=max_length)
    return loss, {"loss/policy": loss.detach(), **ratio_metrics(logp, old_logp, mask)}


@register(KIND, "ppo")
def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, normalization: str = "token_mean", *,
                    num_items=None, max_length=None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (`clipped_surrogate`: Schulman et al. 2017, eq. 7; DAPO's clip_low/clip_high).

    `policy/clipfrac` is the fraction of tokens where the clipped term is the one taken. Shapes: module doc."""
    adv = per_token(advantages, logp, "advantages")
    per_tok, _, taken = clipped_surrogate(logp, old_logp, adv, clip_low, clip_high)
    loss = aggregate(per_tok, mask, normalization, num_items=num_items, max_length=max_length)
    return loss, {"loss/policy": loss.detach(), "policy/clipfrac": masked_mean(taken.float(), mask),
                  **ratio_metrics(logp, old_logp, mask)}


@register(KIND, "cispo")
def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
               clip_low: float = 0.2, clip_high: float = 0.2, normalization: str = "token_mean", *,
               num_items=None, max_length=None) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1, Chen et al. 2025; Tinker `cispo`): loss_t = -sg(clip(r_t, 1-clip_low, 1+clip_high)) * logp_t * A_t.

    Unlike PPO every token keeps a gradient; only its importance weight is clipped. Shapes: module doc."""
    adv = per_token(advantages, logp, "advantages")
    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    loss = aggregate(-weight * logp * adv, mask, normalization, num_items=num_items, max_length=max_length)
    clipfrac = masked_mean(((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float(), mask)
    return loss, {"loss/policy": loss.detach(), "policy/clipfrac": clipfrac.detach(),
                  **ratio_metrics(logp, old_logp, mask)}


@register(KIND, "dro")
def dro_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
             beta: float = 0.05, normalization: str = "token_mean", *, num_items=None, max_length=None,
             ) -> tuple[torch.Tensor, dict]:
    """DRO (Richemond et al. 2024; Kimi k1.5; Tinker `dro`): loss_t = -(logp_t A_t - beta/2 (logp_t - old_logp_t)^2).

    The quadratic term keeps the policy near the sampler; the (soft) advantage is the caller's."""
    adv = per_token(advantages, logp, "advantages")
    loss = aggregate(-(logp * adv - 0.5 * beta * (logp - old_logp) ** 2), mask, normalization,
                     num_items=num_items, max_length=max_length)
    return loss, {"loss/policy": loss.detach(), **ratio_metrics(logp, old_logp, mask)}


@register(KIND, "gspo")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
              clip_low: float = 3e-4, clip_high: float = 4e-4, normalization: str = "sequence_mean", *,
              num_items=None, max_length=None) -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7), one ratio per sequence:
        loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i),
        s_i = exp(1/|y_i| sum_t (logp_t - old_logp_t)),
    broadcast over the sequence's tokens; the default sequence_mean is the paper's 1/G sum_i. The
    defaults are the paper's clip range (3e-4, 4e-4): a length-normalised ratio moves far less than a
    token's. TRL 1.16: importance_sampling_level="sequence" (tests/unit/trainers/test_grpo.py checks it).
    `policy/clipfrac` is the fraction of sequences whose clipped term is taken. Shapes: module doc."""
    adv = per_token(advantages, logp, "advantages")
    per_tok, ratio, taken = clipped_surrogate(logp, old_logp, adv, clip_low, clip_high, "sequence", mask)
    loss = aggregate(per_tok, mask, normalization, num_items=num_items, max_length=max_length)
    has = (mask.sum(-1, keepdim=True) > 0).float()  # sequences with a counted token
    return loss, {"loss/policy": loss.detach(), "policy/clipfrac": masked_mean(taken.float().amax(-1, keepdim=True), has),
                  "policy/seq_ratio_mean": masked_mean(ratio.detach(), has), **ratio_metrics(logp, old_logp, mask)}


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              ref_logp: torch.Tensor | None = None, beta: float = 0.0, epsilon_low: float = 0.2,
              epsilon_high: float = 0.2, loss_aggregation: str = "token_mean",
              max_completion_length: int | None = None, num_items: float | None = None,
              use_bias_correction_kl: bool = True, importance_sampling_level: str = "token",
              policy_loss: str = "clip", token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """GRPO's objective (Shao et al. 2024, eq. 3; the per-token form TRL 1.16 implements):

        L = agg_t [ surrogate_t + beta * r_t * k3_t ]

    `policy_loss` names the per-token policy-gradient term in the "grpo_policy_loss" registry (as verl's
    `loss_mode`): "clip" (PPO's clipped surrogate, `clipped_surrogate`; GRPO, DAPO, GSPO), "cispo"
    (`cispo_surrogate`), or a user's `module:function` with `clipped_surrogate`'s signature.
    With importance_sampling_level "sequence" r_t is GSPO's per-sequence s_i (`gspo_loss`), in the
    surrogate and in the KL factor, as TRL 1.16 does; the clip_ratio metrics then count sequences.

    Args:
        logp, old_logp, mask: (B, N) per-token log-probs of the current / sampling policy, mask 1 on
            completion tokens. ref_logp: (B, N) or None (beta must then be 0).
        advantages: (B,) per sequence or (B, N) per token.
        loss_aggregation: token_mean | sequence_mean | constant (`rl.algos.reduce.aggregate`).
        max_completion_length: the constant's divisor (required for "constant").
        use_bias_correction_kl: multiply k3 by the (differentiable) ratio r_t, as TRL 1.16 does by default:
            the KL gradient is then the unbiased reverse-KL gradient even off-policy (DeepSeek-V3.2).
        num_items: token_mean's divisor (default: this micro-batch's token count); the trainer passes
            the step's token count / (processes * micro-batches) so the accumulated gradient is the
            exact token mean of the whole step.
        token_weights: (B, N) detached weights of the policy-gradient term (the rollout/trainer mismatch
            correction, `rl.algos.mismatch.importance_weights`), applied before the KL term as TRL does.
    Returns: (loss, metrics) with TRL's names: kl, clip_ratio/{low,high,region}_mean.
    """
    mask = mask.to(logp.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    surrogate = get("grpo_policy_loss", policy_loss)
    per_tok, ratio, _ = surrogate(logp, old_logp, adv, epsilon_low, epsilon_high, importance_sampling_level, mask)
    if token_weights is not None:
        per_tok = per_tok * token_weights
    metrics: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp (the reference model's per-token log-probs)")
        kl = k3_kl(logp, ref_logp)
        if use_bias_correction_kl:
            kl = kl * ratio
        per_tok = per_tok + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if loss_aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}, got {loss_aggregation!r}")
    loss = aggregate(per_tok, mask, loss_aggregation, num_items=num_items, max_length=max_completion_length)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(logp.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(logp.dtype)
        # per token, or per sequence (counted once each, TRL's sequence-level mean) with a sequence ratio
        count = mask if ratio.shape[-1] == mask.shape[-1] else (mask.sum(-1, keepdim=True) > 0).to(logp.dtype)
        metrics["clip_ratio/low_mean"] = masked_mean(low, count)
        metrics["clip_ratio/high_mean"] = masked_mean(high, count)
        metrics["clip_ratio/region_mean"] = masked_mean(torch.maximum(low, high), count)
    return loss, metrics


def ppo_value_loss(values: torch.Tensor, old_values: torch.Tensor | None, returns: torch.Tensor,
                   mask: torch.Tensor, clip_range_value: float | None = 0.2, normalization: str = "token_mean",
                   ) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (the PPO2 baselines / TRL form): 0.5 * max((V - R)^2, (V_clip - R)^2).

    V_clip = clip(V, old_V - c, old_V + c), the same as old_V + clip(V - old_V, -c, c) in exact
    arithmetic; written this way V_clip is V itself wherever V is inside the range, so
    `value/clipfrac` (the fraction of tokens where the clipped error is the larger) counts only truly
    clipped tokens (the other form rounds to a different float on ~2% of unclipped fp32 tokens).
    values, old_values, returns, mask: (B, N) (or (B,) broadcast). With old_values None or
    clip_range_value None it is the plain 0.5 * (V - R)^2."""
    values = values.float()
    returns = per_token(returns, values, "returns")
    err = (values - returns) ** 2
    if old_values is not None and clip_range_value is not None:
        old_values = per_token(old_values, values, "old values")
        v_clip = torch.clamp(values, old_values - clip_range_value, old_values + clip_range_value)
        err_clip = (v_clip - returns) ** 2
        per_tok = 0.5 * torch.max(err, err_clip)
        vclipfrac = masked_mean((err_clip > err).float(), mask).detach()
    else:
        per_tok = 0.5 * err
        vclipfrac = values.new_zeros(())
    loss = aggregate(per_tok, mask, normalization)
    return loss, {"loss/value": loss.detach(), "value/clipfrac": vclipfrac,
                  "value/mean": masked_mean(values.detach(), mask)}
