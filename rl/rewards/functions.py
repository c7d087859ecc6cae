"""The named reward functions (`reward_fn` / `reward_funcs` in a recipe, `--rl-reward-fn` on the CLI) and
the loader of a user's own.

Every reward function here has the trainers' batched signature

    reward_fn(prompts: list[str], responses: list[str], metadata: list[dict] | None = None) -> list[float]

(the reference's PPOTrainer `reward_fn`), so a function, an environment (`env.__call__`) or a user's
`module:function` are interchangeable.

`REWARD_FUNCTIONS`: default (the reference's words / 100), length_penalty (-|words - target| / target),
correctness (1.0 when the answer equals metadata[i]["answer"], by rl.rewards.answers.answers_match).
`get_reward_fn(name)` resolves one of them, 'custom' with `custom='module:function'`, or a
`module:function` string directly, which `load_custom_reward` imports with importlib (the module must
be importable; no code string is ever evaluated).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from rl.algos.registry import import_function
from rl.rewards.answers import answers_match

RewardFn = Callable[..., list]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- named reward functions (CLI)

def needs(*columns: str):
    """Declare the metadata columns a reward function reads (`fn.required_columns`): the trainers check that the
    prompt data, or the environment's prompts, carry them before any model loads (`reward_columns_problem`)."""
    def mark(fn):
        fn.required_columns = columns
        return fn
    return mark


def required_columns(fn) -> tuple[str, ...]:
    """The columns `fn` declared with `needs` (a functools.partial: its function's), else ()."""
    return getattr(fn, "required_columns", None) or getattr(getattr(fn, "func", None), "required_columns", ())


def default_reward(prompts: Sequence[str], responses: Sequence[str], metadata=None) -> list[float]:
    """Length-based, as the reference documents: words / 100 (no reward model needed)."""
    return [len(r.split()) / 100.0 for r in responses]


def length_penalty_reward(prompts: Sequence[str], responses: Sequence[str], metadata=None,
                          target_words: int = 50) -> list[float]:
    """-|words - target| / target: 0 at the target length, -1 for an empty response."""
    return [-abs(len(r.split()) - target_words) / target_words for r in responses]


@needs("answer")
def correctness_reward(prompts: Sequence[str], responses: Sequence[str], metadata=None) -> list[float]:
    """1.0 when the response's answer equals `metadata[i]["answer"]` (numerically if numeric), else 0.0."""
    if metadata is None or len(metadata) != len(responses):
        raise ValueError("correctness reward needs metadata: one dict with an 'answer' per response "
                         "(add an 'answer' column to the prompt data)")
    out = []
    for i, (resp, meta) in enumerate(zip(responses, metadata)):
        if not isinstance(meta, dict) or "answer" not in meta:
            raise ValueError(f"correctness reward: metadata[{i}] has no 'answer' key")
        out.append(1.0 if answers_match(resp, meta["answer"]) else 0.0)
    return out


def char_fraction_reward(prompts: Sequence[str], responses: Sequence[str], metadata=None,
                         char: str = "a") -> list[float]:
    """Fraction of the response's characters equal to `char` (0 for an empty response); the optimum
    1.0 is a response of only that character. Used by recipes/tiny/ppo.yaml as
    `reward_fn: custom, custom_reward: rl.rewards.functions:char_fraction_reward`."""
    return [r.count(char) / len(r) if r else 0.0 for r in responses]


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "default": default_reward,
    "length_penalty": length_penalty_reward,
    "correctness": correctness_reward,
}


def load_custom_reward(spec: str) -> RewardFn:
    """Import `module:function` (e.g. `my_rewards:score`) with importlib; the module must be importable
    (on PYTHONPATH or in the working directory). No code strings are evaluated."""
    return import_function(spec, "reward")


def get_reward_fn(name: str, custom: str | None = None, **kwargs) -> RewardFn:
    """The reward function for a CLI name: default | length_penalty | correctness | custom (with
    `custom='module:function'`), or a `module:function` string directly. Extra kwargs are bound."""
    import functools

    if name == "custom":
        if not custom:
            raise ValueError("reward 'custom' needs a 'module:function' spec (e.g. custom='my_rewards:score')")
        fn = load_custom_reward(custom)
    elif name in REWARD_FUNCTIONS:
        fn = REWARD_FUNCTIONS[name]
    elif isinstance(name, str) and ":" in name:
        fn = load_custom_reward(name)
    else:
        raise ValueError(f"unknown reward function {name!r}; choose one of "
                         f"{', '.join([*REWARD_FUNCTIONS, 'custom'])} or give 'module:function'")
    return functools.partial(fn, **kwargs) if kwargs else fn


def reward_columns_problem(cfg, present, location: str, what: str = "the data") -> str | None:
    """Why a configured reward function (GRPO's reward_funcs, PPO's reward_fn) cannot score these prompts: the
    first column it declared (`needs`) that the prompts' columns `present` lack; None when
    every one is there. Checked before any model loads, so a run does not stop at its first reward."""
    names = [*(getattr(cfg, "reward_funcs", None) or []), *([cfg.reward_fn] if getattr(cfg, "reward_fn", None) else [])]
    for name in names:
        try:
            fn = get_reward_fn(name, custom=getattr(cfg, "custom_reward", None))
        except ValueError:
            continue  # an unknown name is its own error, where the reward sources are built
        missing = [c for c in required_columns(fn) if c not in present]
        if missing:
            return (f"{location}: reward function '{name}' reads column '{missing[0]}', which {what} lacks (columns "
                    f"present: {', '.join(sorted(present)) or 'none'}); give every row a column '{missing[0]}', or "
                    f"choose another reward")
    return None
