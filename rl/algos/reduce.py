"""Masked reductions shared by every loss: `masked_mean` and the token aggregation of a policy loss.

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
"""

from __future__ import annotations

import torch

NORMALIZATIONS = ("sum", "token_mean", "sequence_mean", "constant")


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
    if normalization == "constant":
        if not max_length:
            raise ValueError("normalization 'constant' needs max_length (the completion length budget)")
        return total / (per_token.shape[0] * max_length)
    raise ValueError(f"normalization must be one of {', '.join(NORMALIZATIONS)}; got {normalization!r}")
