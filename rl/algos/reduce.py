"""Masked reductions shared by every loss: `masked_mean`, `masked_mse` (multi-objective reward
regression) and the token aggregation of a policy loss.

Aggregation of a (B, N) per-token loss over its mask (`normalization`, the GRPO config calls it
`loss_aggregation`):
    "sum"            sum over masked tokens (Tinker's choice; scale grows with batch and length)
    "token_mean"     sum / number of masked tokens (default; DAPO, Yu et al. 2025; TRL loss_type="dapo").
                     `num_items` replaces the divisor, so that micro-batches accumulate to the exact
                     token mean of a whole optimizer step
    "sequence_mean"  mean over sequences of each sequence's token mean (GRPO paper, Shao et al. 2024;
                     TRL loss_type="grpo"); sequences with no counted token are left out (0/0)
    "constant"       sum / (B * max_length) (Dr. GRPO, Liu et al. 2025; TRL loss_type="dr_grpo"): no
                     length bias
    "sequence_sum"   mean over sequences of each sequence's token sum (TRL loss_type="luspo")
"""

from __future__ import annotations

import torch

NORMALIZATIONS = ("sum", "token_mean", "sequence_mean", "constant", "sequence_sum")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `x` over entries where mask == 1 (all of them, or along `dim`); 0 when none counts."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normalization: str = "token_mean", *,
              num_items: float | torch.Tensor | None = None, max_length: int | None = None) -> torch.Tensor:
    """Reduce a (B, N) per-token loss over `mask` (B, N) to a scalar; see the module docstring.

    num_items: token_mean's divisor (default: the mask's token count). max_length: constant's
    per-sequence length (required for "constant")."""
    mask = mask.to(per_token.dtype)
    total = (per_token * mask).sum()
    if normalization == "sum":
        return total
    if normalization == "token_mean":
        return total / (mask.sum().clamp(min=1) if num_items is None else num_items)
    if normalization == "sequence_mean":
        counts = mask.sum(-1)
        per_seq = (per_token * mask).sum(-1) / counts.clamp(min=1)
        has = (counts > 0).to(per_token.dtype)
        return (per_seq * has).sum() / has.sum().clamp(min=1)
    if normalization == "sequence_sum":
        return (per_token * mask).sum(-1).mean()
    if normalization == "constant":
        if not max_length:
            raise ValueError("normalization 'constant' needs max_length (the completion length budget)")
        return total / (per_token.shape[0] * max_length)
    raise ValueError(f"normalization must be one of {', '.join(NORMALIZATIONS)}; got {normalization!r}")


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean squared error over the unmasked entries of a (B, K) regression.

    Args:
        pred, target: (B, K). Masked entries of `target` may hold anything, NaN included.
        mask: None (all entries), (K,) per objective, or (B, K) per entry; nonzero = trained.
    Returns:
        (loss, per_objective): the mean over all unmasked entries (a zero that still has a grad_fn
        when everything is masked) and the (K,) mean per objective (0 where none is unmasked).
    """
    if mask is None:
        mask = torch.ones_like(pred, dtype=torch.bool)
    mask = mask.to(pred.device).bool()
    if mask.dim() == 1:
        if mask.shape[0] != pred.shape[1]:
            raise ValueError(f"objective_mask has {mask.shape[0]} entries but there are {pred.shape[1]} objectives")
        mask = mask.unsqueeze(0).expand_as(pred)
    elif mask.shape != pred.shape:
        raise ValueError(f"objective_mask shape {tuple(mask.shape)} must be (K,) or (B, K) = {tuple(pred.shape)}")
    if target.shape != pred.shape:
        raise ValueError(f"target_rewards shape {tuple(target.shape)} must be (B, K) = {tuple(pred.shape)}")
    # Masked targets are replaced before the subtraction: a NaN there would otherwise reach the
    # gradient (0 * NaN) even through where().
    target = torch.where(mask, target.to(pred.dtype), pred.detach())
    sq = torch.where(mask, (pred - target) ** 2, torch.zeros_like(pred))
    count = mask.sum()
    loss = sq.sum() / count.clamp(min=1)  # all masked: 0 * pred, connected to the graph
    per_objective = sq.sum(0) / mask.sum(0).clamp(min=1)
    return loss, per_objective
