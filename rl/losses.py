"""Pure tensor math for the trainers: token log-probs, masks and losses.

Shapes: B = batch, T = sequence length, V = vocabulary. Logits (B, T, V) predict token t+1 at
position t, so every per-token quantity below has length T-1 and is aligned with `labels[:, 1:]`.
Losses return `(scalar_loss, metrics)` where metrics are detached scalars.
"""

from __future__ import annotations

from typing import Callable

import torch

IGNORE_INDEX = -100


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each next token.

    Args:
        logits: (B, T, V) model outputs.
        labels: (B, T) token ids, IGNORE_INDEX (-100) where no loss is wanted.
        chunk_size: if set, the log-softmax is taken over that many positions at a time, so the
            fp32 copy of the logits is never materialised for the whole sequence at once.
    Returns:
        logp (B, T-1) in fp32, zero where masked, and mask (B, T-1) as float (1 = counted).
    """
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    safe = target.masked_fill(~mask, 0)
    shifted = logits[:, :-1]
    if chunk_size is None or chunk_size >= shifted.shape[1]:
        logp = _gather_logprobs(shifted, safe)
    else:
        logp = torch.cat([_gather_logprobs(shifted[:, s:s + chunk_size], safe[:, s:s + chunk_size])
                          for s in range(0, shifted.shape[1], chunk_size)], dim=1)
    return logp * mask, mask.float()


def _gather_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # log p(id) = logit[id] - logsumexp(logits): avoids a (B, T, V) log_softmax tensor.
    logits = logits.float()
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `x` over entries where mask == 1 (all of them, or along `dim`)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Token-mean negative log-likelihood of `labels` (HF convention, shifted inside).

    `weights` (B, T) or (B, T-1), optional, multiplies each token's loss (aligned to `labels`)."""
    logp, mask = token_logprobs(logits, labels)
    if weights is not None:
        w = weights[:, 1:] if weights.shape[1] == labels.shape[1] else weights
        loss = -(logp * w * mask).sum() / mask.sum().clamp(min=1)
    else:
        loss = -masked_mean(logp, mask)
    return loss, {"nll": loss.detach(), "num_tokens": mask.sum()}


# Built-in losses of the engine, by name. The RL losses register here as well.
LOSS_FNS: dict[str, Callable] = {"cross_entropy": cross_entropy_loss}


# ------------------------------------------------------------------------------------------------
# RL losses on the sampled tokens (never over the whole vocabulary).
#
# Pure functions take per-token log-probs: logp / old_logp / advantages / mask all (B, N), with N
# the number of scored positions (T-1 for a full sequence). `advantages` may also be (B,) (one per
# sequence), broadcast over the tokens. Each returns (loss, metrics); metrics are detached scalars
# named like TRL's (`loss/policy`, `policy/clipfrac`, `policy/approx_kl`, `policy/ratio_mean`).
#
# Objectives follow Tinker's built-in losses (tinker-docs: losses/{importance_sampling,ppo,cispo,dro});
# Tinker sums over tokens, here the reduction is the explicit `normalization` option:
#   "sum"        sum over masked tokens (Tinker's choice; scale grows with batch and length)
#   "token_mean" sum / number of masked tokens in the micro-batch (default; DAPO-style)
#   "seq_mean"   mean over sequences of each sequence's token mean (GRPO paper, Shao et al. 2024)
# ------------------------------------------------------------------------------------------------

NORMALIZATIONS = ("sum", "token_mean", "seq_mean")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalization: str = "token_mean") -> torch.Tensor:
    """Reduce a (B, N) per-token loss over `mask` (B, N) to a scalar; see NORMALIZATIONS.

    seq_mean ignores sequences with no counted token (their mean would be 0/0)."""
    mask = mask.to(per_token.dtype)
    if normalization == "sum":
        return (per_token * mask).sum()
    if normalization == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if normalization == "seq_mean":
        counts = mask.sum(-1)
        per_seq = (per_token * mask).sum(-1) / counts.clamp(min=1)
        has = (counts > 0).to(per_token.dtype)
        return (per_seq * has).sum() / has.sum().clamp(min=1)
    raise ValueError(f"normalization must be one of {', '.join(NORMALIZATIONS)}; got {normalization!r}")


def _per_token(x: torch.Tensor | float | None, like: torch.Tensor, name: str) -> torch.Tensor | None:
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


def _ratio_metrics(logp, old_logp, mask) -> dict:
    log_ratio = (logp - old_logp).detach()
    ratio = torch.exp(log_ratio)
    # 0.5 * E[(log r)^2]: the estimator TRL's PPO reports as approxkl (Schulman's k2).
    return {"policy/approx_kl": masked_mean(0.5 * log_ratio ** 2, mask),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/ratio_max": torch.where(mask > 0, ratio, torch.zeros_like(ratio)).max()}


def importance_sampling_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
                             normalization: str = "token_mean") -> tuple[torch.Tensor, dict]:
    """REINFORCE with an importance weight (Tinker `importance_sampling`): -(p/q * A).

    Args: logp (B, N) current policy, old_logp (B, N) of the sampler q, advantages (B, N) or (B,),
    mask (B, N). The gradient is -A * p/q * grad log p, the unbiased off-policy policy gradient."""
    adv = _per_token(advantages, logp, "advantages")
    ratio = torch.exp(logp - old_logp)
    loss = aggregate(-ratio * adv, mask, normalization)
    return loss, {"loss/policy": loss.detach(), **_ratio_metrics(logp, old_logp, mask)}


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, normalization: str = "token_mean",
                    ) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7; asymmetric clip as in DAPO, Yu et al. 2025).

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), r_t = exp(logp - old_logp).
    Shapes as `importance_sampling_loss`. `policy/clipfrac` is the fraction of tokens where the
    clipped term is the one taken (no gradient flows through them)."""
    adv = _per_token(advantages, logp, "advantages")
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = aggregate(-torch.min(unclipped, clipped), mask, normalization)
    clipfrac = masked_mean((clipped < unclipped).float(), mask)
    return loss, {"loss/policy": loss.detach(), "policy/clipfrac": clipfrac.detach(),
                  **_ratio_metrics(logp, old_logp, mask)}


def ppo_value_loss(values: torch.Tensor, old_values: torch.Tensor | None, returns: torch.Tensor,
                   mask: torch.Tensor, clip_range_value: float | None = 0.2, normalization: str = "token_mean",
                   ) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (the PPO2 baselines / TRL form): 0.5 * max((V - R)^2, (V_clip - R)^2).

    V_clip = old_V + clip(V - old_V, -c, c). values, old_values, returns, mask: (B, N) (or (B,)
    broadcast). With old_values None or clip_range_value None it is the plain 0.5 * (V - R)^2."""
    values = values.float()
    returns = _per_token(returns, values, "returns")
    err = (values - returns) ** 2
    if old_values is not None and clip_range_value is not None:
        old_values = _per_token(old_values, values, "old values")
        v_clip = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
        err_clip = (v_clip - returns) ** 2
        per_token = 0.5 * torch.max(err, err_clip)
        vclipfrac = masked_mean((err_clip > err).float(), mask).detach()
    else:
        per_token = 0.5 * err
        vclipfrac = values.new_zeros(())
    loss = aggregate(per_token, mask, normalization)
    return loss, {"loss/value": loss.detach(), "value/clipfrac": vclipfrac,
                  "value/mean": masked_mean(values.detach(), mask)}


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
               clip_low: float = 0.2, clip_high: float = 0.2, normalization: str = "token_mean",
               ) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1, Chen et al. 2025; Tinker `cispo`): -sg(clip(r, 1-clip_low, 1+clip_high)) * logp * A.

    Unlike PPO every token keeps a gradient; only its importance weight is clipped."""
    adv = _per_token(advantages, logp, "advantages")
    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    loss = aggregate(-weight * logp * adv, mask, normalization)
    clipfrac = masked_mean(((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float(), mask)
    return loss, {"loss/policy": loss.detach(), "policy/clipfrac": clipfrac.detach(),
                  **_ratio_metrics(logp, old_logp, mask)}


def dro_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor,
             beta: float = 0.05, normalization: str = "token_mean") -> tuple[torch.Tensor, dict]:
    """DRO (Richemond et al. 2024; Kimi k1.5; Tinker `dro`): -(logp * A - beta/2 * (logp - old_logp)^2).

    The quadratic term keeps the policy near the sampler; the (soft) advantage is the caller's."""
    adv = _per_token(advantages, logp, "advantages")
    loss = aggregate(-(logp * adv - 0.5 * beta * (logp - old_logp) ** 2), mask, normalization)
    return loss, {"loss/policy": loss.detach(), **_ratio_metrics(logp, old_logp, mask)}


# ---------------------------------------------------------------- engine-signature wrappers
# `(logits, labels, attention_mask, **kw) -> (loss, metrics)`, registered in LOSS_FNS. Per-token
# kwargs are (B, T-1) aligned with labels[:, 1:]; (B, T) aligned with labels is also accepted
# (the first column is dropped) and (B,) is one value per sequence.

def _align(x, labels: torch.Tensor):
    if torch.is_tensor(x) and x.dim() == 2 and x.shape[1] == labels.shape[1]:
        return x[:, 1:]
    return x


def _old(kw: dict, labels: torch.Tensor, logp: torch.Tensor, loss: str) -> torch.Tensor:
    """`old_logprobs` or the reference's `old_log_probs` (one of them, required)."""
    a, b = kw.pop("old_logprobs", None), kw.pop("old_log_probs", None)
    if a is not None and b is not None:
        raise ValueError(f"{loss}: pass old_logprobs or old_log_probs, not both")
    old = a if a is not None else b
    if old is None:
        raise ValueError(f"{loss} needs old_logprobs= (the sampler's per-token log-probs, (B, T-1))")
    return _per_token(_align(old, labels), logp, "old_logprobs").detach()


def _scored(logits, labels, kw):
    logp, mask = token_logprobs(logits, labels, chunk_size=kw.pop("chunk_size", None))
    adv = kw.pop("advantages", None)
    return logp, mask, adv


def _need_adv(adv, loss):
    if adv is None:
        raise ValueError(f"{loss} needs advantages= ((B, T-1) per token or (B,) per sequence)")


def _no_extra(kw: dict, loss: str) -> None:
    if kw:
        raise TypeError(f"{loss} got unexpected keyword arguments: {', '.join(sorted(kw))}")


def importance_sampling_loss_fn(logits, labels, attention_mask=None, **kw):
    """Engine loss "importance_sampling": kwargs advantages, old_logprobs|old_log_probs,
    normalization, chunk_size."""
    logp, mask, adv = _scored(logits, labels, kw)
    _need_adv(adv, "importance_sampling")
    old = _old(kw, labels, logp, "importance_sampling")
    norm = kw.pop("normalization", "token_mean")
    _no_extra(kw, "importance_sampling")
    return importance_sampling_loss(logp, old, _align(adv, labels), mask, norm)


def ppo_loss_fn(logits, labels, attention_mask=None, **kw):
    """Engine loss "ppo": kwargs advantages, old_logprobs|old_log_probs, clip_low, clip_high,
    normalization, chunk_size; value loss when `returns` is given with `values` (the rollout's
    value estimates) and/or `value_preds` (the model's current values, with gradient; the engine
    passes them when the model's output has a `value` field): loss = policy + vf_coef * value."""
    logp, mask, adv = _scored(logits, labels, kw)
    _need_adv(adv, "ppo")
    old = _old(kw, labels, logp, "ppo")
    norm = kw.pop("normalization", "token_mean")
    loss, metrics = ppo_policy_loss(logp, old, _align(adv, labels), mask, kw.pop("clip_low", 0.2),
                                    kw.pop("clip_high", 0.2), norm)
    values, returns = kw.pop("values", None), kw.pop("returns", None)
    preds = kw.pop("value_preds", None)
    vf_coef, clip_v = kw.pop("vf_coef", 0.1), kw.pop("clip_range_value", 0.2)
    _no_extra(kw, "ppo")
    if returns is not None:
        if values is None and preds is None:
            raise ValueError("ppo: returns= was given without values= (or a model that outputs values)")
        old_v = _align(values, labels) if values is not None else None
        new_v = preds
        if new_v is None:
            # No value head in this model: the loss is a constant, reported for monitoring only.
            new_v = _per_token(old_v, logp, "values")
            old_v = None
        else:
            new_v = new_v.squeeze(-1) if new_v.dim() == 3 else new_v
            if new_v.shape[1] == logp.shape[1] + 1:
                # a value head's (B, T) output: V at position t scores the state before token t+1,
                # aligned with logits[:, :-1] like the log-probs
                new_v = new_v[:, :-1]
        v_loss, v_metrics = ppo_value_loss(new_v, old_v, _align(returns, labels), mask, clip_v, norm)
        metrics = {**metrics, **v_metrics}
        loss = loss + vf_coef * v_loss
        metrics["loss/total"] = loss.detach()
    return loss, metrics


def cispo_loss_fn(logits, labels, attention_mask=None, **kw):
    """Engine loss "cispo": kwargs advantages, old_logprobs|old_log_probs, clip_low, clip_high,
    normalization, chunk_size."""
    logp, mask, adv = _scored(logits, labels, kw)
    _need_adv(adv, "cispo")
    old = _old(kw, labels, logp, "cispo")
    args = (kw.pop("clip_low", 0.2), kw.pop("clip_high", 0.2), kw.pop("normalization", "token_mean"))
    _no_extra(kw, "cispo")
    return cispo_loss(logp, old, _align(adv, labels), mask, *args)


def dro_loss_fn(logits, labels, attention_mask=None, **kw):
    """Engine loss "dro": kwargs advantages, old_logprobs|old_log_probs, beta, normalization, chunk_size."""
    logp, mask, adv = _scored(logits, labels, kw)
    _need_adv(adv, "dro")
    old = _old(kw, labels, logp, "dro")
    args = (kw.pop("beta", 0.05), kw.pop("normalization", "token_mean"))
    _no_extra(kw, "dro")
    return dro_loss(logp, old, _align(adv, labels), mask, *args)


def weighted_cross_entropy_loss_fn(logits, labels, attention_mask=None, weights=None,
                                   normalization: str = "token_mean", chunk_size: int | None = None):
    """Engine loss "cross_entropy": -logp * weights over labelled tokens, with the explicit
    normalization and chunked log-probs. `weights` (B, T-1), (B, T) or (B,)."""
    logp, mask = token_logprobs(logits, labels, chunk_size=chunk_size)
    w = _per_token(_align(weights, labels), logp, "weights") if weights is not None else 1.0
    loss = aggregate(-logp * w, mask, normalization)
    return loss, {"nll": masked_mean(-logp, mask).detach(), "num_tokens": mask.sum()}


LOSS_FNS.update({
    "cross_entropy": weighted_cross_entropy_loss_fn,
    "importance_sampling": importance_sampling_loss_fn,
    "ppo": ppo_loss_fn,
    "cispo": cispo_loss_fn,
    "dro": dro_loss_fn,
})
