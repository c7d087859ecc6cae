"""What a PPO run fixes before its first model: the recipe schema and its derived sizes, the check
that some reward source exists, and the prompts (read from a file, then tokenised)."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Literal, Sequence

from rl.algos import names
from rl.algos.policy_losses import KIND
from rl.algos.registry import check, choices
from rl.config.fields import opt
from rl.config.schema import TrainConfig, VLLMKeys
from rl.data.records import (
    has_data,
    load_records,
    read_records,
    source_options,
)
from rl.errors import ConfigError
from rl.rollout.prompts import encode_prompt

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PPOConfig(VLLMKeys, TrainConfig):
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
    loss_type: str = opt("ppo", f"policy loss ({choices(KIND)}): ppo (the clipped surrogate, token mean) or any of "
                         "the GRPO family's (rl.algos.policy_losses), with epsilon = clip_ratio")
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
    save_every: int = opt(0, "checkpoint every N optimizer steps (0: only the final model)")
    eval_every: int = opt(0, "score held-out prompts every N optimizer steps (0: only at the end, if any)")
    packing: bool = opt(False, "padding-free training forwards (policy and critic): each micro-batch's prompt+"
                        "response rows packed into rows no longer than its longest, with per-row position_ids "
                        "(rl.engine.packing); same loss")

    # a reward source on the command line replaces the recipe's (rl.config.fields._cli_replaces_reward_sources)
    REWARD_SOURCE_KEYS = ("reward_model_path", "reward_fn", "env_type", "multi_objective")

    def __post_init__(self):
        super().__post_init__()
        self.check_vllm()
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
        check(KIND, self.loss_type, "loss_type")
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


def ppo_dry_run_models(cfg: PPOConfig) -> dict:
    """The models a PPO run holds, for the dry-run memory plan (the reference as ReferencePolicy decides)."""
    models = {"policy (trainable)": cfg.model_name,
              "reference (frozen)": cfg.ref_model or ("policy without adapters" if cfg.lora.enabled
                                                      else cfg.model_name),
              "reward model (frozen)": cfg.reward_model_path or cfg.reward_fn or f"env:{cfg.env_type or 'multi_objective'}"}
    if cfg.value_model == "critic":
        models["value (trainable)"] = {"name": cfg.critic_model_path or cfg.reward_model_path or cfg.model_name,
                                       "trainable": True, "task": "classifier"}
    return models


def load_prompts(path: str, cfg: PPOConfig, for_eval: bool = False) -> tuple[list[str], list[dict]]:
    """Prompt strings and, per prompt, the row's other columns as metadata. `for_eval`: path is
    data.eval_path (its split is data.eval_split)."""
    d = cfg.data
    source = source_options(d, for_eval, seed=cfg.seed)
    load_records(path, columns=[d.text_column], max_examples=d.max_examples, **source)  # names file:line
    rows = read_records(path, **source)
    rows = rows[:d.max_examples] if d.max_examples else rows
    return ([r[d.text_column] for r in rows],
            [{k: v for k, v in r.items() if k not in (d.text_column, "_line")} for r in rows])


def load_prompt_data(cfg: PPOConfig) -> tuple[list[str] | None, list[dict] | None, list[str] | None,
                                              list[dict] | None]:
    """(prompts, metadata, eval_prompts, eval_metadata) of a recipe; prompts None when the environment
    supplies them. The metadata are each row's other columns (a correctness reward reads `answer`)."""
    if not has_data(cfg.data) and not (cfg.env_type or cfg.multi_objective):
        raise ConfigError("data.path is not set: pass --data.path prompts.jsonl (rows {\"text\": ...}) "
                          "or set data: {path: ...} (or data.mixture) in the recipe")
    prompts, metadata = load_prompts(cfg.data.path, cfg) if has_data(cfg.data) else (None, None)
    eval_prompts, eval_metadata = (load_prompts(cfg.data.eval_path, cfg, for_eval=True) if cfg.data.eval_path
                                   else (None, None))
    return prompts, metadata, eval_prompts, eval_metadata


def encode_prompts(tok, prompts: Sequence[str], cfg: PPOConfig) -> list[list[int]]:
    """Token ids of each prompt (`rl.rollout.prompts.encode_prompt`: BOS once, the chat template with
    chat_template), keeping BOS and the LAST max_length - max_new_tokens tokens of a prompt that is too long."""
    room = cfg.max_length - cfg.max_new_tokens
    out = []
    for p in prompts:
        if not isinstance(p, str):
            raise ConfigError(f"prompts must be strings, got {type(p).__name__}")
        out.append(encode_prompt(tok, p, None, cfg.chat_template))
    cut = sum(len(ids) > room for ids in out)
    if cut:
        logger.warning("%d prompts were longer than max_length - max_new_tokens = %d tokens and lost their "
                       "beginning", cut, room)
    return [encode_prompt(tok, p, room, cfg.chat_template) if len(ids) > room else ids
            for p, ids in zip(prompts, out)]