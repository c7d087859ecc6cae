"""The named reward functions (`reward_fn` / `reward_funcs` in a recipe, `--rl-reward-fn` on the CLI) and
the loader of a user's own.

Every reward function here has the trainers' batched signature

    reward_fn(prompts: list[str], responses: list[str], metadata: list[dict] | None = None) -> list[float]

(the reference's PPOTrainer `reward_fn`), so a function, an environment (`env.__call__`) or a user's
`module:function` are interchangeable.

`REWARD_FUNCTIONS`: default (the reference's words / 100), length_penalty (-|words - target| / target),
correctness (1.0 when the answer equals metadata[i]["answer"], by rl.rewards.answers.answers_match), and TRL's by
TRL's names (`TRL_REWARD_FUNCTIONS`, in TRL's signature f(completions, **columns)): accuracy_reward,
reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment; TRL's factories
get_cosine_scaled_reward and get_repetition_penalty_reward for Python use.
`get_reward_fn(name)` resolves one of them, 'custom' with `custom='module:function'`, or a
`module:function` string directly, which `load_custom_reward` imports with importlib (the module must
be importable; no code string is ever evaluated).
"""

from __future__ import annotations

import logging
import math
import re
import threading
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
    elif isinstance(name, str) and "." in name:  # TRL's form of a function of a module: package.module.function
        fn = load_custom_reward(":".join(name.rsplit(".", 1)))
    else:
        raise ValueError(f"unknown reward function {name!r}; choose one of "
                         f"{', '.join([*REWARD_FUNCTIONS, 'custom'])} or give 'module:function' (or TRL's "
                         f"'module.function')")
    return functools.partial(fn, **kwargs) if kwargs else fn


# ---------------------------------------------------------------- TRL's reward functions (trl.rewards, TRL 1.16)
# By TRL's names, so that a TRL recipe's `reward_funcs: [accuracy_reward, think_format_reward]` runs unchanged; written
# here (TRL is no dependency) with TRL's signature `f(completions, **columns)` and meanings, cross-checked against
# trl.rewards on identical inputs (tests/unit/rewards/test_trl_rewards.py). A completion is a string here, or TRL's
# conversational form (a list whose first message's "content" is the text).

def _content(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def _math_timeouts() -> tuple[int | None, int | None]:
    """math-verify's (parsing, verify) timeouts in seconds: its signal alarm works on the main thread only, so off
    it (the trainers score rewards on worker threads) there is none, as TRL does; reward_timeout bounds the call."""
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    for name in ("math_verify.parser", "math_verify.grader"):  # their "timeout is disabled" line, once per call
        logging.getLogger(name).setLevel(logging.ERROR)
    return None, None


def _verified(content: str, solution: str) -> float | None:
    """1.0 / 0.0: does `content` state `solution` (math-verify, TRL's extraction: the first \\boxed or LaTeX
    expression, units normalised); None when the solution itself does not parse (TRL skips the example)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    parse_s, verify_s = _math_timeouts()
    gold = parse(solution, parsing_timeout=parse_s)
    if not gold:
        return None
    answer = parse(content, extraction_config=[LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False)],
        extraction_mode="first_match", parsing_timeout=parse_s)
    return float(verify(gold, answer, timeout_seconds=verify_s))


@needs("solution")
def accuracy_reward(completions, solution, **kwargs) -> list[float | None]:
    """TRL's accuracy_reward: 1.0 when the completion's math answer equals the row's `solution` (math-verify), 0.0
    otherwise, None (no score) when the solution does not parse."""
    return [_verified(_content(c), s) for c, s in zip(completions, solution, strict=True)]


@needs("solution")
def reasoning_accuracy_reward(completions, solution, reasoning_delimiters=None, **kwargs) -> list[float | None]:
    """TRL's reasoning_accuracy_reward: accuracy_reward on what follows the reasoning (after the first delimiter
    found, default `</think>`); 0.0 when no delimiter closes the reasoning."""
    out = []
    for c, s in zip(completions, solution, strict=True):
        text = _content(c)
        delimiter = next((d for d in reasoning_delimiters or ["</think>"] if d in text), None)
        out.append(0.0 if delimiter is None else _verified(text.split(delimiter)[-1], s))
    return out


def think_format_reward(completions, **kwargs) -> list[float]:
    """TRL's think_format_reward: 1.0 when the completion starts with one <think>...</think> block, else 0.0."""
    pattern = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)
    return [1.0 if pattern.match(_content(c)) else 0.0 for c in completions]


class _CosineScaled:
    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, min_wrong: float, max_wrong: float, min_correct: float, max_correct: float):
        self.max_len, self.wrong, self.correct = max_len, (max_wrong, min_wrong), (min_correct, max_correct)

    def __call__(self, completions, solution, completion_ids, **kwargs) -> list[float | None]:
        out = []
        for ok, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if ok is None:
                out.append(None)
                continue
            low, high = self.correct if ok else self.wrong  # wrong: shorter is penalised more
            out.append(float(low + 0.5 * (high - low) * (1.0 + math.cos(min(len(ids) / self.max_len, 1.0) * math.pi))))
        return out


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0):
    """TRL's get_cosine_scaled_reward ("Demystifying Long Chain-of-Thought Reasoning", App. C.1): accuracy scaled by
    the completion's token length on a cosine from the short to the long bound (a correct answer earns more when
    short, a wrong one loses more when short); lengths past max_len stay at the long bound."""
    return _CosineScaled(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class _RepetitionPenalty:
    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.n, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        out = []
        for ids in completion_ids:
            grams = [tuple(ids[i:i + self.n]) for i in range(len(ids) - self.n + 1)]
            repeated = 1 - len(set(grams)) / len(grams) if grams else 0.0
            out.append(repeated * self.max_penalty if repeated else 0.0)
        return out


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0):
    """TRL's get_repetition_penalty_reward: (1 - unique / all token n-grams) x max_penalty (<= 0); 0.0 for a
    completion shorter than one n-gram."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")
    return _RepetitionPenalty(ngram_size, max_penalty)


class _SoftOverlong:
    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_len, self.cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        start = self.max_len - self.cache
        return [0.0 if len(ids) <= start else (start - len(ids)) / self.cache if len(ids) <= self.max_len else -1.0
                for ids in completion_ids]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int):
    """TRL's get_soft_overlong_punishment (DAPO eq. 13): 0 up to max_completion_len - soft_punish_cache tokens, then
    linearly down to -1 at max_completion_len, -1 beyond."""
    return _SoftOverlong(max_completion_len, soft_punish_cache)


# TRL's `trl grpo` script's names for reward_funcs (its reward_funcs_registry, the soft overlong punishment with that
# script's values 1280 and 256)
TRL_REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "accuracy_reward": accuracy_reward,
    "reasoning_accuracy_reward": reasoning_accuracy_reward,
    "think_format_reward": think_format_reward,
    "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
}
REWARD_FUNCTIONS.update(TRL_REWARD_FUNCTIONS)


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
