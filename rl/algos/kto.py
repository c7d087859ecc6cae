"""KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 7-8) on
unpaired rows: a prompt x, one completion y and a label (desirable or not), as TRL 1.16's KTOTrainer.

With the implied reward r(x, y) = log pi(y|x) - log ref(y|x) (sums over the completion's tokens) and
the reference point z0, an estimate of KL(pi || ref) from MISMATCHED pairs (x_i, y_j) of the batch:

    z0          = max(0, mean_i [log pi(y_j|x_i) - log ref(y_j|x_i)])     detached (no gradient)
    desirable   : lambda_D * (1 - sigmoid(beta * (r(x, y) - z0)))
    undesirable : lambda_U * (1 - sigmoid(beta * (z0 - r(x, y))))

lambda_D / lambda_U are `desirable_weight` / `undesirable_weight`; the batch loss is the mean over its
rows. TRL averages the per-process means of the KL term before the clamp; `kl_reference_point` takes
the mean over the rows it is given, the trainer averages across processes.
"""

from __future__ import annotations

import torch


def kl_reference_point(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z0 before the cross-process mean and the clamp: mean over the mismatched rows of the log-ratio,
    detached. (B,), (B,) -> scalar."""
    return (kl_logps - ref_kl_logps).mean().detach()


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor | float,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KTO losses and rewards.

    logps, ref_logps (B,): completion log-prob sums under policy and reference; desirable (B,) bool;
    z0: the (clamped, detached) reference point. Returns (losses (B,), rewards (B,) = beta * log-ratio,
    detached)."""
    ratio = logps - ref_logps
    z0 = torch.as_tensor(z0, dtype=ratio.dtype, device=ratio.device).detach()
    d = desirable.to(device=ratio.device, dtype=torch.bool)
    des = desirable_weight * (1.0 - torch.sigmoid(beta * (ratio - z0)))
    und = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - ratio)))
    return torch.where(d, des, und), beta * ratio.detach()
