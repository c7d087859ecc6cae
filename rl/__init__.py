"""RL fine-tuning for language models on Accelerate and DeepSpeed.

Public names are imported lazily (so `import rl` stays fast and a trainer's heavy imports happen only
when it is used). The table below is the whole public surface; it follows the reference docs.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # engine and client
    "ForwardBackwardPipeline": "rl.engine.pipeline",
    "AsyncTrainingClient": "rl.engine.client",
    # config
    "ConfigError": "rl.errors",
    # the reference CLI doc's Python API (rl-train from Python)
    "LLMTrainingParams": "rl.scripts.autotrain",
    "AutoTrainProject": "rl.scripts.autotrain",
    # PPO
    "PPOConfig": "rl.trainers.ppo_config",
    "PPOTrainer": "rl.trainers.ppo",
    "PPOModel": "rl.models.value",
    "ValueHead": "rl.models.value",
    "AdaptiveKLController": "rl.algos.kl",
    "FixedKLController": "rl.algos.kl",
    # distillation (GKD)
    "DistillConfig": "rl.trainers.distill",
    "DistillTrainer": "rl.trainers.distill",
    # DPO
    "DPOConfig": "rl.trainers.dpo",
    "DPOTrainer": "rl.trainers.dpo",
    "PreferenceDataset": "rl.data.preference",
    # GRPO
    "GRPOConfig": "rl.trainers.grpo_config",
    "GRPOTrainer": "rl.trainers.grpo",
    # KTO
    "KTOConfig": "rl.trainers.kto",
    "KTOTrainer": "rl.trainers.kto",
    # online DPO
    "OnlineDPOConfig": "rl.trainers.online_dpo",
    "OnlineDPOTrainer": "rl.trainers.online_dpo",
    # SFT
    "SFTConfig": "rl.trainers.sft",
    "SFTTrainer": "rl.trainers.sft",
    # reward models
    "RewardModel": "rl.models.reward",
    "RewardModelConfig": "rl.models.reward",
    "RewardModelTrainer": "rl.trainers.reward",
    "PairwiseRewardModel": "rl.models.reward",
    "MultiObjectiveRewardModel": "rl.models.reward",
    # environments
    "Observation": "rl.envs.base",
    "StepResult": "rl.envs.base",
    "Trajectory": "rl.envs.base",
    "TextGenerationEnv": "rl.envs.base",
    "MultiObjectiveRewardEnv": "rl.envs.objectives",
    "PreferenceComparisonEnv": "rl.envs.objectives",
    "create_math_problem_env": "rl.envs.math",
    "create_code_generation_env": "rl.envs.code",
    "make_env": "rl.envs.registry",
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
