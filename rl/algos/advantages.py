"""Advantage estimators: GAE with a critic (PPO) and the critic-free group baselines (GRPO family).

Group estimators share one signature, registered under "advantage_estimator":
    fn(rewards (N*G,), num_generations G) -> advantages (N*G,)
with each prompt's G completions contiguous; one scalar per completion (the trainer broadcasts it over
the completion's tokens):
    grpo          (r - mean_group) / (std_group + 1e-4)       GRPO (Shao et al. 2024); TRL scale_rewards="group"
    dr_grpo       r - mean_group                               Dr. GRPO (Liu et al. 2025); TRL scale_rewards="none"
    rloo          r - mean of the other G-1 rewards            RLOO (Ahmadian et al. 2024); TRL RLOOTrainer
    reinforce_pp  (r - mean_group), then normalised by the     REINFORCE++-baseline (Hu et al. 2025)
                  mean/std of the whole batch
std is Bessel-corrected (torch.std, TRL's nanstd). NaN rewards (a completion no reward function scored)
are left out of the group statistics and get advantage 0.
"""

from __future__ import annotations

import torch

from rl.algos.registry import get, register

KIND = "advantage_estimator"
STD_EPS = 1e-4  # TRL's epsilon in (r - mean) / (std + eps)


# ---------------------------------------------------------------------------- group baselines

def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs (TRL's `nanstd`); `dim` None reduces everything."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    return torch.sqrt(var * count / (count - 1)).squeeze(dim)


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be 1-D with a multiple of num_generations={num_generations} entries "
                         f"(groups contiguous), got shape {tuple(rewards.shape)}")
    return rewards.view(-1, num_generations)


def group_stats(rewards: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N*G,) rewards -> per-completion group mean and Bessel-corrected group std, NaNs ignored."""
    g = _grouped(rewards, num_generations)
    mean = torch.nanmean(g, dim=1)
    std = nanstd(g, dim=1)
    return mean.repeat_interleave(num_generations), std.repeat_interleave(num_generations)


@register(KIND, "grpo")
def grpo_advantages(rewards: torch.Tensor, num_generations: int, eps: float = STD_EPS) -> torch.Tensor:
    """GRPO (Shao et al. 2024, outcome supervision): (r - mean_group) / (std_group + eps).

    rewards (N*G,) with each prompt's G completions contiguous -> advantages (N*G,); NaN -> 0."""
    mean, std = group_stats(rewards, num_generations)
    return torch.nan_to_num((rewards - mean) / (std + eps), nan=0.0)


@register(KIND, "dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): r - mean_group, no std
    (dividing by the std up-weights prompts that are too easy or too hard). (N*G,) -> (N*G,)."""
    mean, _ = group_stats(rewards, num_generations)
    return torch.nan_to_num(rewards - mean, nan=0.0)


@register(KIND, "grpo_batch")
def grpo_batch_advantages(rewards: torch.Tensor, num_generations: int, eps: float = STD_EPS) -> torch.Tensor:
    """TRL's scale_rewards="batch" (Liu et al. 2025, "Part I: Tricks or Traps?", group mean with batch std):
    (r - mean_group) / (std_batch + eps), the std of the raw rewards of the whole batch. (N*G,) -> (N*G,)."""
    mean, _ = group_stats(rewards, num_generations)
    return torch.nan_to_num((rewards - mean) / (nanstd(rewards) + eps), nan=0.0)


@register(KIND, "rloo")
def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024; Kool et al. 2019): r_i - mean_{j != i} r_j within the group.

    Equals G/(G-1) * (r - mean_group). NaN rewards are left out of the siblings' baseline (TRL).
    (N*G,) -> (N*G,)."""
    if num_generations < 2:
        raise ValueError("rloo needs num_generations >= 2 (the baseline is the other completions)")
    g = _grouped(rewards, num_generations)
    counts = (~torch.isnan(g)).sum(dim=1, keepdim=True)
    baseline = (torch.nansum(g, dim=1, keepdim=True) - g) / (counts - 1)
    return torch.nan_to_num((g - baseline).view(-1), nan=0.0)


@register(KIND, "reinforce_pp")
def reinforce_pp_advantages(rewards: torch.Tensor, num_generations: int, eps: float = STD_EPS) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): subtract the group mean, then normalise the result with
    the mean and (Bessel-corrected) std of the whole batch. (N*G,) -> (N*G,).

    Unlike TRL's scale_rewards="batch" (which divides by the std of the raw rewards), the std is that
    of the group-centred advantages, as in the paper."""
    centred = rewards - group_stats(rewards, num_generations)[0]
    adv = (centred - torch.nanmean(centred)) / (nanstd(centred) + eps)
    return torch.nan_to_num(adv, nan=0.0)


def compute_advantages(rewards: torch.Tensor, num_generations: int, estimator: str = "grpo") -> torch.Tensor:
    """The registered group estimator `estimator` on fp32 rewards (N*G,) -> (N*G,)."""
    return get(KIND, estimator)(rewards.float(), num_generations)


# ---------------------------------------------------------------------------- with a critic

def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) as one reverse scan over t.

    rewards, values, mask: (B, N). Masked positions are skipped: the successor of a valid token is the
    next VALID token (V = 0 after the last one: the episode ends there), and discounting counts valid
    tokens only. With trailing padding this is the textbook recursion
        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1}.
    The deltas are computed for all t at once; the recursion is N steps of (B,) vector operations:
    O(B * N) time and memory (a closed-form weighted sum would need (B, N, N)). fp64 inside.
    Returns (advantages, returns = advantages + values), both 0 where mask == 0, in rewards' dtype."""
    B, N = rewards.shape
    m = mask.to(torch.float64)
    r = rewards.to(torch.float64) * m
    v = values.to(torch.float64) * m
    pos = torch.arange(N, device=rewards.device).expand(B, N)
    # index of the next valid position after t (N if none), by a reverse cumulative minimum
    idx = torch.where(m > 0, pos, torch.full_like(pos, N))
    nxt = torch.cat([idx[:, 1:], torch.full((B, 1), N, device=idx.device, dtype=idx.dtype)], dim=1)
    nxt = torch.flip(torch.cummin(torch.flip(nxt, [1]), dim=1).values, [1])
    next_v = torch.cat([v, v.new_zeros(B, 1)], dim=1).gather(1, nxt)
    # time-major, so that each step reads contiguous (B,) rows
    delta = ((r + gamma * next_v - v) * m).T.contiguous()
    valid = (m > 0).T.contiguous()
    adv = torch.zeros_like(delta)
    carry = delta.new_zeros(B)  # A of the next valid token (0 after the last one)
    decay = gamma * lam
    for t in range(N - 1, -1, -1):
        carry = torch.where(valid[t], delta[t] + decay * carry, carry)
        adv[t] = carry
    adv = adv.T * m
    returns = (adv + v) * m
    return adv.to(rewards.dtype), returns.to(rewards.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (unbiased variance, as TRL's `masked_whiten`); masked
    positions return 0. With shift_mean=False the mean is added back (scale only). (B, N) -> (B, N)."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m
