"""PPO's reward glue: the run's reward source from the config or the Python arguments (one protocol,
rl.trainers.rewards, as GRPO's), the per-completion scores PPO needs, and a toy reward with a known optimum."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rl.trainers.ppo_config import NO_REWARD_ERROR, PPOConfig, check_reward_source
from rl.trainers.rewards import (
    RewardError,
    WeightedSum,
    build_reward_fns,
    rows_to_columns,
)


def build_reward_source(cfg: PPOConfig, tokenizer, reward_fn=None, reward_model=None) -> WeightedSum:
    """The run's reward: the reward_fn / reward_model given in Python (both: their sum), else the
    config's sources (reward_model_path, reward_fn, an environment), combined by reward_weights."""
    check_reward_source(cfg, reward_fn, reward_model)
    if reward_fn is not None or reward_model is not None:
        cfg = dataclasses.replace(cfg, reward_model_path=None, reward_fn=None, env_type=None, multi_objective=False,
                                  reward_weights=None)
    return build_reward_fns(cfg, tokenizer, reward_funcs=[reward_fn] if reward_fn is not None else (),
                            reward_model=reward_model, missing=NO_REWARD_ERROR)


def ppo_scores(reward: WeightedSum, prompts: list[str], responses: list[str],
               metadata: Sequence[dict] | None) -> tuple[torch.Tensor, dict[str, float]]:
    """(B,) scores and `rewards/<source or component>/mean` metrics. PPO needs a score for every
    completion: one no source scored (all returned None) is a RewardError."""
    scores, parts = reward(prompts, responses, rows_to_columns(metadata, len(responses)))
    missing = torch.isnan(scores).nonzero().flatten().tolist()
    if missing:
        raise RewardError(f"reward {reward.name!r} gave no score (None) for completion {missing[0]} "
                          f"({len(missing)} of {len(responses)}); PPO needs a score for every completion")
    metrics = {f"rewards/{k}/mean": float(v.nanmean()) for k, v in parts.items() if len(parts) > 1 or k != reward.name}
    return scores, metrics
