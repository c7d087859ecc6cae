"""PPO, under the module name the reference docs use (`rl.ppo`): a thin public facade over
`rl.trainers.ppo` (the trainer), `rl.models.value` (policy + value head) and `rl.algos.kl`."""

from rl.algos.kl import AdaptiveKLController, FixedKLController
from rl.models.value import PPOModel, ValueHead
from rl.trainers.ppo import PPOTrainer
from rl.trainers.ppo_config import PPOConfig

__all__ = ["AdaptiveKLController", "FixedKLController", "PPOConfig", "PPOModel", "PPOTrainer", "ValueHead"]
