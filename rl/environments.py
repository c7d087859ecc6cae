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
`fn(prompts, responses, metadata=None) -> list[float]` (rl.rewards' signature, recognised by its first
parameter being named `prompts`).

Deviations from the reference implementation (see shared/reference/README.md): the math environment
parses the answer and compares numbers (the substring "correct" earns nothing), the code environment
rewards only non-empty parseable code and runs unit tests only in `rl.sandbox`, which returns the
candidate's outputs while the expected values stay in the trainer (see `run_unit_tests`), and the preference
environment scores with the given model or callback, never a random number.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import logging
import math
import operator
import random
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from rl import rewards as R
from rl import sandbox
from rl.config import ConfigError
from rl.data import DataError, read_records
from rl.models import load_causal_lm, load_tokenizer

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------ dataclasses


@dataclass
class Observation:
    """What the policy sees: token ids (1, T) of prompt + completion so far, and the prompt."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """Result of `env.step()`: terminal reward (0.0 before the end), `metrics` has `reward_<name>`."""

    reward: float
    done: bool
    next_observation: Observation | None = None
    info: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode as collected by `run_episode`."""

    observations: list[Observation]
    actions: list[torch.Tensor]
    rewards: list[float]
    logprobs: list[torch.Tensor]
    done: bool
    total_reward: float
    metrics: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------- reward adapters


def _is_batched(fn: Callable) -> bool:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] in ("prompts", "batch_prompts")


def batch_reward(fn: Callable) -> Callable[[list[str], list[str], list[dict]], list[float]]:
    """Adapt a reward function to the batched form `(prompts, gens, metas) -> list[float]`.

    Accepted: per-sample `fn(prompt, generated, full_text[, metadata])`; batched
    `fn(prompts, responses[, metadata])`; TRL-style `fn(prompts, completions, **columns)`, which gets each
    metadata key as a list-valued keyword. A None value (TRL's "not applicable") counts as 0.0."""
    batched = _is_batched(fn)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    has_meta = any(p.name == "metadata" for p in params)
    has_varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)

    def call(prompts, gens, metas):
        if batched:
            if has_meta:
                out = fn(list(prompts), list(gens), metadata=list(metas))
            elif has_varkw:
                keys = sorted({k for m in metas for k in m})
                out = fn(list(prompts), list(gens), **{k: [m.get(k) for m in metas] for k in keys})
            else:
                out = fn(list(prompts), list(gens))
            if isinstance(out, torch.Tensor):
                out = out.detach().float().flatten().tolist()
            out = list(out)
        else:
            out = [fn(p, g, p + g, metadata=m) if (has_meta or has_varkw) else fn(p, g, p + g)
                   for p, g, m in zip(prompts, gens, metas)]
        if len(out) != len(gens):
            raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned {len(out)} values "
                             f"for {len(gens)} completions")
        return [0.0 if v is None else float(v) for v in out]

    return call


def length_reward(prompt: str, generated: str, full_text: str) -> float:
    """The reference's default reward: words / 100."""
    return len(generated.split()) / 100.0


# ------------------------------------------------------------------------------------ base class


class TextGenerationEnv:
    """Prompts in, completions scored by `reward_fn` (default: length-based, words / 100)."""

    def __init__(self, tokenizer, prompts: Sequence[str], max_length: int = 512, reward_fn: Callable | None = None,
                 stop_sequences: Sequence[str] | None = None, temperature: float = 1.0,
                 metadata: Sequence[dict] | None = None, seed: int = 0):
        if not prompts:
            raise ValueError("the environment needs at least one prompt")
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"metadata has {len(metadata)} entries for {len(prompts)} prompts; "
                             "give one dict per prompt")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.metadata = [dict(m) for m in metadata] if metadata is not None else [{} for _ in self.prompts]
        self.max_length = int(max_length)
        self.reward_fn = reward_fn or length_reward
        self.stop_sequences = [s for s in (stop_sequences or []) if s]
        self.temperature = float(temperature)
        self._rng = random.Random(seed)
        self._next_index = 0
        self._meta_by_prompt = {p: m for p, m in zip(self.prompts, self.metadata)}
        self._batch_reward = batch_reward(self.reward_fn)
        self._clear_episode()

    # ---------------------------------------------------------------- scoring (override in subclasses)

    def _score_batch(self, prompts: list[str], gens: list[str], metas: list[dict]):
        rewards = self._batch_reward(prompts, gens, metas)
        return rewards, {"reward": list(rewards)}

    # ---------------------------------------------------------------- batched episode API

    def sample_prompts(self, n: int, seed: int | None = None) -> list[dict]:
        """`n` prompts with their metadata, deterministic in `seed`; without repeats while n <= pool."""
        rng = random.Random(seed) if seed is not None else self._rng
        pool = range(len(self.prompts))
        idx = rng.sample(pool, n) if n <= len(self.prompts) else [rng.choice(pool) for _ in range(n)]
        return [{"prompt": self.prompts[i], "metadata": dict(self.metadata[i])} for i in idx]

    def truncate(self, completion: str) -> str:
        """The completion cut before its first stop sequence (what gets scored)."""
        cut = len(completion)
        for s in self.stop_sequences:
            pos = completion.find(s)
            if 0 <= pos < cut:
                cut = pos
        return completion[:cut]

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              metadata: Sequence[dict] | None = None) -> tuple[list[float], dict[str, list[float]]]:
        """Rewards (one float per completion) and per-completion metrics ({name: list[float]}).

        Missing or empty metadata is looked up by prompt text in the environment's own prompts. The
        batched API never tokenizes, so an environment built with tokenizer=None can score."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions; pass one prompt per "
                             "completion (repeat a prompt for each of its generations)")
        if metadata is None:
            metadata = [None] * len(prompts)
        elif len(metadata) != len(prompts):
            raise ValueError(f"metadata has {len(metadata)} entries for {len(prompts)} completions")
        metadata = [m if m else self._meta_by_prompt.get(p, {}) for p, m in zip(prompts, metadata)]
        gens = [self.truncate(c) for c in completions]
        rewards, metrics = self._score_batch(list(prompts), gens, [dict(m or {}) for m in metadata])
        return [float(r) for r in rewards], metrics

    def __call__(self, prompts, responses, metadata=None) -> list[float]:
        return self.score(prompts, responses, metadata)[0]

    def reward_functions(self) -> tuple[list[Callable], list[float]]:
        """TRL-style reward functions `f(prompts, completions, **columns) -> list[float]` (one per reward
        component, named after it) and their weights, for trainers that weight several rewards
        themselves (GRPO). Metadata keys arrive as list-valued keyword columns, e.g. `answer=[...]`;
        conversational completions (lists of messages) are reduced to the last message's content."""
        names = list(getattr(self, "reward_weights", {}) or {}) or ["reward"]
        weights = [float(getattr(self, "reward_weights", {}).get(n, 1.0)) for n in names]

        def make(name):
            def reward_fn(prompts, completions, **columns):
                n = len(completions)
                metas = [{k: v[i] for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == n}
                         for i in range(n)]
                texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
                ptexts = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
                if not any(metas):
                    metas = [dict(self._meta_by_prompt.get(p, {})) for p in ptexts]
                components = getattr(self, "_components", None)
                if components:  # only this component: the others may be expensive (sandboxed tests)
                    return components[name](ptexts, [self.truncate(t) for t in texts], metas)
                return self.score(ptexts, texts, metas)[0]

            reward_fn.__name__ = name
            return reward_fn

        return [make(n) for n in names], weights

    # ---------------------------------------------------------------- per-token API (reference)

    def _clear_episode(self):
        self.current_prompt: str | None = None
        self.current_metadata: dict = {}
        self._prompt_ids: list[int] = []
        self._gen_ids: list[int] = []
        self.steps = 0
        self.done = False
        self.last_reward: float | None = None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _observation(self, ids: list[int], **meta) -> Observation:
        t = torch.tensor([ids], dtype=torch.long)
        return Observation(input_ids=t, attention_mask=torch.ones_like(t), prompt=self.current_prompt,
                           metadata={**self.current_metadata, **meta})

    def reset(self, index: int | None = None) -> Observation:
        """Start an episode on the next prompt (round robin) or on prompt `index`."""
        i = self._next_index if index is None else index
        self._next_index = (i + 1) % len(self.prompts)
        self._clear_episode()
        self.current_prompt = self.prompts[i]
        self.current_metadata = dict(self.metadata[i])
        self._prompt_ids = self._encode(self.current_prompt)
        if len(self._prompt_ids) >= self.max_length:
            raise ValueError(f"prompt {i} has {len(self._prompt_ids)} tokens, not below max_length={self.max_length}; "
                             "raise max_length or shorten the prompt")
        return self._observation(self._prompt_ids, prompt_idx=i)

    @staticmethod
    def _as_ids(action) -> list[int]:
        if isinstance(action, torch.Tensor):
            return [int(v) for v in action.flatten().tolist()]
        if isinstance(action, int):
            return [action]
        return [int(v) for v in action]

    @property
    def generated_text(self) -> str:
        return self.tokenizer.decode(self._gen_ids, skip_special_tokens=True)

    def step(self, action_token) -> StepResult:
        """Append one token (an int, a 0-d/1-d tensor, or several ids) and end the episode at EOS, a stop
        sequence or max_length; the reward is computed on the final step."""
        if self.current_prompt is None:
            raise RuntimeError("call env.reset() before env.step()")
        if self.done:
            raise RuntimeError("the episode is over; call env.reset() to start a new one")
        ids = self._as_ids(action_token)
        eos = self.tokenizer.eos_token_id
        stop_reason = None
        if eos is not None and eos in ids:
            ids, stop_reason = ids[: ids.index(eos) + 1], "eos"
        self._gen_ids.extend(ids)
        self.steps += 1
        text = self.generated_text
        if stop_reason is None and any(s in text for s in self.stop_sequences):
            stop_reason = "stop_sequence"
        if stop_reason is None and len(self._prompt_ids) + len(self._gen_ids) >= self.max_length:
            stop_reason = "max_length"
        info = {"generated_text": text, "steps": self.steps}
        metrics = {"length": float(len(self._gen_ids))}
        if stop_reason is None:
            metrics["reward"] = 0.0
            return StepResult(reward=0.0, done=False, info=info, metrics=metrics,
                              next_observation=self._observation(self._prompt_ids + self._gen_ids, steps=self.steps))
        self.done = True
        rewards, comp = self._score_batch([self.current_prompt], [self.truncate(text)], [self.current_metadata])
        reward = float(rewards[0])
        self.last_reward = reward
        metrics.update({k: float(v[0]) for k, v in comp.items()})
        metrics["reward"] = reward
        info["stop_reason"] = stop_reason
        return StepResult(reward=reward, done=True, next_observation=None, info=info, metrics=metrics)

    def sample_action(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample a token id from next-token `logits` (V,) or (1, V) at the environment's temperature."""
        probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float() / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).flatten()[0]

    def render(self) -> str:
        """The current episode as text: prompt, completion so far, steps (and reward once done)."""
        out = f"Prompt: {self.current_prompt}\nGenerated: {self.generated_text}\nSteps: {self.steps}"
        if self.done:
            out += f"\nReward: {self.last_reward:.4f}"
        return out


def run_episode(env: TextGenerationEnv, policy: Callable[[Observation], tuple[Any, Any]],
                index: int | None = None, max_steps: int | None = None) -> Trajectory:
    """Roll one episode: `policy(obs) -> (token, logprob)` until done (or `max_steps`)."""
    obs = env.reset(index)
    observations, actions, rewards, logprobs = [], [], [], []
    result = None
    for _ in range(max_steps or env.max_length):
        token, logprob = policy(obs)
        result = env.step(token)
        observations.append(obs)
        actions.append(torch.as_tensor(token))
        logprobs.append(torch.as_tensor(logprob))
        rewards.append(result.reward)
        if result.done:
            break
        obs = result.next_observation
    done = bool(result and result.done)
    return Trajectory(observations=observations, actions=actions, rewards=rewards, logprobs=logprobs, done=done,
                      total_reward=float(sum(rewards)), metrics=dict(result.metrics) if result else {})


# --------------------------------------------------------------------------- multi-objective


class MultiObjectiveRewardEnv(TextGenerationEnv):
    """Reward = sum_k w_k * component_k; each component reported as `reward_<name>`, plus `reward_total`."""

    def __init__(self, tokenizer, prompts: Sequence[str], reward_components: dict[str, Callable],
                 reward_weights: dict[str, float] | None = None, **kwargs):
        if not reward_components:
            raise ValueError("reward_components must name at least one reward function")
        weights = dict(reward_weights or {})
        unknown = sorted(set(weights) - set(reward_components))
        if unknown:
            raise ValueError(f"reward_weights name {', '.join(unknown)} but the components are "
                             f"{', '.join(reward_components)}; weight only existing components")
        self.reward_components = dict(reward_components)
        self.reward_weights = {k: float(weights.get(k, 1.0)) for k in self.reward_components}
        self._components = {k: batch_reward(fn) for k, fn in self.reward_components.items()}
        kwargs.setdefault("reward_fn", None)
        super().__init__(tokenizer, prompts, **kwargs)

    def _score_batch(self, prompts, gens, metas):
        metrics, total = {}, [0.0] * len(gens)
        for name, fn in self._components.items():
            values = fn(prompts, gens, metas)
            metrics[f"reward_{name}"] = values
            w = self.reward_weights[name]
            total = [t + w * v for t, v in zip(total, values)]
        metrics["reward_total"] = list(total)
        return total, metrics


# ----------------------------------------------------------------------------- preferences


class PreferenceComparisonEnv(TextGenerationEnv):
    """Two responses per prompt; the second `step()` compares them.

    preference_model: an HF sequence classifier (scored on prompt + response with `reward_tokenizer`,
    default the env's tokenizer), anything with `score(texts) -> tensor|list`, or a callable
    `texts -> scores`. The pair's reward is the Bradley-Terry margin score(r1) - score(r2) (positive when
    response 1 is preferred; `metrics["preference_prob"]` is its sigmoid).
    human_feedback_fn: `fn(prompt, response1, response2) -> float`, positive when response 1 is preferred;
    used when no preference_model is given. One of the two is required.
    Batched API: `score()` gives each completion its model score (needs preference_model);
    `compare(prompts, a, b)` scores pairs with either source.
    """

    def __init__(self, tokenizer, prompts: Sequence[str], preference_model=None,
                 human_feedback_fn: Callable | None = None, max_length: int = 512, reward_tokenizer=None,
                 batch_size: int = 8, **kwargs):
        if preference_model is None and human_feedback_fn is None:
            raise ValueError("PreferenceComparisonEnv needs a preference_model (reward model or scorer) or a "
                             "human_feedback_fn(prompt, response1, response2); it never guesses a preference")
        self.preference_model = preference_model
        self.human_feedback_fn = human_feedback_fn
        self.reward_tokenizer = reward_tokenizer
        self.batch_size = int(batch_size)
        super().__init__(tokenizer, prompts, max_length=max_length, **kwargs)
        self.responses: list[str] = []

    # ------------------------------------------------------------ scoring sources

    def _is_hf_model(self) -> bool:
        m = self.preference_model
        return isinstance(m, torch.nn.Module) and hasattr(m, "config") and hasattr(m.config, "num_labels")

    @torch.no_grad()
    def model_scores(self, texts: list[str]) -> list[float]:
        """Scalar preference-model score of each text."""
        m = self.preference_model
        if m is None:
            raise ValueError("no preference_model given; scoring single responses needs one")
        if self._is_hf_model():
            tok = self.reward_tokenizer or self.tokenizer
            device = next(m.parameters()).device
            was_training = m.training
            m.eval()
            out = []
            for i in range(0, len(texts), self.batch_size):
                enc = tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                          max_length=self.max_length)
                logits = m(input_ids=enc["input_ids"].to(device),
                           attention_mask=enc["attention_mask"].to(device)).logits
                out.extend(logits[:, 0].float().cpu().tolist())
            m.train(was_training)
            return out
        scorer = m.score if callable(getattr(m, "score", None)) else m
        if not callable(scorer):
            raise TypeError("preference_model must be an HF sequence classifier, have score(texts), or be callable")
        scores = scorer(list(texts))
        if isinstance(scores, torch.Tensor):
            scores = scores.detach().float().flatten().cpu().tolist()
        scores = [float(s) for s in scores]
        if len(scores) != len(texts):
            raise ValueError(f"preference_model returned {len(scores)} scores for {len(texts)} texts")
        return scores

    def compare(self, prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str]):
        """Batched pair comparison: rewards (positive when a is preferred) and metrics."""
        if not (len(prompts) == len(responses_a) == len(responses_b)):
            raise ValueError("compare needs as many responses_a and responses_b as prompts")
        if self.preference_model is not None:
            s = self.model_scores([p + r for p, r in zip(prompts, responses_a)]
                                  + [p + r for p, r in zip(prompts, responses_b)])
            sa, sb = s[: len(prompts)], s[len(prompts):]
            margins = [a - b for a, b in zip(sa, sb)]
            return margins, {"score_1": sa, "score_2": sb,
                             "preference_prob": [1 / (1 + math.exp(-x)) for x in margins]}
        values = [float(self.human_feedback_fn(p, a, b)) for p, a, b in zip(prompts, responses_a, responses_b)]
        return values, {"human_preference": values}

    def _score_batch(self, prompts, gens, metas):
        scores = self.model_scores([p + g for p, g in zip(prompts, gens)])
        return scores, {"reward_model_score": list(scores)}

    # ------------------------------------------------------------ per-response API (reference)

    def reset(self, index: int | None = None) -> Observation:
        obs = super().reset(index)
        self.responses = []
        obs.metadata["comparison_round"] = 0
        return obs

    def step(self, action) -> StepResult:
        """Submit a whole response (token ids or a string); the second one ends the episode."""
        if self.current_prompt is None:
            raise RuntimeError("call env.reset() before env.step()")
        if self.done:
            raise RuntimeError("the comparison is over; call env.reset() to start a new one")
        if isinstance(action, str):
            text = action
        else:
            text = self.tokenizer.decode(self._as_ids(action), skip_special_tokens=True)
        self.responses.append(self.truncate(text))
        self.steps += 1
        info = {"responses": list(self.responses)}
        if len(self.responses) < 2:
            obs = self._observation(self._prompt_ids, comparison_round=1)
            return StepResult(reward=0.0, done=False, next_observation=obs, info=info,
                              metrics={"num_responses": 1.0})
        rewards, metrics = self.compare([self.current_prompt], [self.responses[0]], [self.responses[1]])
        reward = rewards[0]
        self.done, self.last_reward = True, reward
        info["preferred"] = 0 if reward >= 0 else 1
        out = {k: float(v[0]) for k, v in metrics.items()}
        out.update(num_responses=2.0, reward=reward)
        return StepResult(reward=reward, done=True, next_observation=None, info=info, metrics=out)

    def render(self) -> str:
        lines = [f"Prompt: {self.current_prompt}"]
        lines += [f"Response {i + 1}: {r}" for i, r in enumerate(self.responses)]
        if self.done:
            lines.append(f"Preference (reward for response 1): {self.last_reward:.4f}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------- math

MATH_DIFFICULTIES = ("tiny", "easy", "medium", "hard")
_MATH_TEMPLATES = {
    "plain": "{problem}=",
    "answer": "Question: What is {problem}?\nThink briefly, then finish with a line 'Answer: <number>'.\n",
    "boxed": "Question: What is {problem}?\nPut the final answer in \\boxed{{}}.\n",
}


def _fmt_fraction(x) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def generate_arithmetic_problem(rng: random.Random, difficulty: str = "easy") -> tuple[str, str]:
    """One (problem, answer) pair. tiny: a+b with digits 0-9; easy: a+b or a-b up to 20 (answers may be
    negative); medium: +, -, * up to 99; hard: (a o b) o c up to 99 including exact division (answers
    may be fractions like '7/3')."""
    from fractions import Fraction

    if difficulty == "tiny":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a}+{b}", str(a + b)
    if difficulty == "easy":
        a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-")
        return f"{a}{op}{b}", str(a + b if op == "+" else a - b)
    if difficulty == "medium":
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
        return f"{a}{op}{b}", str({"+": a + b, "-": a - b, "*": a * b}[op])
    if difficulty == "hard":
        a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 20)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*/")
        inner = {"+": a + b, "-": a - b, "*": a * b}[op1]
        value = {"+": inner + c, "-": inner - c, "*": inner * c, "/": Fraction(inner, c)}[op2]
        return f"({a}{op1}{b}){op2}{c}", _fmt_fraction(Fraction(value))
    raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(MATH_DIFFICULTIES)}")


def problem_split(problem: str, holdout_fraction: float) -> str:
    """'test' for a stable `holdout_fraction` of problems (by CRC32 of the text), else 'train'."""
    return "test" if zlib.crc32(problem.encode()) % 10_000 < holdout_fraction * 10_000 else "train"


class MathProblemEnv(MultiObjectiveRewardEnv):
    """Arithmetic or JSONL math problems; components `correctness` (1.0 when the extracted answer equals
    metadata['answer'] numerically) and `formatting` (1.0 when the completion has the expected answer
    format); the default weights are 1.0 and 0.1."""

    def __init__(self, tokenizer, problems: list[dict], answer_format: str, prompt_template: str,
                 correctness_weight: float, formatting_weight: float, generator: Callable | None = None, **kwargs):
        if answer_format not in _MATH_TEMPLATES:
            raise ValueError(f"unknown answer_format {answer_format!r}; choose one of {', '.join(_MATH_TEMPLATES)}")
        self.answer_format = answer_format
        self.prompt_template = prompt_template
        self._generator = generator  # (rng) -> (problem, answer) for fresh problems, None for a fixed set
        self.problems = problems
        prompts = [self.make_prompt(p["problem"]) for p in problems]
        metadata = [{"problem": p["problem"], "answer": p["answer"]} for p in problems]

        def correctness(prompts, responses, metadata):
            return R.correctness_reward(prompts, responses, metadata)

        def formatting(prompt, generated, full_text):
            return 1.0 if R.has_answer_format(generated, answer_format) else 0.0

        super().__init__(tokenizer, prompts, reward_components={"correctness": correctness, "formatting": formatting},
                         reward_weights={"correctness": correctness_weight, "formatting": formatting_weight},
                         metadata=metadata, **kwargs)

    def make_prompt(self, problem: str) -> str:
        return self.prompt_template.format(problem=problem)

    def reference_completion(self, answer: str) -> str:
        """The ideal completion for an answer in this environment's format (e.g. for SFT warm-up)."""
        formats = {"plain": f"{answer}", "answer": f"Answer: {answer}", "boxed": f"\\boxed{{{answer}}}"}
        return formats[self.answer_format]

    def sample_prompts(self, n: int, seed: int | None = None) -> list[dict]:
        """Fresh generated problems of this split when the problems are generated, else from the set."""
        if self._generator is None:
            return super().sample_prompts(n, seed)
        rng = random.Random(seed) if seed is not None else self._rng
        out = []
        for _ in range(n):
            problem, answer = self._generator(rng)
            out.append({"prompt": self.make_prompt(problem), "metadata": {"problem": problem, "answer": answer}})
        return out

    def sft_records(self, n: int | None = None, seed: int | None = None) -> list[dict]:
        """{"prompt", "completion"} pairs with reference completions (all fixed problems when n is None)."""
        batch = ([{"prompt": p, "metadata": m} for p, m in zip(self.prompts, self.metadata)] if n is None
                 else self.sample_prompts(n, seed))
        return [{"prompt": b["prompt"], "completion": self.reference_completion(b["metadata"]["answer"])}
                for b in batch]

    def _score_batch(self, prompts, gens, metas):
        missing = [i for i, m in enumerate(metas) if "answer" not in m]
        if missing:
            raise ValueError(f"math environment: no 'answer' for completion {missing[0]} (prompt "
                             f"{prompts[missing[0]]!r}); pass metadata from env.sample_prompts()")
        return super()._score_batch(prompts, gens, metas)


def load_math_problems(path: str, max_examples: int | None = None) -> list[dict]:
    """{"problem", "answer"} rows of a JSONL/JSON/CSV/parquet file; answers may be numbers or strings."""
    rows = read_records(path)
    out = []
    for row in rows[:max_examples] if max_examples else rows:
        where = f"{path}:{row.get('_line')}"
        problem, answer = row.get("problem"), row.get("answer")
        if not isinstance(problem, str) or not problem.strip():
            raise DataError(f"{where}: 'problem' must be a non-empty string")
        if answer is None or isinstance(answer, (bool, list, dict)) or str(answer).strip() == "":
            raise DataError(f"{where}: 'answer' must be a number or a non-empty string")
        out.append({"problem": problem, "answer": str(answer).strip()})
    if not out:
        raise DataError(f"{path}: no problems")
    return out


def create_math_problem_env(tokenizer, problems_path: str | None = None, num_problems: int = 1000,
                            difficulty: str = "easy", seed: int = 0, split: str = "train",
                            holdout_fraction: float = 0.2, answer_format: str = "plain",
                            prompt_template: str | None = None, correctness_weight: float = 1.0,
                            formatting_weight: float = 0.1, max_length: int = 128,
                            stop_sequences: Sequence[str] | None = None, max_examples: int | None = None,
                            **kwargs) -> MathProblemEnv:
    """A math environment: `num_problems` generated arithmetic problems (seeded; `split` 'train' or 'test'
    picks a disjoint, stable `holdout_fraction` of problem texts), or `problems_path` (JSONL of
    {"problem","answer"}, used as given). Reward = correctness + 0.1 * formatting by default.

    The default prompt for answer_format='plain' is "12+7=", and the ideal completion is "19"."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    template = prompt_template or _MATH_TEMPLATES.get(answer_format, "{problem}")
    generator = None
    if problems_path:
        problems = load_math_problems(problems_path, max_examples)
    else:
        if difficulty not in MATH_DIFFICULTIES:
            raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(MATH_DIFFICULTIES)}")
        if split != "all" and not 0.0 < holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in (0, 1) for split={split!r}, got {holdout_fraction}")

        def generator(rng, _d=difficulty):
            for _ in range(100_000):
                problem, answer = generate_arithmetic_problem(rng, _d)
                if split == "all" or problem_split(problem, holdout_fraction) == split:
                    return problem, answer
            raise RuntimeError(f"no {split!r} problem found; check holdout_fraction={holdout_fraction}")

        rng = random.Random(seed)
        problems = [dict(zip(("problem", "answer"), generator(rng))) for _ in range(num_problems)]
    return MathProblemEnv(tokenizer, problems, answer_format=answer_format, prompt_template=template,
                          correctness_weight=correctness_weight, formatting_weight=formatting_weight,
                          generator=generator, max_length=max_length, stop_sequences=stop_sequences,
                          seed=seed, **kwargs)


# --------------------------------------------------------------------------------------- code

DEFAULT_CODE_PROBLEMS = [
    {"prompt": "Write a Python function add(a, b) that returns the sum of a and b.",
     "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]},
    {"prompt": "Write a Python function factorial(n) that returns n! for n >= 0.",
     "tests": ["assert factorial(0) == 1", "assert factorial(1) == 1", "assert factorial(5) == 120"]},
    {"prompt": "Write a Python function is_palindrome(s) that returns True when the string s reads the same "
               "backwards.",
     "tests": ["assert is_palindrome('abba')", "assert not is_palindrome('abc')", "assert is_palindrome('')"]},
    {"prompt": "Write a Python function fizzbuzz(n) that returns 'Fizz' for multiples of 3, 'Buzz' for "
               "multiples of 5, 'FizzBuzz' for both, else str(n).",
     "tests": ["assert fizzbuzz(3) == 'Fizz'", "assert fizzbuzz(10) == 'Buzz'", "assert fizzbuzz(15) == 'FizzBuzz'",
               "assert fizzbuzz(7) == '7'"]},
    {"prompt": "Write a Python function max_of(xs) that returns the largest number in the non-empty list xs.",
     "tests": ["assert max_of([1, 5, 2]) == 5", "assert max_of([-3, -7]) == -3", "assert max_of([4]) == 4"]},
]


def extract_code(completion: str, prompt: str = "") -> str:
    """The code in a completion: inside the first fenced block, or up to the closing fence when the
    prompt opened one, else the whole completion."""
    if prompt.count("```") % 2 == 1:
        return completion.split("```", 1)[0]
    m = re.search(r"```[ \t]*[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", completion, re.S)
    return m.group(1) if m else completion


def parse_code(code: str) -> ast.Module | None:
    """The AST of non-empty code, or None when it does not parse (never executes anything)."""
    if not code.strip():
        return None
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return tree if tree.body else None


def style_score(code: str, tree: ast.Module | None = None) -> float:
    """Fraction of simple style checks passed (0.0 for code that does not parse): defines a function
    or class, every function has a docstring, lines <= 100 chars, no tabs or trailing spaces, no bare
    `except:`, no `import *`."""
    tree = tree or parse_code(code)
    if tree is None:
        return 0.0
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    lines = code.splitlines()
    checks = [
        any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body),
        bool(funcs) and all(ast.get_docstring(f) for f in funcs),
        all(len(line) <= 100 for line in lines),
        all("\t" not in line and line == line.rstrip() for line in lines),
        not any(isinstance(n, ast.ExceptHandler) and n.type is None for n in ast.walk(tree)),
        not any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree)),
    ]
    return sum(checks) / len(checks)


# A unit test is `assert f(<literals>) <op> <literal>` (or `assert f(...)` / `assert not f(...)`): the call
# runs in the sandbox, the comparison here, so an expected value never enters the sandbox.
_TEST_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "truthy": lambda actual, _: bool(actual), "falsy": lambda actual, _: not actual,
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
    ">=": operator.ge, "in": lambda actual, expected: actual in expected,
    "not in": lambda actual, expected: actual not in expected,
    "contains": lambda actual, expected: expected in actual,
    "not contains": lambda actual, expected: expected not in actual,
    "is": operator.is_, "is not": operator.is_not,
}
_AST_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
            ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
# `3 == f(x)` is `f(x) == 3`: the comparison seen from the call's side.
_MIRRORED = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<=", "in": "contains",
             "not in": "not contains", "is": "is", "is not": "is not"}
UNIT_TEST_FORMS = "`assert f(1, 2) == 3`, `assert f('a')` or `assert not f('a')`"
RESULT_PREFIX = "__rl_result__ "
MAX_RESULT_CHARS = 100_000  # a longer repr counts as a failed test (and is never parsed)


@dataclass(frozen=True)
class UnitTest:
    """One assert statement split in two: `function(*args, **kwargs)` (source texts of literals) runs
    in the sandbox; `op` and `expected` stay here and judge the repr the sandbox returns."""

    source: str
    function: str
    args: tuple[str, ...]
    kwargs: tuple[tuple[str, str], ...]
    op: str
    expected: Any = None


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _call_with_literals(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and all(not isinstance(a, ast.Starred) and _is_literal(a) for a in node.args)
            and all(k.arg is not None and _is_literal(k.value) for k in node.keywords))


@functools.lru_cache(maxsize=4096)
def parse_unit_test(test: str) -> UnitTest:
    """Split `test` (one assert statement) into the call the sandbox runs and the check made here.

    Accepted: `assert f(<literals>)`, `assert not f(<literals>)` and `assert f(<literals>) <op> <literal>`
    (either side) with one of == != < <= > >= in, not in, is, is not (`is` only with None/True/False).
    Anything else (several statements, a non-literal expected value, an expression around the call)
    is a ValueError: it would put the expected value, or code that can be subverted, in the sandbox."""
    def bad(why: str) -> ValueError:
        return ValueError(f"unit test {test!r}: {why}; write each test as {UNIT_TEST_FORMS} "
                          "(a call with literal arguments, compared with a literal)")

    try:
        tree = ast.parse(test.strip())
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise bad("is not valid Python") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise bad("is not a single assert statement")
    expr, op, expected = tree.body[0].test, "truthy", None
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr, op = expr.operand, "falsy"
    elif isinstance(expr, ast.Compare):
        if len(expr.ops) != 1 or type(expr.ops[0]) not in _AST_OPS:
            raise bad("compares more than two values")
        op, left, right = _AST_OPS[type(expr.ops[0])], expr.left, expr.comparators[0]
        if _call_with_literals(left) and _is_literal(right):
            expr, expected = left, ast.literal_eval(right)
        elif _call_with_literals(right) and _is_literal(left):
            expr, expected, op = right, ast.literal_eval(left), _MIRRORED[op]
        else:
            raise bad("does not compare a call with a literal")
        if op in ("is", "is not") and not any(expected is c for c in (None, True, False)):
            raise bad("uses `is` with a value other than None, True or False")
    if not _call_with_literals(expr):
        raise bad("does not test a call with literal arguments")
    return UnitTest(source=test, function=expr.func.id, args=tuple(ast.unparse(a) for a in expr.args),
                    kwargs=tuple((k.arg, ast.unparse(k.value)) for k in expr.keywords), op=op, expected=expected)


# The sandboxed program: run the candidate, then each call, and print one result line per call:
# {"i": index, "repr": repr(value)} or {"i": index, "error": exception name}. It holds no expected
# value, so nothing in the sandbox (this file, the candidate, its environment, /proc) reveals one.
_HARNESS = r"""
import ast, json, sys
PREFIX, LIMIT = %r, %d
calls = json.loads(open("calls.json", encoding="utf-8").read())
out = sys.stdout
def emit(i, **result):
    out.write("\n" + PREFIX + json.dumps({"i": i, **result}) + "\n")
    out.flush()
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    source = open("solution.py", encoding="utf-8").read()
    exec(compile(source, "solution.py", "exec"), namespace)
except BaseException as e:
    for i in range(len(calls)):
        emit(i, error=type(e).__name__)
    raise SystemExit(0)
for i, (name, args, kwargs) in enumerate(calls):
    try:
        value = namespace[name](*[ast.literal_eval(a) for a in args],
                                **{k: ast.literal_eval(v) for k, v in kwargs})
        text = repr(value)
        emit(i, repr=text) if len(text) <= LIMIT else emit(i, error="ResultTooLarge")
    except BaseException as e:
        emit(i, error=type(e).__name__)
""" % (RESULT_PREFIX, MAX_RESULT_CHARS)


def read_results(stdout: str, n: int) -> list[dict | None]:
    """The first well-formed result line for each of the `n` calls (None where there is none)."""
    results: list[dict | None] = [None] * n
    for line in stdout.splitlines():
        if not line.startswith(RESULT_PREFIX):
            continue
        try:
            r = json.loads(line[len(RESULT_PREFIX):])
        except (ValueError, RecursionError):
            continue
        i = r.get("i") if isinstance(r, dict) else None
        if type(i) is int and 0 <= i < n and results[i] is None:
            results[i] = r
    return results


def unit_test_passes(test: UnitTest, result: dict | None) -> bool:
    """Whether the sandbox's result for `test` satisfies it. The repr is read back with
    `ast.literal_eval` (plain literals only, no code runs here), so a value that is not a literal
    (a custom object, a NumPy array) fails."""
    text = result.get("repr") if isinstance(result, dict) else None
    if not isinstance(text, str) or len(text) > MAX_RESULT_CHARS:
        return False
    try:
        actual = ast.literal_eval(text)
        return bool(_TEST_OPS[test.op](actual, test.expected))
    except Exception:  # noqa: BLE001 - malformed or incomparable values are failed tests, whatever the error
        return False


def run_unit_tests(code: str, tests: Sequence[str], timeout: float = 5.0, memory_mb: int = 512,
                   require_private_root: bool = True) -> float:
    """Fraction of `tests` (assert statements, see `parse_unit_test`) that `code` passes, run only in
    rl.sandbox.

    The sandbox gets the candidate, the function names and the literal arguments, and returns the
    repr of each call's value; the comparison with the expected value happens here. Reading its own
    source, the harness, its environment, the file system or /proc reveals no expected value, and
    printing result lines gains nothing: only the first line per call counts, and it must hold the
    right value. A test that does not parse counts as failed (environments reject them up front).
    `require_private_root=False` runs without a private root where there is none (see rl.sandbox)."""
    if not tests:
        return 0.0
    parsed = []
    for t in tests:
        try:
            parsed.append(parse_unit_test(t))
        except ValueError:
            parsed.append(None)
    runnable = [u for u in parsed if u is not None]
    if not runnable:
        return 0.0
    calls = [[u.function, list(u.args), [list(kv) for kv in u.kwargs]] for u in runnable]
    result = sandbox.run_python(_HARNESS, timeout=timeout, memory_mb=memory_mb,
                                files={"solution.py": code, "calls.json": json.dumps(calls)},
                                require_private_root=require_private_root)
    outcomes = read_results(result.stdout, len(runnable))
    return sum(unit_test_passes(u, r) for u, r in zip(runnable, outcomes)) / len(tests)


SANDBOX_MODES = ("isolated", "unisolated")


def check_sandbox(mode: str) -> None:
    """Refuse to run generated code without a private root unless `mode` is 'unisolated' (then say
    once, in one line, what that means)."""
    level = sandbox.isolation_level()
    if level == "private-root":
        return
    if mode != "unisolated":
        raise ConfigError(f"sandbox: {sandbox.NO_PRIVATE_ROOT}")
    logger.warning("sandbox: unisolated: generated code runs with resource limits only (isolation %r) and can "
                   "read and write this machine's files", level)


class CodeGenerationEnv(MultiObjectiveRewardEnv):
    """Components: `syntax` (1.0 for non-empty code that parses), `style` (style_score), and with
    run_tests=True `tests` (fraction of metadata['tests'] passing in the sandbox).

    sandbox='isolated' (the default) runs generated code only under a private root (rl.sandbox) and
    refuses to start where there is none; 'unisolated' runs it with resource limits only."""

    def __init__(self, tokenizer, problems: list[dict], run_tests: bool, weights: dict[str, float],
                 timeout: float, memory_mb: int, max_workers: int, sandbox: str = "isolated", **kwargs):
        if sandbox not in SANDBOX_MODES:
            raise ConfigError(f"sandbox: {sandbox!r} is not one of {', '.join(SANDBOX_MODES)}")
        self.run_tests, self.timeout, self.memory_mb, self.max_workers = run_tests, timeout, memory_mb, max_workers
        self.sandbox = sandbox
        prompts = [p["prompt"] for p in problems]
        metadata = [{"tests": list(p.get("tests") or [])} for p in problems]
        components = {"syntax": self._syntax, "style": self._style}
        if run_tests:
            for m in metadata:
                for t in m["tests"]:
                    parse_unit_test(t)  # a ValueError naming the test and the accepted forms
            check_sandbox(sandbox)
            components["tests"] = self._tests
        super().__init__(tokenizer, prompts, reward_components=components,
                         reward_weights={k: v for k, v in weights.items() if k in components},
                         metadata=metadata, **kwargs)

    def _syntax(self, prompts, responses, metadata=None):
        return [1.0 if parse_code(extract_code(r, p)) is not None else 0.0 for p, r in zip(prompts, responses)]

    def _style(self, prompts, responses, metadata=None):
        return [style_score(extract_code(r, p)) for p, r in zip(prompts, responses)]

    def _tests(self, prompts, responses, metadata=None):
        def one(args):
            p, r, m = args
            code = extract_code(r, p)
            if parse_code(code) is None or not m.get("tests"):
                return 0.0  # nothing worth a subprocess
            return run_unit_tests(code, m["tests"], timeout=self.timeout, memory_mb=self.memory_mb,
                                  require_private_root=self.sandbox == "isolated")

        jobs = list(zip(prompts, responses, metadata))
        with ThreadPoolExecutor(max_workers=max(1, self.max_workers)) as pool:
            return list(pool.map(one, jobs))


def create_code_generation_env(tokenizer, problems_path: str | None = None, run_tests: bool = False,
                               syntax_weight: float = 1.0, style_weight: float = 0.1, tests_weight: float = 1.0,
                               timeout: float = 5.0, memory_mb: int = 512, max_workers: int = 2,
                               max_length: int = 512, max_examples: int | None = None, sandbox: str = "isolated",
                               **kwargs) -> CodeGenerationEnv:
    """A code environment over built-in function-writing problems or `problems_path` (rows with
    "prompt" and optional "tests": a list of assert statements in the forms of `parse_unit_test`).
    Unit tests run only with run_tests=True, each completion in its own sandboxed subprocess
    (`timeout` s, `memory_mb` MiB), under a private root unless sandbox='unisolated'."""
    if problems_path:
        problems = []
        rows = read_records(problems_path)
        for row in rows[:max_examples] if max_examples else rows:
            where = f"{problems_path}:{row.get('_line')}"
            if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise DataError(f"{where}: 'prompt' must be a non-empty string")
            tests = row.get("tests") or []
            if isinstance(tests, str):
                tests = [tests]
            if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
                raise DataError(f"{where}: 'tests' must be a list of strings (assert statements)")
            for t in tests if run_tests else ():
                try:
                    parse_unit_test(t)
                except ValueError as e:
                    raise DataError(f"{where}: {e}") from None
            problems.append({"prompt": row["prompt"], "tests": tests})
    else:
        problems = DEFAULT_CODE_PROBLEMS
    weights = {"syntax": syntax_weight, "style": style_weight, "tests": tests_weight}
    return CodeGenerationEnv(tokenizer, problems, run_tests=run_tests, weights=weights, timeout=timeout,
                             memory_mb=memory_mb, max_workers=max_workers, max_length=max_length, sandbox=sandbox,
                             **kwargs)


# ------------------------------------------------------------------------------------ factory

ENV_TYPES = ("text_generation", "multi_objective", "preference_comparison", "math", "code", "tool_math")

# Components a multi_objective env can name in its config (rl_reward_weights keys).
NAMED_COMPONENTS: dict[str, Callable] = {
    "correctness": R.correctness_reward,
    "formatting": lambda prompt, generated, full_text: 1.0 if R.has_answer_format(generated, "answer") else 0.0,
    "length": length_reward,
    "length_penalty": R.length_penalty_reward,
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
        return R.load_custom_reward(key)
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

    text_generation: prompts|prompts_path, reward_fn (a rl.rewards name or 'module:function'), max_length, ...
    multi_objective: prompts|prompts_path, reward_components ({name: builtin|'module:function'} or a list of
      names; default: the keys of reward_weights), reward_weights ({name: weight} or JSON string)
    preference_comparison: prompts|prompts_path and reward_model_path (an HF sequence classifier) or
      preference_model / human_feedback_fn objects
    math: the keyword arguments of create_math_problem_env; code: those of create_code_generation_env;
    tool_math: those of rl.tool_env.create_tool_math_env (multi-turn: the policy may call tools).
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
            from rl.tool_env import create_tool_math_env  # here: rl.tool_env builds on this module

            return create_tool_math_env(tokenizer, **config)
        prompts, metadata = _prompts_from(config)
        if env_type == "text_generation":
            fn = config.pop("reward_fn", None)
            if isinstance(fn, str):
                fn = R.get_reward_fn(fn, custom=config.pop("custom_reward", None))
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
