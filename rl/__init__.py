"""RL fine-tuning for language models on Accelerate and DeepSpeed.

Public names are imported lazily (so `import rl` stays fast and a trainer's heavy imports happen only
when it is used). The table below is the whole public surface; it follows the reference docs.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # engine and client
    "ForwardBackwardPipeline": "rl.forward_backward",
    "AsyncTrainingClient": "rl.forward_backward",
    # config
    "ConfigError": "rl.config",
    # the reference CLI doc's Python API (rl-train from Python)
    "LLMTrainingParams": "rl.autotrain",
    "AutoTrainProject": "rl.autotrain",
    # PPO
    "PPOConfig": "rl.ppo",
    "PPOTrainer": "rl.ppo",
    "PPOModel": "rl.ppo",
    "ValueHead": "rl.ppo",
    "AdaptiveKLController": "rl.ppo",
    "FixedKLController": "rl.ppo",
    # DPO
    "DPOConfig": "rl.dpo",
    "DPOTrainer": "rl.dpo",
    "PreferenceDataset": "rl.dpo",
    # GRPO
    "GRPOConfig": "rl.grpo",
    "GRPOTrainer": "rl.grpo",
    # online DPO
    "OnlineDPOConfig": "rl.online_dpo",
    "OnlineDPOTrainer": "rl.online_dpo",
    # SFT
    "SFTConfig": "rl.sft",
    "SFTTrainer": "rl.sft",
    # reward models
    "RewardModel": "rl.reward",
    "RewardModelConfig": "rl.reward",
    "RewardModelTrainer": "rl.reward",
    "PairwiseRewardModel": "rl.reward",
    "MultiObjectiveRewardModel": "rl.reward",
    # environments
    "Observation": "rl.environments",
    "StepResult": "rl.environments",
    "Trajectory": "rl.environments",
    "TextGenerationEnv": "rl.environments",
    "MultiObjectiveRewardEnv": "rl.environments",
    "PreferenceComparisonEnv": "rl.environments",
    "create_math_problem_env": "rl.environments",
    "create_code_generation_env": "rl.environments",
    "make_env": "rl.environments",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
