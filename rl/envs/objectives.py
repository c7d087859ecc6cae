"""Environments over several reward sources, and the factories of the three environments built from a
list of prompts (text_generation, multi_objective, preference_comparison).

`MultiObjectiveRewardEnv`: reward = sum_k w_k * component_k (weights default to 1.0); each component
is reported as `reward_<name>`, the sum as `reward_total`, and `reward_functions()` gives GRPO the
components one by one with their weights. A config names its components from `NAMED_COMPONENTS`
(correctness, formatting, length, length_penalty; rl.envs.code adds syntax and style) or as
`module:function`.

`PreferenceComparisonEnv`: two responses per prompt, the second `step()` compares them. With a
preference model (an HF sequence classifier, anything with `score(texts)`, or a callable) the pair's
reward is the Bradley-Terry margin s(r1) - s(r2), and `preference_prob` = sigmoid(margin) is
P(r1 preferred); without one, `human_feedback_fn(prompt, r1, r2)` gives it. Deviation from the
reference implementation (see shared/reference/README.md): it scores with the given model or callback,
never a random number, and refuses to start with neither.

Factories (registered with `register_env`): `create_text_generation_env`, `create_multi_objective_env`,
`create_preference_comparison_env`. Each takes its prompts as `prompts` (+ `metadata`, one dict per
prompt) or as the rows of `prompts_path` (a 'prompt' or 'text' column; the other columns become the
prompt's metadata), then the environment's own keywords.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Callable, Sequence

import torch

from rl.data.records import read_records
from rl.envs.base import (
    Observation,
    StepResult,
    TextGenerationEnv,
    batch_reward,
    length_reward,
    register_env,
)
from rl.errors import DataError
from rl.models.loading import load_causal_lm, load_tokenizer
from rl.rewards import answers as R
from rl.rewards import functions as RF

logger = logging.getLogger(__name__)


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


# ------------------------------------------------------------------------------------ factories

# Components a multi_objective env can name in its config (reward_weights keys); rl.envs.code adds
# `syntax` and `style`.
NAMED_COMPONENTS: dict[str, Callable] = {
    "correctness": RF.correctness_reward,
    "formatting": lambda prompt, generated, full_text: 1.0 if R.has_answer_format(generated, "answer") else 0.0,
    "length": length_reward,
    "length_penalty": RF.length_penalty_reward,
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
    """Pop the prompts (and their metadata) out of an env config: 'prompts' (+ 'metadata'), or the rows
    of 'prompts_path' / 'data_path' (a 'prompt' or 'text' column; the other columns are metadata)."""
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


@register_env("text_generation")
def create_text_generation_env(tokenizer, **config) -> TextGenerationEnv:
    """`env_type: text_generation`: prompts|prompts_path, reward_fn (an rl.rewards.functions name, 'custom'
    with custom_reward, or 'module:function'; default words / 100) and TextGenerationEnv's keywords."""
    prompts, metadata = _prompts_from(config)
    fn = config.pop("reward_fn", None)
    if isinstance(fn, str):
        fn = RF.get_reward_fn(fn, custom=config.pop("custom_reward", None))
    return TextGenerationEnv(tokenizer, prompts, reward_fn=fn, metadata=metadata, **config)


@register_env("multi_objective")
def create_multi_objective_env(tokenizer, **config) -> MultiObjectiveRewardEnv:
    """`env_type: multi_objective`: prompts|prompts_path, reward_components ({name: NAMED_COMPONENTS key or
    'module:function'} or a list of names; default: the keys of reward_weights) and reward_weights
    ({name: weight} or its JSON string)."""
    prompts, metadata = _prompts_from(config)
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


@register_env("preference_comparison")
def create_preference_comparison_env(tokenizer, **config) -> PreferenceComparisonEnv:
    """`env_type: preference_comparison`: prompts|prompts_path and reward_model_path (an HF sequence
    classifier, loaded frozen in fp32) or preference_model / human_feedback_fn objects."""
    prompts, metadata = _prompts_from(config)
    path = config.pop("reward_model_path", None)
    if path is not None and config.get("preference_model") is None:
        config["preference_model"] = load_causal_lm(path, dtype="float32", task="classifier",
                                                    trust_remote_code=config.pop("trust_remote_code", False))
        config.setdefault("reward_tokenizer", load_tokenizer(path))
    return PreferenceComparisonEnv(tokenizer, prompts, metadata=metadata, **config)
