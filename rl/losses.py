"""Pure tensor math for the trainers: token log-probs, masks and losses.

Shapes: B = batch, T = sequence length, V = vocabulary. Logits (B, T, V) predict token t+1 at
position t, so every per-token quantity below has length T-1 and is aligned with `labels[:, 1:]`.
Losses return `(scalar_loss, metrics)` where metrics are detached scalars.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

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
