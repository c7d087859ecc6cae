"""PPO for RLHF (Ouyang et al. 2022; Ziegler et al. 2019): a policy, a frozen reference, a value function.

One iteration:
  1. rollout   sample `batch_size` completions per process from the policy (`rl.generation.generate`:
               left-padded prompts, KV cache, per-row seeds; ZeRO-3 gathers the weights once);
  2. scoring   a scalar score per completion (reward function, reward model or environment), then one
               no-grad forward of the policy (old log-probs and values) and of the reference;
  3. rewards   per token r_t = -kl_coef * KL_t, plus the score at the LAST response token only;
               GAE (Schulman et al. 2016) as a vectorised reverse scan over the response mask;
               optional whitening of the advantages;
  4. update    `ppo_epochs` passes over shuffled minibatches of `mini_batch_size` rollouts, each split
               into `gradient_accumulation_steps` micro-batches through the engine:
               loss = clipped policy loss (Schulman et al. 2017, eq. 7)
                      + value_coef * clipped value loss - entropy_coef * entropy (response tokens only);
  5. KL control Ziegler et al.'s adaptive coefficient: coef *= 1 + clip(KL/target - 1, -0.2, 0.2) * n / horizon,
               with n = rollouts in the iteration (all processes) and KL the mean per-sequence KL sum.

Alignment, the part the reference got wrong: for a batch laid out as [left-padded prompt (P) | response (N)],
response token j sits at input position P + j and is predicted by the logits (and valued by the hidden
state) at position P - 1 + j. Every per-token tensor here is (B, N) in that "response space": log-probs,
values, KL, rewards, advantages, returns, mask. Position ids are counted from each row's first real token,
exactly as during sampling, so the recomputed log-probs equal the sampler's (checked in tests/test_ppo.py).

Log-probs for the loss, the KL and the old policy all use logits / temperature without top-k/top-p
filtering (TRL's choice): the filters only shape exploration, and a filtered distribution has zero
mass where the unfiltered one does not, which would make the ratio and the KL undefined.

Deviations from the reference implementation: one value per TOKEN (not per sequence); minibatches and
gradient accumulation; the `n_steps` factor in the KL controller; no `trust_remote_code` unless asked.
Checked against hand-computed GAE/KL-controller values and a naive loop (tests/test_ppo.py); TRL 1.16
has no PPO trainer any more, so there is no numerical peer for the whole loop.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
import torch.nn as nn
from safetensors.torch import save_file
from transformers.utils import ModelOutput

from rl.algos import names
from rl.algos.advantages import gae, whiten
from rl.algos.kl import AdaptiveKLController, FixedKLController, kl_penalized_rewards, per_token_kl
from rl.algos.policy_losses import ppo_policy_loss, ppo_value_loss
from rl.algos.reduce import masked_mean
from rl.checkpoint import checkpoint_dir
from rl.chunked import HeadLogits
from rl.config import ConfigError, TrainConfig, opt, save_config, to_dict
from rl.data import render_chat
from rl.forward_backward import ForwardBackwardPipeline, build_accelerator, is_deepspeed, zero_stage
from rl.generation import generate, position_ids_from_mask, sequence_logprobs
from rl.models import (apply_lora, build_optimizer, build_scheduler, load_tokenizer, load_trainable_policy,
                       release_device_cache, resolve_dtype, trainable_fraction, write_pretrained)
from rl.reference import ReferencePolicy
from rl.reward_sources import (RewardError, RewardModelReward, WeightedSum, build_reward_fns,  # noqa: F401
                               rows_to_columns)
from rl.tracking import Tracker
from rl.trainers.base import Trainer

logger = logging.getLogger(__name__)


# ==================================================================================================
# Pure math (all (B, N) tensors in response space; mask 1 on generated tokens). KL estimators, KL-penalised
# rewards, GAE, whitening and the KL controllers are in rl.algos (names kept importable from here).
# ==================================================================================================

def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over masked entries: 1 is a perfect critic, 0 one that
    predicts the mean, negative worse than that."""
    m = mask.to(torch.float64)
    n = m.sum().clamp(min=1)

    def var(x):
        x = x.to(torch.float64)
        mu = (x * m).sum() / n
        return (((x - mu) * m) ** 2).sum() / n

    vr = var(returns)
    if vr <= 0:
        return float("nan")
    return float(1.0 - var(returns - values) / vr)


def response_logits(logits: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """(B, P+N, V) logits -> (B, N, V) logits that predict the N response tokens (positions P-1 .. P+N-2)."""
    return logits[:, prompt_width - 1:-1]


def response_logprobs(logits: torch.Tensor, tokens: torch.Tensor, prompt_width: int, temperature: float = 1.0,
                      with_entropy: bool = False):
    """Log-probs (B, N) of the response tokens `tokens` (B, N) under softmax(logits / temperature),
    and optionally the per-token entropy (B, N) of that distribution. `logits` may be a
    `rl.chunked.HeadLogits` (the engine's chunked LM head): then no (B, N, V) tensor is built."""
    if isinstance(logits, HeadLogits):
        return (response_logits(logits, prompt_width) / temperature).logprobs(tokens, with_entropy)
    lg = response_logits(logits, prompt_width).float()
    if temperature != 1.0:
        lg = lg / temperature
    logz = torch.logsumexp(lg, dim=-1)
    logp = lg.gather(-1, tokens[..., None]).squeeze(-1) - logz
    if not with_entropy:
        return logp
    p = torch.softmax(lg, dim=-1)
    entropy = logz - (p * lg).sum(-1)
    return logp, entropy


# ==================================================================================================
# Models: policy with a value head, separate critic
# ==================================================================================================

@dataclasses.dataclass
class PPOModelOutput(ModelOutput):
    """A transformers ModelOutput (attribute and key access), so that DeepSpeed's ZeRO-3 hooks and
    accelerate treat it like any model's output instead of warning about an unknown type."""

    logits: torch.Tensor | None = None  # (B, T, V)
    value: torch.Tensor | None = None  # (B, T): V of the state after reading tokens 0..t
    cache: Any = None  # the KV cache (transformers 5 renamed past_key_values to cache)


class ValueHead(nn.Module):
    """hidden -> Linear -> ReLU -> Linear -> one value per token, (B, T, H) -> (B, T), fp32 output.

    The output layer starts at zero, so the first values are 0 and the first advantages are the
    rewards themselves rather than noise from a random head."""

    def __init__(self, hidden_size: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = nn.ReLU()
        self.out = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.to(self.dense.weight.dtype)
        return self.out(self.act(self.dense(self.dropout(h)))).squeeze(-1).float()


class PPOModel(nn.Module):
    """A causal LM plus a `ValueHead` on its last hidden state: logits and one value per token.

    `forward` takes what the HF model takes. Without a KV cache it also returns `value` (B, T); with
    one (sampling) the head is skipped. Position ids default to counting from each row's first
    attended token, so left padding changes nothing (as in `rl.generation`). `value_head=False` makes
    a policy without a head (when a separate critic is used)."""

    def __init__(self, base_model: nn.Module, value_head: bool | ValueHead = True):
        super().__init__()
        self.base_model = base_model
        # the KV-cache keyword of this transformers version ("cache" replaced "past_key_values")
        params = inspect.signature(getattr(base_model, "get_base_model", lambda: base_model)().forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        hidden = base_model.config.get_text_config().hidden_size
        if value_head is True:
            value_head = ValueHead(hidden)
        self.value_head = value_head or None

    @property
    def config(self):
        return self.base_model.config

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, **kwargs) -> PPOModelOutput:
        cache = cache if cache is not None else past_key_values
        if position_ids is None and attention_mask is not None and cache is None:
            position_ids = position_ids_from_mask(attention_mask)
        want_value = self.value_head is not None and cache is None
        if cache is not None:
            kwargs[self._cache_kw] = cache
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=use_cache, output_hidden_states=want_value, **kwargs)
        value = self.value_head(out.hidden_states[-1]) if want_value else None
        return PPOModelOutput(logits=out.logits, value=value, cache=getattr(out, "cache", None))


class Critic(nn.Module):
    """A separate value model: a reward model's backbone and head applied at every position (the
    value model TRL's PPO initialises from the reward model). (B, T) values, fp32."""

    def __init__(self, reward_model: nn.Module):
        super().__init__()
        self.backbone = reward_model.backbone
        self.head = reward_model.head
        self.scale = 1.0 / float(getattr(reward_model.config, "temperature", 1.0))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs) -> PPOModelOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        value = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float() * self.scale
        return PPOModelOutput(value=value)


# ==================================================================================================
# Config
# ==================================================================================================

@dataclasses.dataclass
class PPOConfig(TrainConfig):
    """Every field of the reference's PPOConfig, plus the rest of what a PPO run needs.

    Sizes are per process: each process samples `batch_size` prompts per iteration, and each optimizer
    step uses `mini_batch_size` of them, in `gradient_accumulation_steps` micro-batches of
    mini_batch_size / gradient_accumulation_steps. Where the reference's Python example and its CLI
    table differ, the defaults are the CLI's (the documented defaults of the rl_* names)."""

    batch_size: int = opt(16, "prompts sampled per process per iteration (rollout batch)")
    mini_batch_size: int | None = opt(None, "rollouts per optimizer step, per process; divides batch_size (null: "
                                      "min(8, batch_size), the CLI's documented 8 capped at the rollout batch)")
    ppo_epochs: int = opt(4, "passes over each rollout batch")
    num_iterations: int | None = opt(None, "rollout+update rounds; null: num_epochs passes over the prompts")
    gamma: float = opt(0.99, "discount factor (0.9-1.0)")
    lam: float = opt(0.95, "GAE lambda (0.9-0.99)")
    clip_ratio: float = opt(0.2, "PPO policy clip range epsilon")
    value_clip: float | None = opt(0.2, "value clip range around the rollout's values (null: no clipping)")
    kl_penalty_coef: float = opt(0.1, "initial KL penalty coefficient beta (per-token reward -beta*KL); 0: no "
                                 "penalty and no reference model (objective/kl then reads 0)")
    adaptive_kl: bool = opt(True, "adapt the KL coefficient towards kl_target (Ziegler et al. 2019)")
    kl_target: float = opt(6.0, "target KL per sequence in nats (summed over response tokens), adaptive_kl only")
    kl_horizon: int = opt(10000, "adaptive KL horizon in samples")
    kl_estimator: Literal[names("kl_estimator")] = opt(
        "k1", "per-token KL estimator: k1 = log p/p_ref, k2 = (log p/p_ref)^2 / 2, k3 = r-1-log r")
    entropy_coef: float = opt(0.01, "entropy bonus coefficient (response tokens only)")
    value_coef: float = opt(1.0, "value loss coefficient")
    whiten_advantages: bool = opt(True, "normalise advantages to mean 0 / std 1 per rollout batch")
    max_new_tokens: int = opt(128, "maximum tokens generated per prompt")
    temperature: float = opt(1.0, "sampling temperature (> 0); log-probs use logits / temperature")
    top_k: int = opt(50, "top-k sampling (0: off)")
    top_p: float = opt(1.0, "nucleus sampling (1.0: off)")
    chat_template: bool = opt(False, "render each prompt as a user turn with the tokenizer's chat template "
                              "(instruct models); rewards still see the plain prompt")
    missing_eos_penalty: float | None = opt(None, "subtracted from the score of a completion that never emitted EOS")
    reward_clip: float | None = opt(None, "clip scores to [-reward_clip, reward_clip] (null: no clipping)")
    reward_model_path: str | None = opt(None, "reward model directory written by launch/reward.py")
    reward_fn: str | None = opt(None, "named reward: default | length_penalty | correctness | custom | module:function")
    custom_reward: str | None = opt(None, "'module:function' for reward_fn=custom")
    multi_objective: bool = opt(False, "score with a multi_objective environment weighted by reward_weights")
    reward_weights: dict[str, float] | None = opt(
        None, "JSON/mapping {name: weight}: a reward source's name (reward_model, env, the reward_fn's name) "
        "weights that source, other names are multi_objective components; given, several reward sources "
        "combine (a weighted sum)")
    reward_timeout: float | None = opt(300.0, "seconds a reward source may take per batch (null or 0: no limit)")
    env_type: str | None = opt(None, "score with an environment: text_generation, multi_objective, "
                               "preference_comparison, math, code")
    env_config: dict | None = opt(None, "JSON/mapping passed to the environment (see rl.environments.make_env)")
    ref_model: str | None = opt(None, "reference model (default: a frozen copy of model_name; with LoRA the "
                                "policy with adapters disabled)")
    value_model: Literal["shared", "critic"] = opt("shared", "shared: value head on the policy; critic: a "
                                                   "separate model initialised from the reward model")
    critic_model_path: str | None = opt(None, "critic initialisation (default: reward_model_path, else model_name)")
    critic_learning_rate: float | None = opt(None, "critic learning rate (default: learning_rate)")
    device: str | None = opt(None, "'cpu' forces the CPU; null picks the accelerator's device")
    save_every: int = opt(0, "checkpoint every N iterations (0: only the final model)")
    eval_every: int = opt(0, "score held-out prompts every N iterations (0: only at the end, if any)")

    # a reward source on the command line replaces the recipe's (rl.config._cli_replaces_reward_sources)
    REWARD_SOURCE_KEYS = ("reward_model_path", "reward_fn", "env_type", "multi_objective")

    def __post_init__(self):
        super().__post_init__()
        if self.mini_batch_size is None:  # derived once here, so the doc's batch_size=4 needs no extra key
            self.mini_batch_size = min(8, self.batch_size)
        for name in ("mini_batch_size", "ppo_epochs", "max_new_tokens", "kl_horizon"):
            if getattr(self, name) < 1:
                raise ConfigError(f"key '{name}' must be at least 1, got {getattr(self, name)}")
        if self.batch_size % self.mini_batch_size:
            raise ConfigError(f"batch_size {self.batch_size} is not a multiple of mini_batch_size "
                              f"{self.mini_batch_size}; make the rollout batch a whole number of minibatches")
        if self.mini_batch_size % self.gradient_accumulation_steps:
            raise ConfigError(f"mini_batch_size {self.mini_batch_size} is not a multiple of "
                              f"gradient_accumulation_steps {self.gradient_accumulation_steps}")
        if self.num_iterations is not None and self.num_iterations < 1:
            raise ConfigError(f"key 'num_iterations' must be at least 1 or null, got {self.num_iterations}")
        if self.max_steps is not None:
            raise ConfigError("PPO counts iterations, not optimizer steps: set num_iterations instead of max_steps")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"key '{name}' must be in [0, 1], got {getattr(self, name)}")
        if not self.clip_ratio > 0:
            raise ConfigError(f"key 'clip_ratio' must be > 0, got {self.clip_ratio}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ConfigError(f"key 'value_clip' must be > 0 or null, got {self.value_clip}")
        if not self.temperature > 0:
            raise ConfigError(f"key 'temperature' must be > 0 (PPO needs sampling), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"key 'top_p' must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"key 'top_k' must be >= 0, got {self.top_k}")
        if self.kl_penalty_coef < 0 or not self.kl_target > 0:
            raise ConfigError("kl_penalty_coef must be >= 0 and kl_target > 0")
        if self.max_new_tokens >= self.max_length:
            raise ConfigError(f"max_new_tokens {self.max_new_tokens} leaves no room for the prompt in "
                              f"max_length {self.max_length}; raise max_length")
        if self.reward_clip is not None and not self.reward_clip > 0:
            raise ConfigError(f"key 'reward_clip' must be > 0 or null, got {self.reward_clip}")
        if self.reward_timeout is not None and not self.reward_timeout >= 0:
            raise ConfigError(f"key 'reward_timeout' must be >= 0 seconds or null, got {self.reward_timeout}")
        if self.multi_objective and self.env_type not in (None, "multi_objective"):
            raise ConfigError(f"multi_objective=true scores with env_type multi_objective, but env_type is "
                              f"{self.env_type!r}; drop one of them")
        given = [n for n, v in (("reward_model_path", self.reward_model_path), ("reward_fn", self.reward_fn),
                                ("env_type", self.env_type or ("multi_objective" if self.multi_objective else None)))
                 if v]
        if len(given) > 1 and self.reward_weights is None:
            raise ConfigError(f"{' and '.join(given)} are both set; give exactly one reward source, or reward_weights "
                              f"to combine them (e.g. reward_weights='{{\"reward_model\": 1.0, \"env\": 0.5}}')")
        if self.reward_fn == "custom" and not self.custom_reward:
            raise ConfigError("reward_fn=custom needs custom_reward='module:function'")

    @property
    def micro_batch_size(self) -> int:
        return self.mini_batch_size // self.gradient_accumulation_steps


def ppo_plan(cfg: PPOConfig, n_prompts: int | None, world: int, num_iterations: int | None = None) -> dict:
    """Derived sizes: rollouts per iteration (all processes), iterations, optimizer steps."""
    global_batch = cfg.batch_size * world
    per_epoch = max(1, math.ceil(n_prompts / global_batch)) if n_prompts else None
    iterations = num_iterations or cfg.num_iterations or (per_epoch * cfg.num_epochs if per_epoch else None)
    mini_batches = cfg.batch_size // cfg.mini_batch_size
    steps_per_iteration = cfg.ppo_epochs * mini_batches
    # per_device_batch / global_batch / steps_per_epoch in PPO's own units (the dry run prints these):
    # rollouts per forward, rollouts per iteration, iterations per pass over the prompts
    return {"world_size": world, "per_device_batch": cfg.micro_batch_size, "global_batch": global_batch,
            "steps_per_epoch": per_epoch, "iterations": iterations,
            "mini_batches_per_epoch": mini_batches, "micro_batch_size": cfg.micro_batch_size,
            "steps_per_iteration": steps_per_iteration,
            "total_steps": iterations * steps_per_iteration if iterations else None, "prompts": n_prompts}


NO_REWARD_ERROR = ("no reward source: set reward_model_path (rl_reward_model_path, a directory written by "
                   "launch/reward.py), reward_fn (default | length_penalty | correctness | custom), env_type, or "
                   "ref_model alone (then reward_fn=default); in Python pass PPOTrainer(reward_fn=...) or reward_model=...")


def check_reward_source(cfg: PPOConfig, reward_fn=None, reward_model=None) -> None:
    """Raise one ConfigError at once when no reward can be computed (before any model is built).

    With only a reference (`ref_model`, the reference CLI's --model-ref) the documented default reward
    function is used: cfg.reward_fn becomes "default", said in one line."""
    if reward_fn is not None or reward_model is not None:
        return
    if cfg.reward_model_path and not Path(cfg.reward_model_path).exists():
        raise ConfigError(f"reward_model_path {cfg.reward_model_path} does not exist; train one with "
                          f"launch/reward.py first (its output_dir)")
    if cfg.reward_model_path or cfg.reward_fn or cfg.env_type or cfg.multi_objective:
        return
    if cfg.ref_model:
        logger.warning("no reward source given: using reward_fn=default (words / 100, the reference's default "
                       "reward) with ref_model %s as the reference", cfg.ref_model)
        cfg.reward_fn = "default"
        return
    raise ConfigError(NO_REWARD_ERROR)


# ==================================================================================================
# Rewards (rl.reward_sources; the same protocol as GRPO's)
# ==================================================================================================

def build_reward_source(cfg: PPOConfig, tokenizer, reward_fn=None, reward_model=None) -> WeightedSum:
    """The run's reward: the reward_fn / reward_model given in Python (both: their sum), else the
    config's sources (reward_model_path, reward_fn, an environment), combined by reward_weights."""
    check_reward_source(cfg, reward_fn, reward_model)
    if reward_fn is not None or reward_model is not None:
        cfg = dataclasses.replace(cfg, reward_model_path=None, reward_fn=None, env_type=None, multi_objective=False,
                                  reward_weights=None)
    return build_reward_fns(cfg, tokenizer, reward_funcs=[reward_fn] if reward_fn is not None else (),
                            reward_model=reward_model, missing=NO_REWARD_ERROR)


def ppo_scores(reward: WeightedSum, prompts: list[str], responses: list[str],
               metadata: Sequence[dict] | None) -> tuple[torch.Tensor, dict[str, float]]:
    """(B,) scores and `rewards/<source or component>/mean` metrics. PPO needs a score for every
    completion: one no source scored (all returned None) is a RewardError."""
    scores, parts = reward(prompts, responses, rows_to_columns(metadata, len(responses)))
    missing = torch.isnan(scores).nonzero().flatten().tolist()
    if missing:
        raise RewardError(f"reward {reward.name!r} gave no score (None) for completion {missing[0]} "
                          f"({len(missing)} of {len(responses)}); PPO needs a score for every completion")
    metrics = {f"rewards/{k}/mean": float(v.nanmean()) for k, v in parts.items() if len(parts) > 1 or k != reward.name}
    return scores, metrics


# ==================================================================================================
# Trainer
# ==================================================================================================

class PPOTrainer(Trainer):
    """PPO with a shared value head or a separate critic, a frozen (or adapter-disabled) reference, and
    any reward source; runs single-process, DDP and DeepSpeed ZeRO-2/3 (policy and reference sharded).

        trainer = PPOTrainer(PPOConfig(model_name=..., ...), reward_fn=my_reward_fn)
        history = trainer.train(prompts, num_iterations=100)   # one metrics dict per iteration
        trainer.save()
    """

    def __init__(self, config: PPOConfig, tokenizer=None, reward_fn: Callable | None = None, reward_model=None,
                 model: nn.Module | None = None):
        cfg = self.cfg = self.config = config
        torch.manual_seed(cfg.seed)
        self.tokenizer = tokenizer or load_tokenizer(cfg.model_name, cfg.trust_remote_code, padding_side="left")
        # Rewards first: a missing source fails in a second, and a reward model loaded before the
        # accelerator is not partitioned by ZeRO-3's load-time sharding (nothing would gather it).
        self.reward = build_reward_source(cfg, self.tokenizer, reward_fn, reward_model)
        critic_rm = None
        if cfg.value_model == "critic":
            from rl.reward import load_reward_model

            critic_rm = load_reward_model(cfg.critic_model_path or cfg.reward_model_path or cfg.model_name,
                                          dtype="float32", trainable=True, trust_remote_code=cfg.trust_remote_code)
            for p in critic_rm.head.parameters():
                p.requires_grad_(True)
        self.train_dtype = resolve_dtype(cfg.dtype)
        self.accelerator = build_accelerator(
            cfg.gradient_accumulation_steps, device=cfg.device, micro_batch_size=cfg.micro_batch_size,
            max_grad_norm=cfg.max_grad_norm, mixed_precision="bf16" if self.train_dtype == torch.bfloat16 else "no",
            deepspeed_config=cfg.deepspeed)
        if critic_rm is not None and is_deepspeed(self.accelerator):
            raise ConfigError("value_model=critic is not supported under DeepSpeed yet; use value_model=shared "
                              "(the value head is sharded with the policy)")
        rm = self.reward.find(RewardModelReward)
        if rm is not None and not getattr(rm.model.config, "quantization", None):
            rm.model.to(self.accelerator.device)
        if model is None:
            model = load_trainable_policy(cfg)
        # decided before LoRA: with LoRA and no explicit ref_model the policy without adapters is the reference
        # kl_penalty_coef = 0 stays 0 (adaptive KL multiplies it): no KL penalty, so no reference at all
        self.reference = ReferencePolicy.build(cfg, model, self.accelerator, name=cfg.ref_model,
                                               needed=cfg.kl_penalty_coef > 0)
        if cfg.lora.enabled:
            model = apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
        self.policy = PPOModel(model, value_head=cfg.value_model == "shared")
        self.critic = Critic(critic_rm) if critic_rm is not None else None
        self.kl_ctl = (AdaptiveKLController(cfg.kl_penalty_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl
                       else FixedKLController(cfg.kl_penalty_coef))
        self.pipeline = None
        self.history: list[dict] = []
        self._iteration = 0

    # ------------------------------------------------------------------ sizes and setup
    def plan(self, n_prompts: int, num_iterations: int | None = None) -> dict:
        """Derived sizes, computed once."""
        return ppo_plan(self.cfg, n_prompts, self.world, num_iterations)

    def _setup(self, plan: dict) -> None:
        if self.pipeline is not None:
            return
        cfg, acc = self.cfg, self.accelerator
        out = Path(cfg.output_dir)
        optimizer = build_optimizer(self.policy, cfg.learning_rate, cfg.weight_decay)
        scheduler = build_scheduler(optimizer, cfg.lr_scheduler, plan["total_steps"], cfg.warmup_ratio)
        self.pipeline = ForwardBackwardPipeline(
            self.policy, gradient_accumulation_steps=cfg.gradient_accumulation_steps, optimizer=optimizer,
            scheduler=scheduler, accelerator=acc, checkpoint_dir=checkpoint_dir(out),
            micro_batch_size=cfg.micro_batch_size, logprob_chunk_size=cfg.logprob_chunk_size)
        self.critic_pipeline = None
        if self.critic is not None:
            c_opt = build_optimizer(self.critic, cfg.critic_learning_rate or cfg.learning_rate, cfg.weight_decay)
            c_sched = build_scheduler(c_opt, cfg.lr_scheduler, plan["total_steps"], cfg.warmup_ratio)
            self.critic_pipeline = ForwardBackwardPipeline(
                self.critic, gradient_accumulation_steps=cfg.gradient_accumulation_steps, optimizer=c_opt,
                scheduler=c_sched, accelerator=acc, checkpoint_dir=checkpoint_dir(out) / "critic",
                micro_batch_size=cfg.micro_batch_size)
        self.reference.place(acc)

    # ------------------------------------------------------------------ forward passes (no grad)
    @torch.no_grad()
    def _score_forward(self, batch: dict, P: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Old log-probs, old values and reference log-probs, (B, N) each, in micro-batches."""
        cfg = self.cfg
        pipe = self.pipeline
        dev = pipe.device
        ids, mask, toks = batch["input_ids"].to(dev), batch["attention_mask"].to(dev), batch["tokens"].to(dev)
        pos = position_ids_from_mask(mask)
        old_lp, old_v, ref_lp = [], [], []
        step = cfg.micro_batch_size
        model = pipe.model
        model.eval()
        try:
            for s in range(0, ids.shape[0], step):
                sl = slice(s, s + step)
                with pipe.head_capture(ids[sl]):  # the LM head chunk by chunk when the logits would be large
                    out = model(input_ids=ids[sl], attention_mask=mask[sl], position_ids=pos[sl], use_cache=False)
                old_lp.append(response_logprobs(out.logits, toks[sl], P, cfg.temperature))
                if out.value is not None:
                    old_v.append(out.value[:, P - 1:-1].float())
                del out
                if self.reference.exists:  # the LM head chunk by chunk when the logits would be large
                    labels = torch.cat([torch.full_like(ids[sl][:, :P], -100), toks[sl]], 1)
                    with self.reference.use(pipe) as ref:
                        lp, _ = sequence_logprobs(ref, ids[sl], mask[sl], labels, chunk_size=cfg.logprob_chunk_size,
                                                  position_ids=pos[sl], temperature=cfg.temperature)
                    ref_lp.append(lp[:, P - 1:])
                else:  # kl_penalty_coef = 0: no KL penalty, no reference forward (the KL then reads 0)
                    ref_lp.append(old_lp[-1])
                if self.critic_pipeline is not None:
                    cm = self.critic_pipeline.model
                    cm.eval()
                    old_v.append(cm(input_ids=ids[sl], attention_mask=mask[sl], position_ids=pos[sl]).value[:, P - 1:-1])
                    cm.train()
        finally:
            model.train()
        return torch.cat(old_lp), torch.cat(old_v), torch.cat(ref_lp)

    # ------------------------------------------------------------------ losses (through the engine)
    @staticmethod
    def _policy_loss(model, inputs, outputs, *, P, tokens, mask, old_logprobs, advantages, old_values=None,
                     returns=None, clip_ratio=0.2, value_clip=0.2, value_coef=1.0, entropy_coef=0.0,
                     temperature=1.0):
        logp, entropy = response_logprobs(outputs.logits, tokens, P, temperature, with_entropy=True)
        loss, metrics = ppo_policy_loss(logp, old_logprobs, advantages, mask, clip_ratio, clip_ratio)
        ent = masked_mean(entropy, mask)
        loss = loss - entropy_coef * ent
        metrics["policy/entropy"] = ent.detach()
        if returns is not None and outputs.value is not None:
            v = outputs.value[:, P - 1:-1]
            v_loss, v_metrics = ppo_value_loss(v, old_values, returns, mask, value_clip)
            loss = loss + value_coef * v_loss
            metrics.update(v_metrics)
        metrics["loss/total"] = loss.detach()
        return loss, metrics

    @staticmethod
    def _critic_loss(model, inputs, outputs, *, P, mask, old_values, returns, value_clip=0.2, value_coef=1.0):
        v_loss, metrics = ppo_value_loss(outputs.value[:, P - 1:-1], old_values, returns, mask, value_clip)
        return value_coef * v_loss, metrics

    # ------------------------------------------------------------------ one iteration
    def _rollout(self, prompt_ids: list[list[int]], seed: int):
        cfg = self.cfg
        model = self.pipeline.model if self.pipeline is not None else self.policy
        rollout = generate(model, self.tokenizer, prompt_ids, max_new_tokens=cfg.max_new_tokens,
                           temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
        if cfg.optimize_device_cache:
            release_device_cache()
        return rollout

    def _decode(self, rollout) -> list[str]:
        return [self.tokenizer.decode(c, skip_special_tokens=True) for c in rollout.completions()]

    def step(self, prompt_texts: list[str], prompt_ids: list[list[int]], metadata: list[dict] | None,
             iteration: int) -> dict:
        """One PPO iteration on this process's prompts; returns metrics averaged over processes."""
        cfg, acc, pipe = self.cfg, self.accelerator, self.pipeline
        B = len(prompt_ids)
        # 1. rollout
        t0 = time.time()
        seed = ((cfg.seed * 100_003 + iteration) * self.world + acc.process_index) * B
        rollout = self._rollout(prompt_ids, seed)
        t_gen = time.time() - t0
        # 2. scoring: reward source, then old policy / values / reference on the same tokens
        t1 = time.time()
        responses = self._decode(rollout)
        scores, extra = ppo_scores(self.reward, prompt_texts, responses, metadata)
        raw_scores = scores.clone()
        N = max(1, int(rollout.mask.sum(-1).max()))  # drop columns no row generated into
        P = rollout.prompt_ids.shape[1]
        tokens, mask = rollout.tokens[:, :N], rollout.mask[:, :N]
        batch = {"input_ids": torch.cat([rollout.prompt_ids, tokens], 1),
                 "attention_mask": torch.cat([rollout.prompt_mask, mask], 1), "tokens": tokens}
        old_logp, old_values, ref_logp = self._score_forward(batch, P)
        t_score = time.time() - t1
        # 3. rewards and advantages (fp32, on the device)
        t2 = time.time()
        dev = pipe.device
        maskf = mask.to(dev).float()
        scores = scores.to(dev)
        eos_missing = torch.tensor([r != "stop" for r in rollout.finish_reasons], device=dev)
        if cfg.missing_eos_penalty:
            scores = scores - cfg.missing_eos_penalty * eos_missing.float()
        if cfg.reward_clip:
            scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
        old_logp, ref_logp = old_logp * maskf, ref_logp * maskf
        kl = per_token_kl(old_logp, ref_logp, cfg.kl_estimator) * maskf
        kl_coef = self.kl_ctl.value
        rewards, non_score = kl_penalized_rewards(scores, kl, maskf, kl_coef)
        old_values = old_values.to(dev).float() * maskf
        adv, returns = gae(rewards, old_values, maskf, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = whiten(adv, maskf)
        # 4. PPO epochs over shuffled minibatches
        common = dict(P=P, clip_ratio=cfg.clip_ratio, value_clip=cfg.value_clip, value_coef=cfg.value_coef,
                      entropy_coef=cfg.entropy_coef, temperature=cfg.temperature)
        data = {"tokens": tokens.to(dev), "mask": maskf, "old_logprobs": old_logp, "advantages": adv,
                "old_values": old_values, "returns": returns}
        ids, attn = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + iteration)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        grad_norms = []
        lr = None
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(B, generator=gen)
            for mb in range(B // cfg.mini_batch_size):
                mb_idx = order[mb * cfg.mini_batch_size:(mb + 1) * cfg.mini_batch_size]
                for micro in mb_idx.split(cfg.micro_batch_size):
                    micro = micro.to(dev)
                    kw = {k: v[micro] for k, v in data.items()}
                    if self.critic_pipeline is None:
                        fn = partial(self._policy_loss, **common)
                        r = pipe.forward_backward_custom(fn, ids[micro], attn[micro], **kw).result()
                    else:
                        fn = partial(self._policy_loss, **{k: v for k, v in common.items()
                                                           if k not in ("value_clip", "value_coef")})
                        pk = {k: v for k, v in kw.items() if k not in ("old_values", "returns")}
                        r = pipe.forward_backward_custom(fn, ids[micro], attn[micro], **pk).result()
                        cfn = partial(self._critic_loss, P=P, value_clip=cfg.value_clip, value_coef=cfg.value_coef)
                        rc = self.critic_pipeline.forward_backward_custom(
                            cfn, ids[micro], attn[micro], mask=kw["mask"], old_values=kw["old_values"],
                            returns=kw["returns"]).result()
                        r.metrics.update(rc.metrics)
                    for k, v in r.metrics.items():
                        sums[k] = sums.get(k, 0.0) + v
                        counts[k] = counts.get(k, 0) + 1
                o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
                if self.critic_pipeline is not None:
                    self.critic_pipeline.optim_step(max_grad_norm=cfg.max_grad_norm).result()
                if o.grad_norm is not None:
                    grad_norms.append(o.grad_norm)
                lr = o.learning_rate
        t_train = time.time() - t2
        # 5. metrics (averaged over processes), KL controller
        seq_kl = kl.sum(-1)
        local = {
            "objective/scores": scores.mean(), "objective/scores_raw": raw_scores.mean().to(dev),
            "objective/kl": seq_kl.mean(), "objective/entropy": (-old_logp).sum(-1).mean(),
            "objective/non_score_reward": non_score.sum(-1).mean(),
            "objective/rlhf_reward": (scores + non_score.sum(-1)).mean(),
            "val/explained_variance": torch.tensor(explained_variance(old_values, returns, maskf), device=dev),
            "response_length": maskf.sum(-1).mean(), "eos_fraction": 1.0 - eos_missing.float().mean(),
            "val/returns_mean": (returns * maskf).sum() / maskf.sum().clamp(min=1),
        }
        for k in sums:
            local[k] = torch.tensor(sums[k] / counts[k], device=dev)
        for k, v in extra.items():
            local[k] = torch.tensor(v, device=dev)
        keys = sorted(local)
        vec = torch.stack([torch.as_tensor(local[k], device=dev, dtype=torch.float32).reshape(()) for k in keys])
        if self.world > 1:
            vec = acc.reduce(vec, "mean")
        metrics = {k: float(x) for k, x in zip(keys, vec.tolist())}
        self.kl_ctl.update(metrics["objective/kl"], cfg.batch_size * self.world)
        metrics.update({"kl_coef": kl_coef, "lr": lr, "grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
                        "time/generation": t_gen, "time/scoring": t_score, "time/training": t_train,
                        "time/iteration": time.time() - t0})
        self.last_rollout = {"prompts": prompt_texts, "responses": responses, "scores": raw_scores.tolist()}
        return metrics

    # ------------------------------------------------------------------ data
    def encode_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt (BOS first when the tokenizer has one), keeping the LAST
        max_length - max_new_tokens tokens of a prompt that is too long."""
        tok = self.tokenizer
        room = self.cfg.max_length - self.cfg.max_new_tokens
        bos = [tok.bos_token_id] if getattr(tok, "bos_token_id", None) is not None else []
        out, cut = [], 0
        for p in prompts:
            if not isinstance(p, str):
                raise ConfigError(f"prompts must be strings, got {type(p).__name__}")
            if self.cfg.chat_template:
                p = render_chat(tok, [{"role": "user", "content": p}], add_generation_prompt=True)
            ids = tok(p, add_special_tokens=False)["input_ids"]
            if bos and ids[:1] == bos:
                ids = ids[1:]
            ids = bos + ids
            if len(ids) > room:
                ids, cut = bos + ids[len(ids) - room + len(bos):], cut + 1
            out.append(ids)
        if cut:
            logger.warning("%d prompts were longer than max_length - max_new_tokens = %d tokens and lost their "
                           "beginning", cut, room)
        return out

    # ------------------------------------------------------------------ the loop
    def train(self, prompts: Sequence[str], num_iterations: int | None = None,
              metadata: Sequence[dict] | None = None, eval_prompts: Sequence[str] | None = None) -> list[dict]:
        """Run PPO on `prompts` (strings); returns one metrics dict per iteration (also `self.history`).

        Every process passes the same prompts; iteration i uses a seeded shuffle of them, and process r
        takes every world-th of the iteration's `batch_size * world` prompts. `metadata` (one dict per
        prompt, e.g. {"answer": ...}) is handed to the reward source."""
        cfg, acc = self.cfg, self.accelerator
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ConfigError("train() got no prompts")
        if metadata is not None and len(metadata) != len(prompts):
            raise ConfigError(f"metadata has {len(metadata)} entries for {len(prompts)} prompts")
        plan = self.plan(len(prompts), num_iterations)
        self._plan = plan
        self._setup(plan)
        out = Path(cfg.output_dir)
        if acc.is_main_process:
            save_config(cfg, out)
        tracker = Tracker(out, cfg.report_to, cfg.run_name, to_dict(cfg), plan["iterations"], acc.is_main_process,
                          desc="ppo", plot_keys=["objective/scores", "objective/kl", "kl_coef", "loss/policy",
                                                 "loss/value", "val/explained_variance", "policy/clipfrac",
                                                 "response_length", "objective/entropy"])
        n_train, n_all = trainable_fraction(self.policy)
        tracker.write(f"ppo: {len(prompts)} prompts, {plan['iterations']} iterations x {plan['global_batch']} "
                      f"rollouts, {plan['steps_per_iteration']} optimizer steps each; {self.world} process(es), "
                      f"ZeRO stage {zero_stage(acc)}; trainable {n_train:,}/{n_all:,} parameters; "
                      f"reward: {self.reward.name}; value: {cfg.value_model}; reference: "
                      f"{self.reference.description}")
        if zero_stage(acc) == 3:
            tracker.write("zero3 shards on rank 0: " + ", ".join(f"{k} {a:,}/{b:,}" for k, (a, b) in self.shard_report().items()))
        self._prompts, self._encoded, self._metadata = prompts, self.encode_prompts(prompts), metadata
        self._eval_prompts = eval_prompts
        rows = self.fit(plan["iterations"], tracker)
        self.history += rows
        return self.history

    # ------------------------------------------------------------------ the lifecycle's hooks
    @property
    def current_step(self) -> int:
        return self._iteration

    def train_step(self) -> list[dict]:
        it, prompts, metadata = self._iteration, self._prompts, self._metadata
        idx = self._global_indices(it, len(prompts))[self.accelerator.process_index::self.world]
        metrics = self.step([prompts[i] for i in idx], [self._encoded[i] for i in idx],
                            [dict(metadata[i]) for i in idx] if metadata is not None else None, it)
        self._iteration = it + 1
        return [{"step": it + 1, **metrics, "iteration": it + 1,
                 "epoch": (it + 1) * self._plan["global_batch"] / len(prompts)}]

    def evaluate_now(self) -> dict | None:
        return self.evaluate(self._eval_prompts) if self._eval_prompts else None

    def checkpoint_extra(self) -> dict:
        return {"iteration": self._iteration, "kl_coef": self.kl_ctl.value}

    def restore(self, extra: dict) -> None:
        self._iteration = int(extra["iteration"])
        self.kl_ctl.value = float(extra["kl_coef"])

    def save_checkpoint(self, name: str, extra: dict) -> None:
        self.pipeline.save_state(name, extra)
        if self.critic_pipeline is not None:
            self.critic_pipeline.save_state(name, extra)

    def load_checkpoint(self, path: Path) -> dict:
        extra = self.pipeline.load_state(path)
        if self.critic_pipeline is not None:
            self.critic_pipeline.load_state(Path(path).parent / "critic" / Path(path).name)
        return extra

    def shard_report(self) -> dict[str, tuple[int, int]]:
        """{model: (parameters held by this process, all parameters)}; under ZeRO-3 the first is a shard."""
        def count(params):
            params = list(params)
            local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
            return local, sum(getattr(p, "ds_numel", None) or p.numel() for p in params)

        policy = self.pipeline.unwrapped_model
        out = {"policy": count(policy.base_model.parameters())}
        if policy.value_head is not None:
            out["value head"] = count(policy.value_head.parameters())
        if self.reference.mode == "copy":
            out["reference"] = count(self.reference.model.parameters())
        if self.critic_pipeline is not None:
            out["critic"] = count(self.critic_pipeline.unwrapped_model.parameters())
        return out

    def _global_indices(self, iteration: int, n: int) -> list[int]:
        """The iteration's batch_size * world prompt indices: consecutive slices of per-epoch seeded
        shuffles (so every prompt is used once per epoch), identical on every process."""
        G = self._plan["global_batch"]
        out, pos = [], iteration * G
        while len(out) < G:
            epoch, offset = divmod(pos, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed + epoch)).tolist()
            take = order[offset:offset + G - len(out)]
            out += take
            pos += len(take)
        return out


    @torch.no_grad()
    def evaluate(self, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> dict:
        """Sample once per prompt (this process's share) and score: eval/scores, eval/response_length."""
        acc = self.accelerator
        idx = list(range(len(prompts)))[acc.process_index::self.world]
        if not idx:  # every process must generate (ZeRO-3 gathers collectively)
            idx = [0]
        texts = [prompts[i] for i in idx]
        rollout = self._rollout(self.encode_prompts(texts), seed=self.cfg.seed + 1_000_000_007)
        scores, _ = ppo_scores(self.reward, texts, self._decode(rollout), [metadata[i] for i in idx] if metadata else None)
        vec = torch.stack([scores.mean(), rollout.mask.sum(-1).float().mean().cpu()]).to(acc.device)
        if self.world > 1:
            vec = acc.reduce(vec, "mean")
        return {"eval/scores": float(vec[0]), "eval/response_length": float(vec[1])}

    # ------------------------------------------------------------------ saving
    def save(self, out_dir: str | None = None) -> str:
        """Write the policy as an HF model directory (LoRA merged, no value head) plus
        `value_head.safetensors`; every process must call it (ZeRO-3 gathers the weights)."""
        acc = self.accelerator
        out = Path(out_dir or self.cfg.output_dir)
        state = acc.get_state_dict(self.pipeline.model)
        if acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            base = self.pipeline.unwrapped_model.base_model
            prefix = "base_model."
            base_sd = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            head_sd = {k[len("value_head."):]: v.contiguous() for k, v in state.items() if k.startswith("value_head.")}
            # LoRA is merged from the gathered state dict (a copy of ZeRO-3 shards would be empty)
            write_pretrained(base, base_sd, self.tokenizer, out)
            if head_sd:
                save_file(head_sd, str(out / "value_head.safetensors"))
            (out / "ppo_summary.json").write_text(json.dumps(self.history[-1] if self.history else {}, indent=2))
        acc.wait_for_everyone()
        return str(out)


# ==================================================================================================
# A toy reward with a known optimum (tiny recipe and tests)
# ==================================================================================================

def char_fraction_reward(prompts: Sequence[str], responses: Sequence[str], metadata=None,
                         char: str = "a") -> list[float]:
    """Fraction of the response's characters equal to `char` (0 for an empty response); the optimum
    1.0 is a response of only that character. Used by recipes/tiny/ppo.yaml as
    `reward_fn: custom, custom_reward: rl.ppo:char_fraction_reward`."""
    return [r.count(char) / len(r) if r else 0.0 for r in responses]
