"""DAPO's reward-side pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale"); its clip-higher and token-level loss are GRPO options already (epsilon_high, token_mean).

    overlong_penalty     soft overlong punishment (eq. 13), added to a completion's reward
    groups_with_spread   dynamic sampling's filter (eq. 11's constraint 0 < |{correct}| < G): a group
                         whose rewards are all equal has advantage 0 everywhere and teaches nothing

Deviation: the paper filters on accuracy; here the filter is on the final reward (shaping included),
which is exactly the condition for a zero advantage under every group estimator.
"""

from __future__ import annotations

import torch

from rl.algos.advantages import group_stats


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO eq. 13, times `factor`; lengths (B,) completion tokens -> (B,) penalties in [-factor, 0]:

        0                                        |y| <= L_max - L_buf
        factor * (L_max - L_buf - |y|) / L_buf   L_max - L_buf < |y| <= L_max
        -factor                                  |y| > L_max

    L_max = max_length (max_completion_length), L_buf = buffer; buffer 0 turns it off (all zeros).
    |y| is the completion's token count, its EOS included (as verl's DAPO counts the response)."""
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    return factor * ((max_length - buffer - lengths) / buffer).clamp(min=-1.0, max=0.0)


def groups_with_spread(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N*G,) rewards, groups contiguous -> (N,) bool, True where the group's rewards differ (Bessel
    std not close to 0, NaNs ignored). Groups with fewer than two scored completions are False."""
    _, std = group_stats(rewards, num_generations)
    std = std.view(-1, num_generations)[:, 0]
    return ~torch.isclose(std, torch.zeros_like(std)) & ~torch.isnan(std)
