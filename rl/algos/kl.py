"""KL(policy || reference) estimators per sampled token, KL-penalised rewards, KL coefficient controllers.

Estimators (Schulman 2020, "Approximating KL divergence"), with log r = ref_logp - logp for a token
sampled from the policy; all map logp, ref_logp (B, N) -> (B, N):
    k1 = logp - ref_logp                 unbiased, can be negative per token
    k2 = 0.5 * (logp - ref_logp)^2       biased, low variance, >= 0 (what PPO logs as approx_kl)
    k3 = (r - 1) - log r                 unbiased and >= 0 (GRPO's penalty, Shao et al. 2024, eq. 4)
"""

from __future__ import annotations

import torch

from rl.algos.registry import get, register

KIND = "kl_estimator"


@register(KIND, "k1")
def k1_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log p_ref per token, (B, N) -> (B, N)."""
    return logp - ref_logp


@register(KIND, "k2")
def k2_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log p - log p_ref)^2 per token, (B, N) -> (B, N)."""
    return 0.5 * (logp - ref_logp) ** 2


@register(KIND, "k3")
def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 with d = ref_logp - logp, per token, (B, N) -> (B, N), always >= 0.

    Computed as expm1(d) - d, which keeps its precision for small |d| (near-on-policy tokens)."""
    d = ref_logp - logp
    return torch.expm1(d) - d


def per_token_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """The registered `estimator` (k1, k2, k3, ...) applied to logp, ref_logp (B, N) -> (B, N)."""
    return get(KIND, estimator)(logp, ref_logp)


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards (Ziegler et al. 2019, eq. 2): -kl_coef * KL_t on every response token, plus the
    sequence score at the last response token only.

    scores (B,), kl (B, N), mask (B, N) -> (rewards (B, N), non_score_rewards (B, N)). The last response
    token is the last position where mask == 1, also when the mask has gaps (a tool-use episode's tool
    tokens are 0 in the middle). A row with no response token gets no score (nothing to credit it to)."""
    mask = mask.to(kl.dtype)
    non_score = -kl_coef * kl * mask
    pos = torch.arange(1, mask.shape[-1] + 1, device=mask.device, dtype=kl.dtype)
    last = (mask * pos).argmax(-1)  # the highest position with mask 1 (0 when there is none)
    bonus = torch.zeros_like(non_score)
    bonus.scatter_(1, last[:, None], (scores.to(kl.dtype) * (mask.sum(-1) > 0).to(kl.dtype))[:, None])
    return non_score + bonus, non_score


class AdaptiveKLController:
    """Ziegler et al. (2019), sec. 2.2: coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon.

    `n_steps` is the number of samples the KL was measured on (the rollout batch); without it (the
    reference's bug) the coefficient moves by at most 0.2 / horizon per iteration, i.e. never."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"kl target and horizon must be > 0, got {target} and {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


class FixedKLController:
    """A constant KL coefficient (`adaptive_kl: false`)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:  # noqa: ARG002
        return self.value
