"""Distillation divergences on per-token distributions (GKD, Agarwal et al. 2024, "On-Policy Distillation
of Language Models: Learning from Self-Generated Mistakes", eq. 1), as TRL 1.16's
`GKDTrainer.generalized_jsd_loss` computes them.

For student S and teacher T (softmax of logits / temperature) at one position, and M = (1-beta) S + beta T:

    JSD_beta(S, T) = beta KL(T || M) + (1 - beta) KL(S || M)      0 < beta < 1
    beta = 0:        KL(T || S)   forward KL (what supervised distillation minimises)
    beta = 1:        KL(S || T)   reverse KL (mode seeking)

(TRL's convention: beta = 0 and beta = 1 are the two KLs themselves, not the limits of the mixture
formula, which vanish.) The loss averages the per-token divergence over the counted positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-position divergence: logits (..., V) -> (...,), summed over the vocabulary (see module doc)."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
             beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Mean of `generalized_jsd` over the positions where `mask` (..., bool) is true (all when None);
    0 with a gradient path when no position counts (TRL's reduction="batchmean")."""
    per = generalized_jsd(student_logits, teacher_logits, beta, temperature)
    if mask is None:
        return per.mean()
    m = mask.to(per.dtype)
    return (per * m).sum() / m.sum().clamp(min=1)
