"""The base of every environment: `TextGenerationEnv`, its episode dataclasses (`Observation`,
`StepResult`, `Trajectory`), the reward-function adapter `batch_reward`, and the registry of
environment factories (`register_env`, `ENV_REGISTRY`, `env_types`).

Two APIs over the same reward logic:

* The reference's per-token API: `obs = env.reset()`, `result = env.step(token)` until `result.done`,
  `env.render()` (`run_episode` rolls one such episode with `policy(obs) -> (token, logprob)`). The
  reward is terminal (0.0 until the episode ends), as in the reference.
* The batched episode API the trainers use (PPO/GRPO/RLOO):

      batch = env.sample_prompts(n, seed)              # [{"prompt": str, "metadata": dict}, ...]
      rewards, metrics = env.score(prompts, completions, metadata)
      # rewards: list[float], one per completion; metrics: {name: list[float]} aligned with it

  `env(prompts, responses, metadata=None) -> list[float]` is the same as `score(...)[0]`, so an
  environment can be passed wherever a `reward_fn(prompts, responses, metadata)` is expected.
  `sample_prompts` is deterministic in `seed` (every rank of a distributed run gets the same batch and
  shards it); for GRPO, repeat each prompt `num_generations` times before generating.
  `reward_functions()` gives TRL-style per-component functions and their weights.

Episodes end at EOS, at the first stop sequence, or when prompt + completion reaches `max_length`
tokens. Scoring sees the completion cut before its first stop sequence, in `step()` and `score()` alike.

Reward functions given to the environments may be per-sample, `fn(prompt, generated, full_text)` (the
reference's signature; a `metadata` keyword is passed when the function accepts one), or batched,
`fn(prompts, responses, metadata=None) -> list[float]` (rl.rewards.functions' signature, recognised by
its first parameter being named `prompts`), or TRL-style `fn(prompts, completions, **columns)`. The
default is the reference's, words / 100 (`length_reward`).

The registry: `register_env(name)` above a factory (or `register_env(name, factory)`) records
`factory(tokenizer, **env_config) -> environment` under `name`. Each environment module registers its
own; rl.envs.registry imports them all and builds by name (`make_env`). This module imports no other
environment module, so every one of them can import it.
"""

from __future__ import annotations

import inspect
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------ registry

# env_type name -> factory(tokenizer, **env_config) -> environment. Each environment module registers its
# own factory (`@register_env("math")` above `create_math_problem_env`); rl.envs.registry imports them all.
ENV_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_env(name: str, factory: Callable[..., Any] | None = None):
    """Register `factory(tokenizer, **env_config) -> environment` as the environment type `name` (what
    `make_env`, `env_type` and `rl_env_type` accept): `register_env(name, factory)`, or `@register_env(name)`
    above the factory. A name is a non-empty string without ':' (that means 'module:function'); another
    factory under a taken name is a ValueError. Returns the factory (the decorator form: a decorator)."""
    if not isinstance(name, str) or not name.strip() or ":" in name:
        raise ValueError(f"environment type names are non-empty strings without ':', got {name!r}")

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"register_env({name!r}): {fn!r} is not callable")
        prev = ENV_REGISTRY.get(name)
        where = _qualified_name(prev)
        # the same function again (its module reloaded) re-registers; a lambda or partial is never the same
        same = prev is fn or (where == _qualified_name(fn) and "<" not in where)
        if prev is not None and not same:
            raise ValueError(f"environment type {name!r} is already registered ({where}); pick another name")
        ENV_REGISTRY[name] = fn
        return fn

    return add if factory is None else add(factory)


def _qualified_name(fn) -> str:
    qualname = getattr(fn, "__qualname__", None)
    return f"{getattr(fn, '__module__', '?')}.{qualname}" if qualname else repr(fn)


def env_types() -> tuple[str, ...]:
    """The registered environment type names, sorted (the same whichever module was imported first)."""
    return tuple(sorted(ENV_REGISTRY))


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



