"""`make_env`: an environment by its `env_type` name, as the trainers' `env_type` / `env_config` (and the
CLI's `rl_env_type` / `rl_env_config`) give it.

Each environment module registers its own factory, `factory(tokenizer, **env_config) -> environment`,
with `rl.envs.base.register_env` next to it; this module imports every built-in one, so `ENV_REGISTRY`
is complete once it is imported, and `ENV_TYPES` (the built-in names, for config validation and
`--help` choices) is taken after that. The environment modules never import this one.

Built in: text_generation, multi_objective, preference_comparison (rl.envs.objectives), math
(rl.envs.math), code (rl.envs.code), tool_math (rl.envs.tool_math). Anything else is either a name a
user's module registered with `register_env`, or `"package.module:function"`: the module is imported
with importlib (it must be importable: on PYTHONPATH or in the working directory; no string is ever
evaluated) and `function(tokenizer, **env_config)` builds the environment.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import rl.envs.code  # noqa: F401
import rl.envs.math  # noqa: F401

# Importing the environment modules registers their factories.
import rl.envs.objectives  # noqa: F401  text_generation, multi_objective, preference_comparison
import rl.envs.tool_math  # noqa: F401
from rl.algos.registry import import_function
from rl.envs.base import ENV_REGISTRY, TextGenerationEnv, env_types, register_env

__all__ = ["ENV_REGISTRY", "ENV_TYPES", "env_types", "load_env_factory", "make_env", "register_env"]

ENV_TYPES: tuple[str, ...] = env_types()  # the built-in names: every environment module above registered


def load_env_factory(spec: str) -> Callable[..., Any]:
    """The factory a `module:function` env_type names (e.g. `my_envs:make`), imported with importlib."""
    return import_function(spec, "environment")


def make_env(env_type: str, tokenizer, config: dict | str | None = None) -> TextGenerationEnv:
    """Build an environment from the CLI's `rl_env_type` and `rl_env_config` (a dict or JSON string).

    `env_type` is a registered name (`env_types()`) or `'module:function'`; the config's keys are the
    factory's keyword arguments:
    text_generation: prompts|prompts_path, reward_fn (a rl.rewards.functions name or 'module:function'),
      max_length, ...
    multi_objective: prompts|prompts_path, reward_components ({name: builtin|'module:function'} or a list of
      names; default: the keys of reward_weights), reward_weights ({name: weight} or JSON string)
    preference_comparison: prompts|prompts_path and reward_model_path (an HF sequence classifier) or
      preference_model / human_feedback_fn objects
    math: the keyword arguments of create_math_problem_env; code: those of create_code_generation_env;
    tool_math: those of rl.envs.tool_math.create_tool_math_env (multi-turn: the policy may call tools).
    An unknown name, or a config the factory does not take, is a ValueError.
    """
    if isinstance(config, str):
        try:
            config = json.loads(config) if config.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"rl_env_config is not valid JSON ({e}); example: '{{\"difficulty\": \"tiny\"}}'") from e
    config = dict(config or {})
    if isinstance(env_type, str) and ":" in env_type:
        factory = load_env_factory(env_type)
    elif env_type in ENV_REGISTRY:
        factory = ENV_REGISTRY[env_type]
    else:
        raise ValueError(f"unknown environment type {env_type!r}; choose one of {', '.join(env_types())} "
                         "or give 'module:function'")
    try:
        return factory(tokenizer, **config)
    except TypeError as e:
        raise ValueError(f"bad config for environment {env_type!r}: {e}") from e
