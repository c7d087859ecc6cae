"""Environments, under the module name of the reference docs (`rl.environments`): a thin public
facade over `rl.envs` (one module per environment, and the registry behind `make_env`)."""

from rl.envs.base import Observation, StepResult, TextGenerationEnv, Trajectory
from rl.envs.code import create_code_generation_env
from rl.envs.math import create_math_problem_env
from rl.envs.objectives import MultiObjectiveRewardEnv, PreferenceComparisonEnv
from rl.envs.registry import env_types, make_env, register_env

__all__ = ["MultiObjectiveRewardEnv", "Observation", "PreferenceComparisonEnv", "StepResult", "TextGenerationEnv", "Trajectory", "create_code_generation_env", "create_math_problem_env", "env_types", "make_env", "register_env"]
