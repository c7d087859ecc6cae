"""What a PPO run fixes before its first model: the recipe schema and its derived sizes, the check
that some reward source exists, and the prompts (read from a file, then tokenised)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Literal, Sequence

from rl.algos import names
from rl.algos.policy_losses import KIND
from rl.algos.registry import check, choices
from rl.config.fields import opt
from rl.config.schema import SamplingKeys, TrainConfig, VLLMKeys
from rl.data.columns import column_keys
from rl.data.records import (
    has_data,
    load_records,
    read_records,
    source_options,
    where,
)
from rl.errors import ConfigError, DataError
from rl.models.limits import context_length
from rl.models.loading import load_tokenizer, vocabulary_mismatch
from rl.models.reward_format import CONFIG_FILE
from rl.models.sources import resolve_model_path
from rl.rewards.functions import reward_columns_problem
from rl.trainers.rewards import env_keys_problem
from rl.rollout.prompts import encode_prompt

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PPOConfig(SamplingKeys, VLLMKeys, TrainConfig):
    """Every field of the reference's PPOConfig, with the reference's meanings (its names are accepted
    silently: batch_size, ppo_epochs, clip_ratio, kl_penalty_coef, value_coef, max_new_tokens, save_every,
    eval_every; rl.config.vocabulary), plus the rest of what a PPO run needs.

    Sizes are per process: each process samples `per_device_train_batch_size` prompts per round (one
    rollout batch), and each optimizer step uses `mini_batch_size` of them, in `gradient_accumulation_steps`
    micro-batches of mini_batch_size / gradient_accumulation_steps; `num_ppo_epochs` passes over the
    rollout batch (the reference's ppo_epochs) make num_ppo_epochs x per_device_train_batch_size /
    mini_batch_size optimizer steps per round. The run is `num_iterations` rounds (the reference's
    meaning), else `max_steps` optimizer steps, else `num_train_epochs` passes over the prompts. Where the
    reference's Python example and its CLI table differ, the defaults are the CLI's (the documented
    defaults of the rl_* names: rl_max_new_tokens 128, rl_top_k 50, rl_kl_coef 0.1, ...)."""

    per_device_train_batch_size: int = opt(16, "PPO: prompts sampled per process per round (the rollout batch; "
                                           "TRL's PPO calls that its batch and trains it in micro-batches of "
                                           "mini_batch_size / gradient_accumulation_steps)")
    mini_batch_size: int | None = opt(None, "rollouts per optimizer step, per process; divides "
                                      "per_device_train_batch_size (null: min(8, per_device_train_batch_size), the "
                                      "CLI's documented 8 capped at the rollout batch)")
    num_ppo_epochs: int = opt(4, "policy updates per rollout batch: passes over it in shuffled minibatches (the "
                              "reference's ppo_epochs and --rl-num-ppo-epochs; TRL's num_ppo_epochs)")
    num_iterations: int | None = opt(None, "rollout rounds (the reference's num_iterations; PPOTrainer.train(prompts, "
                                     "num_iterations=N) too): each samples a rollout batch and trains on it; null: "
                                     "max_steps optimizer steps, else num_train_epochs passes over the prompts")
    max_completion_length: int = opt(128, "new tokens per completion at most (the reference's max_new_tokens, "
                                     "--rl-max-new-tokens; its documented default 128)")
    top_k: int = opt(50, "sample from the k most likely tokens (0: all; the reference CLI's default 50)")
    logprob_chunk_size: int | None = opt(128, "the LM head and log-softmax run over this many positions of each "
                                         "sequence at a time in training and scoring forwards (the reference's "
                                         "--rl-chunk-size, its documented default 128; null: automatic; 0: never)")
    optimize_device_cache: bool = opt(True, "free the accelerator's cached memory between generation and training "
                                      "(the reference's --rl-optimize-device-cache, documented default true)")
    gamma: float = opt(0.99, "discount factor (0.9-1.0)")
    lam: float = opt(0.95, "GAE lambda (0.9-0.99)")
    epsilon: float = opt(0.2, "clip the policy ratio to [1 - epsilon, 1 + epsilon] (TRL's cliprange)")
    loss_type: str = opt("ppo", f"policy loss ({choices(KIND)}): ppo (the clipped surrogate, token mean) or any of "
                         "the GRPO family's (rl.algos.policy_losses), with its clip range epsilon")
    value_clip: float | None = opt(0.2, "value clip range around the rollout's values (null: no clipping)")
    beta: float = opt(0.1, "KL coefficient beta, initial value with adaptive_kl (per-token reward -beta*KL; TRL's "
                      "kl_coef); 0: no penalty and no reference model (objective/kl then reads 0)")
    adaptive_kl: bool = opt(True, "adapt the KL coefficient towards kl_target (Ziegler et al. 2019)")
    kl_target: float = opt(6.0, "target KL per sequence in nats (summed over response tokens), adaptive_kl only")
    kl_horizon: int = opt(10000, "adaptive KL horizon in samples")
    kl_estimator: Literal[names("kl_estimator")] = opt(
        "k1", "per-token KL estimator: k1 = log p/p_ref, k2 = (log p/p_ref)^2 / 2, k3 = r-1-log r")
    entropy_coef: float = opt(0.01, "entropy bonus coefficient (response tokens only)")
    vf_coef: float = opt(1.0, "value loss coefficient (TRL's vf_coef)")
    whiten_advantages: bool = opt(True, "normalise advantages to mean 0 / std 1 per rollout batch")
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
    eval_steps: int | float | None = opt(0, "score held-out prompts every N optimizer steps (0: only at the end, if any)")
    packing: bool = opt(False, "padding-free training forwards (policy and critic): each micro-batch's prompt+"
                        "response rows packed into rows no longer than its longest, with per-row position_ids "
                        "(rl.engine.packing); same loss")

    # a reward source on the command line replaces the recipe's (rl.config.fields._cli_replaces_reward_sources)
    REWARD_SOURCE_KEYS = ("reward_model_path", "reward_fn", "env_type", "multi_objective")
    # the run's length, in rounds or in optimizer steps: one on the command line replaces the recipe's other
    ALTERNATIVES = (("num_iterations", "max_steps"),)

    def __post_init__(self):
        self.resolve_lengths()
        super().__post_init__()
        self.check_vllm()
        if self.mini_batch_size is None:  # derived once here, so the doc's batch_size=4 needs no extra key
            self.mini_batch_size = min(8, self.per_device_train_batch_size)
        for name in ("mini_batch_size", "num_ppo_epochs", "kl_horizon"):
            if getattr(self, name) < 1:
                raise ConfigError(f"key '{name}' must be at least 1, got {getattr(self, name)}")
        if self.num_iterations is not None and self.num_iterations < 1:
            raise ConfigError(f"key 'num_iterations' (rollout rounds) must be at least 1 or null, got {self.num_iterations}")
        if self.num_iterations is not None and self.max_steps is not None:
            raise ConfigError(f"num_iterations={self.num_iterations} (rollout rounds) and max_steps={self.max_steps} "
                              f"(optimizer steps) both set the run's length; keep one")
        if self.per_device_train_batch_size % self.mini_batch_size:
            raise ConfigError(f"per_device_train_batch_size {self.per_device_train_batch_size} is not a multiple of mini_batch_size "
                              f"{self.mini_batch_size}; make the rollout batch a whole number of minibatches")
        if self.mini_batch_size % self.gradient_accumulation_steps:
            raise ConfigError(f"mini_batch_size {self.mini_batch_size} is not a multiple of "
                              f"gradient_accumulation_steps {self.gradient_accumulation_steps}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"key '{name}' must be in [0, 1], got {getattr(self, name)}")
        check(KIND, self.loss_type, "loss_type")
        if not self.epsilon > 0:
            raise ConfigError(f"key 'epsilon' must be > 0, got {self.epsilon}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ConfigError(f"key 'value_clip' must be > 0 or null, got {self.value_clip}")
        if not self.temperature > 0:
            raise ConfigError(f"key 'temperature' must be > 0 (PPO needs sampling), got {self.temperature}")
        if self.beta < 0 or not self.kl_target > 0:
            raise ConfigError("key 'beta' must be >= 0 and kl_target > 0")
        self.check_sampling()
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


def ppo_plan(cfg: PPOConfig, n_prompts: int | None, world: int, rounds: int | None = None) -> dict:
    """Derived sizes: rollouts per round (all processes), rounds ("iterations"), optimizer steps. The run is
    `rounds` rounds when given (PPOTrainer.train's num_iterations), else cfg.num_iterations rounds, else
    max_steps optimizer steps (the last round may stop part-way), else num_train_epochs passes over the
    prompts."""
    rounds = rounds if rounds is not None else cfg.num_iterations
    global_batch = cfg.per_device_train_batch_size * world
    per_epoch = max(1, math.ceil(n_prompts / global_batch)) if n_prompts else None
    mini_batches = cfg.per_device_train_batch_size // cfg.mini_batch_size
    steps_per_iteration = cfg.num_ppo_epochs * mini_batches
    if rounds is None and cfg.max_steps is not None:
        iterations = math.ceil(cfg.max_steps / steps_per_iteration)
    else:
        iterations = rounds or (per_epoch * cfg.num_train_epochs if per_epoch else None)
    total = (cfg.max_steps if rounds is None and cfg.max_steps is not None
             else iterations * steps_per_iteration if iterations else None)
    # per_device_batch / global_batch / steps_per_epoch in PPO's own units (the dry run prints these):
    # rollouts per forward, rollouts per iteration, iterations per pass over the prompts
    return {"world_size": world, "per_device_batch": cfg.micro_batch_size, "global_batch": global_batch,
            "steps_per_epoch": per_epoch, "iterations": iterations,
            "mini_batches_per_epoch": mini_batches, "micro_batch_size": cfg.micro_batch_size,
            "steps_per_iteration": steps_per_iteration,
            "total_steps": total, "prompts": n_prompts}


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


def critic_problem(cfg: PPOConfig) -> str | None:
    """value_model=critic started from another directory (critic_model_path, else reward_model_path) reads the
    policy's token ids at up to max_length positions: why it cannot, in one line, before any model loads (its
    tokenizer maps an id to another token than the policy's, or its context is below max_length); None when it can
    or when the directory cannot be read here (its loader then says why)."""
    key = next((k for k in ("critic_model_path", "reward_model_path") if getattr(cfg, k)), None)
    if cfg.value_model != "critic" or key is None or getattr(cfg, key) == cfg.model_name:
        return None
    from transformers import AutoConfig

    path = Path(resolve_model_path(getattr(cfg, key)))
    meta = path / CONFIG_FILE  # a LoRA reward model names its backbone there
    base = json.loads(meta.read_text())["config"].get("model_name") if meta.is_file() else str(path)
    try:
        found = context_length(AutoConfig.from_pretrained(path if (path / "config.json").is_file() else base,
                                                          trust_remote_code=cfg.trust_remote_code))
        theirs = load_tokenizer(str(path if (path / "tokenizer_config.json").is_file() else base), cfg.trust_remote_code)
        mismatch = vocabulary_mismatch(load_tokenizer(cfg.model_name, cfg.trust_remote_code), theirs, "the policy's")
    except (OSError, ValueError, KeyError, ConfigError):
        return None
    what = f"key '{key}': the critic {getattr(cfg, key)} reads the policy's token ids"
    if found is not None and cfg.max_length > found[0]:
        return (f"{what} at up to max_length={cfg.max_length} positions, but its context is {found[0]} (its config's "
                f"{found[1]}); set max_length={found[0]} or less, or start the critic from another model")
    if mismatch:
        return (f"{what}, but its tokenizer {mismatch}; start the critic from a model with the policy's tokenizer "
                f"(critic_model_path={cfg.model_name} starts it from the policy)")
    return None


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
    # names file:line, and data.text_column for a missing prompt column
    load_records(path, columns=[d.text_column], max_examples=d.max_examples, keys=column_keys(d), **source)
    rows = read_records(path, **source)
    rows = rows[:d.max_examples] if d.max_examples else rows
    problem = rows and reward_columns_problem(cfg, {k for r in rows[:1000] for k in r} - {"_line"},
                                              where(path, rows[0]))
    if problem:  # e.g. reward_fn=correctness without an 'answer' column: before any model, not at the first reward
        raise DataError(problem)
    return ([r[d.text_column] for r in rows],
            [{k: v for k, v in r.items() if k not in (d.text_column, "_line")} for r in rows])


def load_prompt_data(cfg: PPOConfig) -> tuple[list[str] | None, list[dict] | None, list[str] | None,
                                              list[dict] | None]:
    """(prompts, metadata, eval_prompts, eval_metadata) of a recipe; prompts None when the environment
    supplies them. The metadata are each row's other columns (a correctness reward reads `answer`)."""
    problem = env_keys_problem(cfg, env_supplies_prompts=False)  # env_config without an environment
    if problem:
        raise ConfigError(problem)
    if not has_data(cfg.data) and not (cfg.env_type or cfg.multi_objective):
        raise ConfigError("data.path is not set: pass --data.path prompts.jsonl (rows {\"text\": ...}) "
                          "or set data: {path: ...} (or data.mixture) in the recipe")
    prompts, metadata = load_prompts(cfg.data.path, cfg) if has_data(cfg.data) else (None, None)
    eval_prompts, eval_metadata = (load_prompts(cfg.data.eval_path, cfg, for_eval=True) if cfg.data.eval_path
                                   else (None, None))
    return prompts, metadata, eval_prompts, eval_metadata


def encode_prompts(tok, prompts: Sequence[str], cfg: PPOConfig) -> list[list[int]]:
    """Token ids of each prompt (`rl.rollout.prompts.encode_prompt`: BOS once, the chat template with
    chat_template), keeping BOS and the LAST max_length - max_completion_length tokens of a prompt that is too long."""
    room = cfg.prompt_budget
    out = []
    for p in prompts:
        if not isinstance(p, str):
            raise ConfigError(f"prompts must be strings, got {type(p).__name__}")
        out.append(encode_prompt(tok, p, None, cfg.chat_template))
    cut = sum(len(ids) > room for ids in out)
    if cut:
        logger.warning("%d prompts were longer than max_length - max_completion_length = %d tokens and lost their "
                       "beginning", cut, room)
    return [encode_prompt(tok, p, room, cfg.chat_template) if len(ids) > room else ids
            for p, ids in zip(prompts, out)]