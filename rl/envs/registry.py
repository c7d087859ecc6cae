"""RL environments: episodes and rewards for text generation, multiple objectives, preferences, math, code.

Two APIs over the same reward logic:

* The reference's per-token API: `obs = env.reset()`, `result = env.step(token)` until `result.done`,
  `env.render()`. The reward is terminal (0.0 until the episode ends), as in the reference.
* The batched episode API the trainers use (PPO/GRPO/RLOO):

      batch = env.sample_prompts(n, seed)              # [{"prompt": str, "metadata": dict}, ...]
      rewards, metrics = env.score(prompts, completions, metadata)
      # rewards: list[float], one per completion; metrics: {name: list[float]} aligned with it

  `env(prompts, responses, metadata=None) -> list[float]` is the same as `score(...)[0]`, so an
  environment can be passed wherever a `reward_fn(prompts, responses, metadata)` is expected.
  `sample_prompts` is deterministic in `seed` (every rank of a distributed run gets the same batch and
  shards it); for GRPO, repeat each prompt `num_generations` times before generating.

Episodes end at EOS, at the first stop sequence, or when prompt + completion reaches `max_length`
tokens. Scoring sees the completion cut before its first stop sequence, in `step()` and `score()` alike.

Reward functions given to the environments may be per-sample, `fn(prompt, generated, full_text)` (the
reference's signature; a `metadata` keyword is passed when the function accepts one), or batched,
`fn(prompts, responses, metadata=None) -> list[float]` (rl.rewards.answers' signature, recognised by its first
parameter being named `prompts`).

Deviations from the reference implementation (see shared/reference/README.md): the math environment
parses the answer and compares numbers (the substring "correct" earns nothing), the code environment
rewards only non-empty parseable code and runs unit tests only in `rl.envs.sandbox`, which returns the
candidate's outputs while the expected values stay in the trainer (see `run_unit_tests`), and the preference
environment scores with the given model or callback, never a random number.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from rl.data.records import read_records
from rl.envs.base import TextGenerationEnv, length_reward
from rl.envs.code import (
    create_code_generation_env,
    extract_code,
    parse_code,
    style_score,
)
from rl.envs.math import create_math_problem_env
from rl.envs.objectives import MultiObjectiveRewardEnv, PreferenceComparisonEnv
from rl.errors import DataError
from rl.models.loading import load_causal_lm, load_tokenizer
from rl.rewards import answers as R
from rl.rewards import functions as RF

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ factory

ENV_TYPES = ("text_generation", "multi_objective", "preference_comparison", "math", "code", "tool_math")


# Components a multi_objective env can name in its config (rl_reward_weights keys).
NAMED_COMPONENTS: dict[str, Callable] = {
    "correctness": RF.correctness_reward,
    "formatting": lambda prompt, generated, full_text: 1.0 if R.has_answer_format(generated, "answer") else 0.0,
    "length": length_reward,
    "length_penalty": RF.length_penalty_reward,
    "syntax": lambda prompt, generated, full_text: 1.0 if parse_code(extract_code(generated, prompt)) else 0.0,
    "style": lambda prompt, generated, full_text: style_score(extract_code(generated, prompt)),
}


def _component(name: str, spec: Any) -> Callable:
    if callable(spec):
        return spec
    key = spec if isinstance(spec, str) else name
    if key in NAMED_COMPONENTS:
        return NAMED_COMPONENTS[key]
    if isinstance(key, str) and ":" in key:
        return RF.load_custom_reward(key)
    raise ValueError(f"unknown reward component {key!r}; use one of {', '.join(NAMED_COMPONENTS)} "
                     "or 'module:function'")


def _prompts_from(config: dict) -> tuple[list[str], list[dict] | None]:
    if "prompts" in config:
        prompts = config.pop("prompts")
        return list(prompts), config.pop("metadata", None)
    path = config.pop("prompts_path", None) or config.pop("data_path", None)
    if path is None:
        raise ValueError("environment config needs 'prompts' (a list) or 'prompts_path' (a data file with a "
                         "'text' or 'prompt' column)")
    rows = read_records(path)
    col = "prompt" if rows and "prompt" in rows[0] else "text"
    prompts, metas = [], []
    for row in rows:
        if not isinstance(row.get(col), str) or not row[col].strip():
            raise DataError(f"{path}:{row.get('_line')}: '{col}' must be a non-empty string")
        prompts.append(row[col])
        metas.append({k: v for k, v in row.items() if k not in (col, "_line")})
    return prompts, metas


def make_env(env_type: str, tokenizer, config: dict | str | None = None) -> TextGenerationEnv:
    """Build an environment from the CLI's `rl_env_type` and `rl_env_config` (a dict or JSON string).

    text_generation: prompts|prompts_path, reward_fn (a rl.rewards.answers name or 'module:function'), max_length, ...
    multi_objective: prompts|prompts_path, reward_components ({name: builtin|'module:function'} or a list of
      names; default: the keys of reward_weights), reward_weights ({name: weight} or JSON string)
    preference_comparison: prompts|prompts_path and reward_model_path (an HF sequence classifier) or
      preference_model / human_feedback_fn objects
    math: the keyword arguments of create_math_problem_env; code: those of create_code_generation_env;
    tool_math: those of rl.envs.tool_math.create_tool_math_env (multi-turn: the policy may call tools).
    """
    if isinstance(config, str):
        try:
            config = json.loads(config) if config.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"rl_env_config is not valid JSON ({e}); example: '{{\"difficulty\": \"tiny\"}}'") from e
    config = dict(config or {})
    if env_type not in ENV_TYPES:
        raise ValueError(f"unknown environment type {env_type!r}; choose one of {', '.join(ENV_TYPES)}")
    try:
        if env_type == "math":
            return create_math_problem_env(tokenizer, **config)
        if env_type == "code":
            return create_code_generation_env(tokenizer, **config)
        if env_type == "tool_math":
            from rl.envs.tool_math import create_tool_math_env

            return create_tool_math_env(tokenizer, **config)
        prompts, metadata = _prompts_from(config)
        if env_type == "text_generation":
            fn = config.pop("reward_fn", None)
            if isinstance(fn, str):
                fn = RF.get_reward_fn(fn, custom=config.pop("custom_reward", None))
            return TextGenerationEnv(tokenizer, prompts, reward_fn=fn, metadata=metadata, **config)
        if env_type == "multi_objective":
            weights = config.pop("reward_weights", None) or {}
            if isinstance(weights, str):
                weights = json.loads(weights)
            comps = config.pop("reward_components", None) or list(weights)
            if isinstance(comps, (list, tuple)):
                comps = {c: c for c in comps}
            if not comps:
                raise ValueError("multi_objective needs reward_components or reward_weights, e.g. "
                                 "{\"reward_weights\": {\"correctness\": 1.0, \"formatting\": 0.1}}")
            components = {name: _component(name, spec) for name, spec in comps.items()}
            return MultiObjectiveRewardEnv(tokenizer, prompts, reward_components=components, reward_weights=weights,
                                           metadata=metadata, **config)
        # preference_comparison
        path = config.pop("reward_model_path", None)
        if path is not None and config.get("preference_model") is None:
            config["preference_model"] = load_causal_lm(path, dtype="float32", task="classifier",
                                                        trust_remote_code=config.pop("trust_remote_code", False))
            config.setdefault("reward_tokenizer", load_tokenizer(path))
        return PreferenceComparisonEnv(tokenizer, prompts, metadata=metadata, **config)
    except TypeError as e:
        raise ValueError(f"bad config for environment {env_type!r}: {e}") from e
