"""Reward models, under the module name of the reference docs (`rl.reward_model`): a thin public
facade over `rl.models.reward` (the models) and `rl.trainers.reward` (their trainer)."""

from rl.models.reward import (
    MultiObjectiveRewardModel,
    PairwiseRewardModel,
    RewardModel,
    RewardModelConfig,
)
from rl.trainers.reward import RewardModelTrainer

__all__ = ["MultiObjectiveRewardModel", "PairwiseRewardModel", "RewardModel", "RewardModelConfig", "RewardModelTrainer"]
