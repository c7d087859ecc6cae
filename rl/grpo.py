"""GRPO and its critic-free relatives: sample a group of completions per prompt, score them with
reward functions or an environment, use the group as the baseline, and take clipped policy steps.

Objective (Shao et al. 2024, DeepSeekMath, eq. 3; the per-token form TRL implements):

    L = agg_t [ -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * r_t * k3_t ]
    r_t = pi(o_t | q, o_<t) / pi_old(o_t | q, o_<t)
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (Schulman's k3, always >= 0)
    (the r_t factor on the KL term is TRL 1.16's default use_bias_correction_kl; set it false for plain k3)

Advantages (one scalar per completion, broadcast over its tokens), rewards grouped per prompt:
    grpo          (r - mean_group) / (std_group + 1e-4)       GRPO (Shao et al. 2024); TRL scale_rewards="group"
    dr_grpo       r - mean_group                               Dr. GRPO (Liu et al. 2025); TRL scale_rewards="none"
    rloo          r - mean of the other G-1 rewards            RLOO (Ahmadian et al. 2024); TRL RLOOTrainer
    reinforce_pp  (r - mean_group), then normalised by the     REINFORCE++-baseline (Hu et al. 2025)
                  mean/std of the whole batch
std is Bessel-corrected (torch.std, TRL's nanstd). A reward function may return None for a completion
(TRL semantics): None counts as NaN, weighted rewards are summed over the functions that answered,
a completion nobody scored gets advantage 0 and is left out of its group's statistics.

Aggregation over tokens (`loss_aggregation`):
    token_mean     sum over all completion tokens of the optimizer step / their number (DAPO; TRL
                   loss_type="dapo"). Computed exactly across micro-batches and processes.
    sequence_mean  mean over sequences of each sequence's token mean (the GRPO paper; TRL "grpo").
    constant       sum / (sequences * max_completion_length) (Dr. GRPO; TRL "dr_grpo"): no length bias.

Deviations and choices: with num_iterations = 1 the old policy is the current one (ratio 1, as TRL
does); with more iterations the old log-probs are recomputed by a no-grad forward before the first
update. Log-probs use logits / temperature, like the sampler (TRL does the same). Groups never span
processes: each process generates whole groups, rewards are gathered so that advantages and reward
metrics are computed on the global batch (reinforce_pp needs it). Checked against TRL 1.16's
GRPOTrainer/RLOOTrainer formulas in tests/test_grpo_trl.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from pathlib import Path
from typing import Callable, Literal, Sequence

import torch

from rl import losses
from rl.algos import names
from rl.algos.advantages import (STD_EPS, compute_advantages, dr_grpo_advantages, grpo_advantages,  # noqa: F401
                                 group_stats, nanstd, reinforce_pp_advantages, rloo_advantages)
from rl.algos.kl import k3_kl  # noqa: F401
from rl.algos.policy_losses import LOSS_AGGREGATIONS, grpo_loss  # noqa: F401
from rl.checkpoint import checkpoint_dir
from rl.config import ConfigError, TrainConfig, opt, save_config, to_dict
from rl.data import render_chat, with_bos
from rl.environments import make_env
from rl.forward_backward import ForwardBackwardPipeline, build_accelerator, zero_stage
from rl.generation import generate, position_ids_from_mask, sequence_logprobs
from rl.models import (apply_lora, build_optimizer, build_scheduler, load_tokenizer, load_trainable_policy,
                       release_device_cache, resolve_dtype, save_pretrained, trainable_fraction)
from rl.reference import ReferencePolicy
from rl.reward_sources import (RewardModelReward, build_reward_fns, combine_rewards,  # noqa: F401
                               resolve_reward_func)
from rl.tracking import Tracker
from rl.trainers.base import Trainer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GRPOConfig(TrainConfig):
    num_generations: int = opt(8, "completions sampled per prompt (the group size G)")
    max_completion_length: int = opt(64, "new tokens per completion at most")
    temperature: float = opt(1.0, "sampling temperature (log-probs in the loss use the same temperature)")
    top_k: int = opt(0, "sample from the k most likely tokens (0: all)")
    top_p: float = opt(1.0, "nucleus sampling mass (1.0: off)")
    advantage_estimator: Literal[names("advantage_estimator")] = opt(
        "grpo", "grpo (group mean/std), dr_grpo (group mean only), rloo (leave-one-out), reinforce_pp (batch-normalised)")
    loss_aggregation: Literal[LOSS_AGGREGATIONS] = opt(
        "token_mean", "token_mean (DAPO), sequence_mean (GRPO paper) or constant (Dr. GRPO: / max_completion_length)")
    epsilon_low: float = opt(0.2, "clip the ratio below at 1 - epsilon_low")
    epsilon_high: float = opt(0.2, "clip the ratio above at 1 + epsilon_high (DAPO recommends 0.28)")
    beta: float = opt(0.0, "k3 KL penalty to the reference model; 0 loads no reference model")
    use_bias_correction_kl: bool = opt(True, "multiply the k3 term by the importance ratio (unbiased reverse-KL "
                                       "gradient, DeepSeek-V3.2; TRL 1.16's default)")
    num_iterations: int = opt(1, "policy updates per generated batch (mu in the GRPO paper)")
    reward_funcs: list[str] = opt([], "reward functions: rl.rewards names (correctness, default, length_penalty) "
                                  "or 'module:function' with TRL's signature (prompts, completions, **columns)")
    reward_model_path: str | None = opt(None, "reward model directory written by launch/reward.py (scores prompt + "
                                        "completion); one more reward source")
    reward_weights: list[float] | None = opt(None, "one weight per reward source (the environment first, then the "
                                             "reward model, then reward_funcs); default all 1.0")
    reward_timeout: float | None = opt(300.0, "seconds a reward source may take per batch (null or 0: no limit)")
    env_type: str | None = opt(None, "environment as prompt and reward source: math, code, text_generation, "
                               "multi_objective, preference_comparison")
    env_config: dict = opt({}, "keyword arguments of the environment (see rl.environments.make_env)")
    eval_env_config: dict | None = opt(None, "environment config for evaluation (e.g. {split: test}); greedy "
                                       "decoding, reports eval/accuracy and eval/reward")
    eval_num_prompts: int = opt(200, "evaluation prompts at most (duplicates removed)")
    chat_template: bool = opt(False, "render each prompt as a user turn with the tokenizer's chat template "
                              "(instruct models); reward functions still see the plain prompt")

    # a reward source on the command line replaces the recipe's (the environment stays: it is the prompts)
    REWARD_SOURCE_KEYS = ("reward_model_path", "reward_funcs")

    def __post_init__(self):
        super().__post_init__()
        if self.num_generations < 2:
            raise ConfigError(f"key 'num_generations' must be at least 2 (the group is the baseline), "
                              f"got {self.num_generations}")
        per_process = self.batch_size * self.gradient_accumulation_steps
        if per_process % self.num_generations:
            raise ConfigError(f"batch_size x gradient_accumulation_steps = {self.batch_size} x "
                              f"{self.gradient_accumulation_steps} = {per_process} completions per process must be "
                              f"a multiple of num_generations={self.num_generations} (whole groups per process)")
        if self.max_completion_length < 1:
            raise ConfigError(f"key 'max_completion_length' must be at least 1, got {self.max_completion_length}")
        if self.max_length <= self.max_completion_length:
            raise ConfigError(f"max_length={self.max_length} leaves no room for the prompt next to "
                              f"max_completion_length={self.max_completion_length}; raise max_length")
        for name in ("epsilon_low", "epsilon_high", "beta"):
            if getattr(self, name) < 0:
                raise ConfigError(f"key '{name}' must be >= 0, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"key 'temperature' must be >= 0, got {self.temperature}")
        if self.num_iterations < 1:
            raise ConfigError(f"key 'num_iterations' must be at least 1, got {self.num_iterations}")
        if self.reward_timeout is not None and not self.reward_timeout >= 0:
            raise ConfigError(f"key 'reward_timeout' must be >= 0 seconds or null, got {self.reward_timeout}")

    @property
    def prompt_budget(self) -> int:
        """Prompt tokens kept (from the right) so that prompt + completion fits max_length."""
        return self.max_length - self.max_completion_length


# ============================================================================ pure math
# Advantages and the loss are in rl.algos, the reward sources and combine_rewards in rl.reward_sources
# (names kept importable from here).

def grpo_loss_fn(logits, labels, attention_mask=None, *, advantages, old_logprobs=None, ref_logprobs=None,
                 temperature: float = 1.0, **kw):
    """Engine signature `(logits, labels, attention_mask, **kw) -> (loss, metrics)`.

    old_logprobs/ref_logprobs are (B, T-1) aligned with labels[:, 1:]; old_logprobs None means the
    current policy (detached), i.e. ratio 1 (num_iterations = 1)."""
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp, mask = losses.token_logprobs(logits, labels)
    old = logp.detach() if old_logprobs is None else old_logprobs
    return grpo_loss(logp, old, advantages, mask, ref_logp=ref_logprobs, **kw)


# ============================================================================ evaluation

@torch.no_grad()
def greedy_eval(model, tokenizer, env, prompts: list[str], metadata: list[dict], max_new_tokens: int,
                prompt_budget: int = 512, batch_size: int = 64, chat: bool = False) -> dict:
    """Greedy completions scored by `env`: eval/accuracy (mean correctness component when the env has
    one, else the fraction of rewards > 0), eval/reward, eval/mean_length. Every rank must call it
    under ZeRO-3 (generation gathers the parameters)."""
    rewards, correct, lengths = [], [], []
    for i in range(0, len(prompts), batch_size):
        ps, ms = prompts[i:i + batch_size], metadata[i:i + batch_size]
        ids = [encode_prompt(tokenizer, p, prompt_budget, chat) for p in ps]
        out = generate(model, tokenizer, ids, max_new_tokens=max_new_tokens, temperature=0.0)
        texts = tokenizer.batch_decode(out.completions(), skip_special_tokens=True)
        r, m = env.score(ps, texts, ms)
        rewards += r
        correct += m.get("reward_correctness", [1.0 if x > 0 else 0.0 for x in r])
        lengths += out.lengths.tolist()
    n = max(len(rewards), 1)
    return {"eval/accuracy": sum(correct) / n, "eval/reward": sum(rewards) / n,
            "eval/mean_length": sum(lengths) / n, "eval/num_prompts": len(rewards)}


def unique_eval_set(env, limit: int) -> tuple[list[str], list[dict]]:
    """The environment's fixed prompts without duplicates (generated test splits repeat problems)."""
    seen, prompts, metas = set(), [], []
    for p, m in zip(env.prompts, env.metadata):
        if p not in seen:
            seen.add(p)
            prompts.append(p)
            metas.append(m)
        if len(prompts) >= limit:
            break
    return prompts, metas


def encode_prompt(tokenizer, prompt: str, budget: int, chat: bool = False) -> list[int]:
    """BOS + prompt tokens (as the SFT trainer tokenises prompts), keeping the last `budget` tokens;
    with `chat`, the prompt is first rendered as a user turn followed by the assistant's header."""
    if chat:
        prompt = render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    return with_bos(tokenizer, tokenizer(prompt, add_special_tokens=False)["input_ids"])[-budget:]


def grpo_sizes(cfg: GRPOConfig, world: int, n_prompts: int | None = None) -> dict:
    """GRPO's batch arithmetic in its own units (also what --dry-run prints): completions per micro-batch
    (per_device_batch) and per optimizer step (global_batch), whole groups of num_generations each, so
    prompts per step = global_batch / num_generations; steps per pass over `n_prompts` data rows."""
    per_process = cfg.batch_size * cfg.gradient_accumulation_steps
    prompts_per_process = per_process // cfg.num_generations
    prompts_per_step = prompts_per_process * world
    return {"per_device_batch": cfg.batch_size, "global_batch": per_process * world,
            "completions_per_process": per_process, "prompts_per_process": prompts_per_process,
            "prompts_per_step": prompts_per_step,
            "steps_per_epoch": n_prompts // prompts_per_step if n_prompts is not None else None}


# ============================================================================ trainer

class GRPOTrainer(Trainer):
    """GRPO-family trainer on the shared engine.

    `GRPOTrainer(cfg, model=None, tokenizer=None, reward_funcs=None, train_prompts=None)`:
    reward_funcs are extra callables in TRL's signature (added after the config's); train_prompts is a
    list of {"prompt": str, <column>: value, ...} rows when no environment is configured (the launch
    script reads them from data.path)."""

    def __init__(self, cfg: GRPOConfig, model=None, tokenizer=None, reward_funcs: Sequence[Callable] | None = None,
                 train_prompts: list[dict] | None = None):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.tokenizer = tokenizer or load_tokenizer(cfg.model_name, cfg.trust_remote_code)
        # reward sources (rl.reward_sources): the environment, the reward model, the configured names, then
        # the callables; built before the accelerator so that a reward model is not ZeRO-3 partitioned
        self.env = None
        try:
            if cfg.env_type:
                self.env = make_env(cfg.env_type, self.tokenizer, dict(cfg.env_config))
            self.eval_env = (make_env(cfg.env_type, self.tokenizer, {**cfg.env_config, **cfg.eval_env_config})
                             if cfg.env_type and cfg.eval_env_config is not None else None)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"env_type={cfg.env_type}: {e}") from None
        self.reward = build_reward_fns(cfg, self.tokenizer, reward_funcs=reward_funcs or (), env=self.env,
                                       missing="no reward source: set env_type (e.g. env_type=math), "
                                       "reward_model_path or reward_funcs (e.g. reward_funcs=[correctness]), "
                                       "or pass reward_funcs= to GRPOTrainer")
        train_dtype = resolve_dtype(cfg.dtype)
        self.accelerator = build_accelerator(
            cfg.gradient_accumulation_steps, micro_batch_size=cfg.batch_size, max_grad_norm=cfg.max_grad_norm,
            mixed_precision="bf16" if train_dtype == torch.bfloat16 else "no", deepspeed_config=cfg.deepspeed)
        rm = self.reward.find(RewardModelReward)
        if rm is not None and not getattr(rm.model.config, "quantization", None):
            rm.model.to(self.accelerator.device)
        if self.env is None and not train_prompts:
            raise ConfigError("no prompts: set env_type or data.path (rows with a 'prompt' column)")
        self.train_prompts = train_prompts
        if model is None:
            model = load_trainable_policy(cfg)
        # beta = 0: no reference model at all (no memory, no forward); decided before LoRA
        self.reference = ReferencePolicy.build(cfg, model, self.accelerator, needed=cfg.beta > 0)
        if cfg.lora.enabled:
            model = apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
        self.trainable, self.total_params = trainable_fraction(model)
        self._model = model
        self.pipeline = None

    def plan(self) -> dict:
        """Derived sizes, computed once: completions and prompts per step (global and per process)."""
        cfg = self.cfg
        from_rows = self.train_prompts is not None and self.env is None
        sizes = grpo_sizes(cfg, self.world, len(self.train_prompts) if from_rows else None)
        per_process, prompts_per_step = sizes["completions_per_process"], sizes["prompts_per_step"]
        prompts_per_process, steps_per_epoch = sizes["prompts_per_process"], sizes["steps_per_epoch"]
        # checked with max_steps too: a step draws prompts_per_step distinct rows (ZeroDivisionError before)
        if steps_per_epoch == 0:
            raise ConfigError(f"{len(self.train_prompts)} training prompts are fewer than one step's "
                              f"{prompts_per_step} (batch_size {cfg.batch_size} x gradient_accumulation_steps "
                              f"{cfg.gradient_accumulation_steps} x {self.world} processes / num_generations "
                              f"{cfg.num_generations}); add prompts or lower batch_size")
        if cfg.max_steps:
            total = cfg.max_steps
        elif from_rows:
            total = steps_per_epoch * cfg.num_epochs * cfg.num_iterations
        else:
            raise ConfigError("an environment draws prompts without end: set max_steps")
        return {"completions_per_step": per_process * self.world, "completions_per_process": per_process,
                "prompts_per_step": prompts_per_step, "prompts_per_process": prompts_per_process,
                "total_steps": total}

    # ------------------------------------------------------------------ rollout pieces
    def _prompts_for(self, generation: int, n: int) -> list[dict]:
        """The step's n prompt rows, identical on every process (seeded by the generation index)."""
        cfg = self.cfg
        if self.env is not None:
            rows = self.env.sample_prompts(n, seed=cfg.seed * 1_000_003 + generation)
            return [{"prompt": r["prompt"], **r["metadata"]} for r in rows]
        per_epoch = len(self.train_prompts) // n
        epoch, index = divmod(generation, per_epoch)
        order = torch.randperm(len(self.train_prompts), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        return [self.train_prompts[i] for i in order[index * n:(index + 1) * n].tolist()]

    @torch.no_grad()
    def _logprobs(self, model, batch: dict) -> torch.Tensor:
        """(B, T-1) log-probs of the batch's labels under `model` at the sampling temperature, with the
        sampler's positions (counted from each row's first real token of the left-padded prompt)."""
        mask = batch["attention_mask"]
        return sequence_logprobs(model, batch["input_ids"], mask, batch["labels"],
                                 chunk_size=self.cfg.logprob_chunk_size, position_ids=position_ids_from_mask(mask),
                                 temperature=self.cfg.temperature)[0]

    def _ref_logprobs(self, batch: dict) -> torch.Tensor:
        with self.reference.use(self.pipeline) as model:
            return self._logprobs(model, batch)

    # ------------------------------------------------------------------ training
    def train(self) -> list[dict]:
        cfg, acc = self.cfg, self.accelerator
        plan = self._plan = self.plan()
        out = Path(cfg.output_dir)
        optimizer = build_optimizer(self._model, cfg.learning_rate, cfg.weight_decay)
        scheduler = build_scheduler(optimizer, cfg.lr_scheduler, plan["total_steps"], cfg.warmup_ratio)
        self.pipeline = ForwardBackwardPipeline(
            self._model, gradient_accumulation_steps=cfg.gradient_accumulation_steps, optimizer=optimizer,
            scheduler=scheduler, accelerator=acc, checkpoint_dir=checkpoint_dir(out), micro_batch_size=cfg.batch_size,
            logprob_chunk_size=cfg.logprob_chunk_size)
        self.reference.place(acc)
        if acc.is_main_process:
            save_config(cfg, out)
        tracker = Tracker(out, cfg.report_to, cfg.run_name, to_dict(cfg), plan["total_steps"], acc.is_main_process,
                          desc="grpo", plot_keys=["reward", "eval/accuracy", "reward_std", "frac_reward_zero_std",
                                                  "kl", "completions/mean_length", "loss", "grad_norm",
                                                  "clip_ratio/region_mean"])
        tracker.write(f"grpo ({cfg.advantage_estimator}, {cfg.loss_aggregation}): {plan['total_steps']} steps of "
                      f"{plan['prompts_per_step']} prompts x {cfg.num_generations} generations "
                      f"({self.world} processes, ZeRO stage {zero_stage(acc)}), beta {cfg.beta}, "
                      f"trainable {self.trainable:,}/{self.total_params:,} parameters")
        self._eval_set = unique_eval_set(self.eval_env, cfg.eval_num_prompts) if self.eval_env is not None else None
        # the held-out accuracy before the first step is the starting point's (the pipeline reports it)
        return self.fit(plan["total_steps"], tracker, eval_at_start=True)

    def evaluate_now(self) -> dict | None:
        return self.evaluate(self._eval_set) if self._eval_set is not None else None

    def checkpoint_extra(self) -> dict:
        return {"step": self.pipeline.step}

    def train_step(self) -> list[dict]:
        """One generation batch: sample, score, advantages, num_iterations optimizer steps."""
        cfg, acc, pipe, plan = self.cfg, self.accelerator, self.pipeline, self._plan
        t0 = time.time()
        generation = pipe.step // cfg.num_iterations
        rows = self._prompts_for(generation, plan["prompts_per_step"])
        k = plan["prompts_per_process"]
        mine = rows[acc.process_index * k:(acc.process_index + 1) * k]
        prompt_ids = [encode_prompt(self.tokenizer, r["prompt"], cfg.prompt_budget, cfg.chat_template)
                      for r in mine]
        # distinct, reproducible sampling seeds per step and process (row r of a call uses seed + r)
        seed = cfg.seed * 7_919 + (generation * self.world + acc.process_index) * plan["completions_per_process"]
        t_gen = time.time()
        rollout = generate(pipe.model, self.tokenizer, prompt_ids, max_new_tokens=cfg.max_completion_length,
                           temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed,
                           num_samples=cfg.num_generations)
        t_gen = time.time() - t_gen
        if cfg.optimize_device_cache:
            release_device_cache()
        completions = self.tokenizer.batch_decode(rollout.completions(), skip_special_tokens=True)
        G = cfg.num_generations
        rep = [r for r in mine for _ in range(G)]
        prompts = [r["prompt"] for r in rep]
        columns = {c: [r.get(c) for r in rep] for c in rep[0] if c not in ("prompt", "_line")}
        local, components = self.reward.score_each(prompts, completions, columns)
        local = local.to(acc.device)
        per_func = acc.gather(local).cpu() if self.world > 1 else local.cpu()
        rewards = combine_rewards(per_func, self.reward.weights)
        advantages_all = compute_advantages(rewards, G, cfg.advantage_estimator)
        n_local = local.shape[0]
        advantages = advantages_all[acc.process_index * n_local:(acc.process_index + 1) * n_local]
        # metrics on the global batch (TRL's names)
        _, std = group_stats(rewards, G)
        zero_std = torch.isclose(std, torch.zeros_like(std))
        lengths_local = rollout.lengths.to(acc.device).float()
        truncated_local = torch.tensor([1.0 if r == "length" else 0.0 for r in rollout.finish_reasons], device=acc.device)
        lengths = acc.gather(lengths_local).cpu() if self.world > 1 else lengths_local.cpu()
        truncated = acc.gather(truncated_local).cpu() if self.world > 1 else truncated_local.cpu()
        metrics = {
            "reward": _nanmean(rewards), "reward_std": float(nanstd(rewards)) if rewards.numel() > 1 else 0.0,
            "frac_reward_zero_std": float(zero_std.float().mean()),
            "num_zero_std_groups": int(zero_std.view(-1, G)[:, 0].sum()),
            "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(truncated.mean()),
            "advantages/mean_abs": float(advantages_all.abs().mean()),
        }
        for j, name in enumerate(self.reward.names):
            metrics[f"rewards/{name}/mean"] = _nanmean(per_func[:, j])
            metrics[f"rewards/{name}/std"] = float(nanstd(per_func[:, j]))
        for name, v in components.items():  # an environment's components, e.g. rewards/correctness/mean
            v = v.to(acc.device)
            metrics[f"rewards/{name}/mean"] = _nanmean(acc.gather(v).cpu() if self.world > 1 else v.cpu())
        batch = {k: v.to(acc.device) for k, v in rollout.to_batch().items()}
        adv = advantages.to(acc.device)
        ref_lp = old_lp = None
        micro = _micro_slices(batch["input_ids"].shape[0], cfg.gradient_accumulation_steps)
        if cfg.beta > 0:
            # in this thread, not the engine's worker: ZeRO-3's parameter fetching is per thread
            ref_lp = torch.cat([self._ref_logprobs(_take(batch, s)) for s in micro])
        if cfg.num_iterations > 1:
            old_lp = torch.cat([self._logprobs(pipe.model, _take(batch, s)) for s in micro])
        # token_mean over the whole step: the engine divides by accumulation, DDP/ZeRO average processes
        n_tokens = acc.reduce(batch["labels"][:, 1:].ne(-100).sum().float(), "sum") if self.world > 1 else \
            batch["labels"][:, 1:].ne(-100).sum().float()
        num_items = float(n_tokens.clamp(min=1)) / (self.world * cfg.gradient_accumulation_steps)
        out_rows = []
        for _ in range(cfg.num_iterations):
            t_train = time.time()
            sums: dict[str, float] = {}
            for s in micro:
                kw = dict(advantages=adv[s], old_logprobs=None if old_lp is None else old_lp[s],
                          ref_logprobs=None if ref_lp is None else ref_lp[s], temperature=cfg.temperature,
                          beta=cfg.beta, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                          loss_aggregation=cfg.loss_aggregation, max_completion_length=cfg.max_completion_length,
                          num_items=num_items, use_bias_correction_kl=cfg.use_bias_correction_kl)
                # the sampler's positions: on absolute-position models (GPT-2) left padding shifts them
                r = pipe.forward_backward(batch["input_ids"][s], batch["attention_mask"][s], batch["labels"][s],
                                          loss_fn=partial(grpo_loss_fn, **kw),
                                          position_ids=position_ids_from_mask(batch["attention_mask"][s])).result()
                for key, v in {"loss": r.loss, **r.metrics}.items():
                    sums[key] = sums.get(key, 0.0) + v / len(micro)
            o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
            keys = sorted(sums)
            vals = torch.tensor([sums[key] for key in keys], device=acc.device, dtype=torch.float64)
            if self.world > 1:
                vals = acc.reduce(vals, "mean")
            row = {"step": pipe.step, **metrics, **{key: float(v) for key, v in zip(keys, vals)},
                   "grad_norm": o.grad_norm, "lr": o.learning_rate}
            completion_tokens = float(lengths.sum())
            row["step_time"] = time.time() - t0
            row["time/generation"] = t_gen
            row["time/train"] = time.time() - t_train
            row["completion_tokens_per_s"] = completion_tokens / max(row["step_time"], 1e-9)
            out_rows.append(row)
            t0 = time.time()
        return out_rows

    def evaluate(self, eval_set) -> dict:
        prompts, metas = eval_set
        model = self.pipeline.model if self.pipeline is not None else self._model
        return greedy_eval(model, self.tokenizer, self.eval_env, prompts, metas, self.cfg.max_completion_length,
                           self.cfg.prompt_budget, chat=self.cfg.chat_template)

    def save(self, out_dir: str | None = None) -> str:
        """Write the final model (HF format, LoRA merged) and tokenizer; all processes must call it."""
        out = out_dir or self.cfg.output_dir
        save_pretrained(self.pipeline.model, self.tokenizer, out, self.accelerator)
        self.accelerator.wait_for_everyone()
        return out


def _micro_slices(n: int, parts: int) -> list[slice]:
    size = n // parts
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


def _take(batch: dict, s: slice) -> dict:
    return {k: v[s] for k, v in batch.items()}


def _nanmean(x: torch.Tensor) -> float:
    v = torch.nanmean(x.float())
    return float(v) if not torch.isnan(v) else 0.0


def load_prompt_rows(path: str, cfg: GRPOConfig) -> list[dict]:
    """Rows of a data file with a prompt column (data.prompt_column, else data.text_column); the other
    columns are passed to the reward functions as keyword arguments (TRL's convention)."""
    from rl.data import DataError, read_records

    rows = read_records(path)
    if cfg.data.max_examples:
        rows = rows[:cfg.data.max_examples]
    if not rows:
        raise DataError(f"{path}: no rows")
    col = cfg.data.prompt_column if cfg.data.prompt_column in rows[0] else cfg.data.text_column
    out = []
    for row in rows:
        p = row.get(col)
        if not isinstance(p, str) or not p:
            raise DataError(f"{path}:{row.get('_line')}: column '{col}' must be a non-empty string "
                            f"(set data.prompt_column to the prompt column)")
        out.append({"prompt": p, **{k: v for k, v in row.items() if k not in (col, "_line")}})
    return out
