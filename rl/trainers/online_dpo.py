"""Online DPO: per prompt, sample two completions from the current policy, let the reward protocol pick
the preferred one, and take a DPO-family step on that fresh pair against the frozen reference.

Objective (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", OAIF, alg. 1):
for a prompt x and two samples y_1, y_2 ~ pi(.|x), score both with the reward r; y_w is the higher one,
y_l the other, and with

    h = beta * [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))]

the loss per pair is the offline DPO family's (rl.algos.preference, the same function the offline
trainer calls: `rl.dpo.dpo_batch_loss`): sigmoid -log sigmoid(h) (cDPO with label_smoothing), ipo on
per-token averaged log-ratios, hinge max(0, 1 - h). log pi(y|x) is the sum of the completion tokens'
log-probs at temperature 1 (the model's own distribution, whatever the sampling temperature).

Deviations and choices:
* Ties carry no preference: a pair whose two rewards are equal (or that no reward source scored) is left
  out of the loss, and `online_dpo/ties` reports the fraction of such pairs. TRL 1.16's experimental
  OnlineDPOTrainer instead prefers the first sample (`first >= second`); on untied pairs the two agree
  (tests/unit/trainers/test_online_dpo.py runs TRL's training_step on identical completions). A step whose pairs
  are all ties still takes its optimizer step with a zero gradient (no skipped step numbers, so resume
  and the learning-rate schedule stay step-exact).
* The loss is the exact mean over the step's untied pairs, across micro-batches and processes (the pair
  weights of `dpo_batch_loss`), not the mean of micro-batch means.
* IPO averages log-ratios per token as our offline DPO and TRL's DPOTrainer do; TRL's online DPO sums them.
* `missing_eos_penalty` (TRL's name) is subtracted from the reward of a completion that hit
  max_completion_length before its end-of-sequence token.

Metrics: loss, rewards/{chosen,rejected,margins,accuracies}, logps/{chosen,rejected} (TRL's names, over
untied pairs; 0 on a step whose pairs all tie); objective/scores (mean reward of all completions), objective/scores_margin (mean reward of
the chosen minus the rejected answer), objective/kl (mean of log pi - log ref over the trained answers);
online_dpo/ties; completions/mean_length, completions/clipped_ratio; eval/* with eval_env_config.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Callable, Sequence

import torch

from rl.algos import names
from rl.algos.preference import needs_reference
from rl.algos.registry import check
from rl.config.fields import one_of_list, opt
from rl.config.plan import prompts_step_problem
from rl.config.schema import OnlineConfig
from rl.engine.dist import zero_stage
from rl.engine.generation import generate
from rl.engine.packing import IGNORE_INDEX, pack_sequences, position_ids_from_mask
from rl.engine.scoring import sequence_logprobs
from rl.errors import ConfigError
from rl.models.loading import (
    release_device_cache,
)
from rl.models.saving import save_pretrained
from rl.rollout.eval import greedy_eval, unique_eval_set
from rl.rollout.prompts import encode_prompt, step_prompts
from rl.trainers.dpo import dpo_batch_loss
from rl.trainers.online import OnlineTrainer
from rl.trainers.sampling import rollout_sampler
from rl.trainers.rewards import combine_rewards, reward_columns


@dataclasses.dataclass
class OnlineDPOConfig(OnlineConfig):
    learning_rate: float = opt(5e-7, "peak learning rate of AdamW (TRL's online DPO default; DPO wants it small)")
    per_device_train_batch_size: int = opt(8, "prompts per device per micro-batch, as TRL's online DPO (each gives "
                                           "one pair: 2 completions)")
    disable_dropout: bool = opt(True, "set every dropout of the trained model to 0 (TRL's default here)")
    beta: float | list[float] = opt(0.1, "DPO temperature beta (IPO: tau); TRL's list form takes one value here")
    loss_type: str = opt("sigmoid", "a preference loss that compares against the reference: "
                         + " | ".join(n for n in names("preference_loss") if needs_reference(n))
                         + " | package.module:function")
    label_smoothing: float = opt(0.0, "conservative DPO (sigmoid only): probability a preference is flipped")
    ref_model: str | None = opt(None, "reference model id/path (default: the initial policy; with LoRA "
                                     "the policy without adapters)")
    temperature: float = opt(1.0, "sampling temperature (the loss scores the model itself, temperature 1)")
    missing_eos_penalty: float | None = opt(None, "subtracted from the reward of a completion cut at "
                                            "max_completion_length (TRL's name); null: none")
    max_staleness: int = opt(0, "GRPO's asynchronous rollouts (docs/rollout.md); online DPO samples each step's "
                             "pairs with the current policy: 0 only")
    rollout_processes: int = opt(0, "GRPO's rollout processes (docs/rollout.md); online DPO: 0 only")
    vllm_importance_sampling_correction: bool = opt(
        False, "GRPO's and PPO's key: online DPO's pair loss has no policy-gradient term to reweight (TRL's "
        "OnlineDPOConfig has no such key); true is refused")

    def __post_init__(self):
        self.beta = one_of_list(self.beta, "beta", "one beta for the whole run here (TRL's list gives one per epoch)")
        super().__post_init__()
        self.refuse_correction("online DPO's pair loss")
        check("preference_loss", self.loss_type, "loss_type")
        if not needs_reference(self.loss_type):
            raise ConfigError(f"loss_type={self.loss_type} has no reference model, which online DPO's pairs are "
                              f"scored against; choose one of "
                              f"{', '.join(n for n in names('preference_loss') if needs_reference(n))}")
        if self.beta <= 0:
            raise ConfigError(f"key 'beta' must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5 or (self.label_smoothing and self.loss_type != "sigmoid"):
            raise ConfigError(f"key 'label_smoothing' must be in [0, 0.5) and needs loss_type=sigmoid, got "
                              f"{self.label_smoothing} with loss_type={self.loss_type}")
        if self.temperature <= 0:
            raise ConfigError(f"key 'temperature' must be > 0 (two greedy samples are the same answer), "
                              f"got {self.temperature}")
        for key in ("max_staleness", "rollout_processes"):
            if getattr(self, key):  # no framework release of the field samples online DPO's pairs ahead
                raise ConfigError(f"key '{key}': online DPO samples each step's pairs with the current policy; "
                                  f"asynchronous rollouts are GRPO's (docs/rollout.md): set {key}=0")


# ============================================================================ pure pieces

def pack_rollout_rows(rollout, rows: list[int]) -> dict[str, torch.Tensor]:
    """The rollout rows `rows` (prompt + completion, no padding) packed by `rl.engine.packing.pack_sequences`:
    input_ids, labels (-100 on the prompt), position_ids and sequence_index (k for rows[k]), each (R, W)."""
    completions = rollout.completions()
    return pack_sequences([(rollout.prompts[i] + completions[i], [IGNORE_INDEX] * len(rollout.prompts[i]) +
                            completions[i]) for i in rows], rollout.pad_token_id or 0)


def pair_up(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(2B,) rewards of B consecutive sample pairs [x0 a, x0 b, x1 a, ...] -> (chosen rows (B,),
    rejected rows (B,), tie (B,) bool). A tie (equal rewards, or a NaN: no source scored it) keeps
    sample a as "chosen"; the caller gives it weight 0."""
    r = rewards.view(-1, 2)
    second = r[:, 1] > r[:, 0]
    base = torch.arange(r.shape[0]) * 2
    tie = (r[:, 0] == r[:, 1]) | torch.isnan(r).any(dim=1)
    return base + second.long(), base + 1 - second.long(), tie


def pair_weights(tie: torch.Tensor, untied_in_step: int, units: int) -> torch.Tensor:
    """(B,) weights w_i = units / untied pairs of the whole step (0 for a tie), units = processes x
    accumulation: the engine's 1/accumulation and DDP's 1/processes then leave the exact mean over the
    step's untied pairs (`rl.dpo.dpo_batch_loss`). No untied pair at all: all zero."""
    w = torch.full(tie.shape, units / max(untied_in_step, 1))
    return w.masked_fill(tie, 0.0)


# ============================================================================ trainer

class OnlineDPOTrainer(OnlineTrainer):
    """Online DPO on the shared engine. `OnlineDPOTrainer(config, *, model=None, tokenizer=None,
    reward_funcs=None, train_prompts=None)`, arguments as `rl.trainers.grpo.GRPOTrainer`'s."""

    def __init__(self, config: OnlineDPOConfig, *, model=None, tokenizer=None,
                 reward_funcs: Sequence[Callable] | None = None, train_prompts: list[dict] | None = None):
        self.build(config, model=model, tokenizer=tokenizer, micro_batch_size=2 * config.per_device_train_batch_size,  # 2 per prompt
                   reference=dict(name=config.ref_model),
                   rewards=lambda: self.build_env_rewards(
                       reward_funcs, train_prompts, "no reward source to rank the two samples: set env_type, "
                       "reward_model_path or reward_funcs, or pass reward_funcs="))

    @staticmethod
    def dry_run_models(cfg: OnlineDPOConfig) -> dict:
        """The models a run holds, for the dry-run memory plan: the reference as `ReferencePolicy` decides."""
        models = {"policy (trainable)": cfg.model_name,
                  "reference (frozen)": cfg.ref_model or ("policy without adapters" if cfg.lora.enabled
                                                               else cfg.model_name)}
        if cfg.reward_model_path:
            models["reward model (frozen)"] = cfg.reward_model_path
        return models

    def plan(self) -> dict:
        """Derived sizes, computed once: prompts (= pairs) per step, per process and in all; total steps."""
        cfg = self.cfg
        per_process = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        per_step = per_process * self.world
        from_rows = self.env is None
        if from_rows and len(self.train_prompts) < per_step:
            raise ConfigError(prompts_step_problem(cfg, len(self.train_prompts), self.world))
        if cfg.max_steps:
            total = cfg.max_steps
        elif from_rows:
            total = len(self.train_prompts) // per_step * cfg.num_train_epochs
        else:
            raise ConfigError("an environment draws prompts without end: set max_steps")
        return {"prompts_per_process": per_process, "prompts_per_step": per_step, "total_steps": total}

    def _ref_logps(self, batch: dict) -> torch.Tensor:
        """(2b,) reference log-prob sums of a micro-batch's completions; in this thread (ZeRO-3 fetches
        parameters per thread)."""
        with self.reference.use(self.pipeline) as model:
            logp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["labels"],
                                        chunk_size=self.cfg.logprob_chunk_size,
                                        position_ids=position_ids_from_mask(batch["attention_mask"]))
        return logp.sum(-1)

    # ------------------------------------------------------------------ training
    def train(self) -> list[dict]:
        cfg, acc = self.cfg, self.accelerator
        plan = self._plan = self.plan()
        tracker = self.open_run(plan["total_steps"], desc=f"online_dpo[{cfg.loss_type}]",
                                plot_keys=["objective/scores", "eval/accuracy", "rewards/margins", "rewards/accuracies",
                                           "online_dpo/ties", "objective/kl", "loss", "grad_norm"])
        self.pipeline = self.build_pipeline(self._model, plan["total_steps"], 2 * cfg.per_device_train_batch_size)  # 2 per prompt
        self.reference.place(acc)
        tracker.write(f"online_dpo ({cfg.loss_type}, beta {cfg.beta}): {plan['total_steps']} steps of "
                      f"{plan['prompts_per_step']} prompts x 2 samples ({self.processes}, ZeRO stage "
                      f"{zero_stage(acc)}), reference {self.reference.description}, trainable "
                      f"{self.trainable:,}/{self.total_params:,} parameters")
        self._eval_set = unique_eval_set(self.eval_env, cfg.eval_num_prompts) if self.eval_env is not None else None
        return self.fit(plan["total_steps"], tracker, eval_at_start=True)

    def evaluate_now(self) -> dict | None:
        if self._eval_set is None:
            return None
        model = self.pipeline.model if self.pipeline is not None else self._model
        return greedy_eval(model, self.tokenizer, self.eval_env, *self._eval_set, self.cfg.max_completion_length,
                           self.cfg.prompt_budget, batch_size=self.cfg.per_device_eval_batch_size,
                           chat=self.cfg.chat_template)

    def checkpoint_extra(self) -> dict:
        return {"step": self.pipeline.step}

    def train_step(self) -> dict:
        """Sample two completions per prompt, rank them, one optimizer step on the untied pairs."""
        cfg, acc, pipe, plan = self.cfg, self.accelerator, self.pipeline, self._plan
        t0 = time.time()
        k = plan["prompts_per_process"]
        mine = step_prompts(self.env, self.train_prompts, cfg.order_seed, pipe.step, plan["prompts_per_step"])[acc.process_index * k:(acc.process_index + 1) * k]
        prompt_ids = [encode_prompt(self.tokenizer, r["prompt"], cfg.prompt_budget, cfg.chat_template) for r in mine]
        seed = cfg.seed * 7_919 + (pipe.step * self.world + acc.process_index) * 2 * k  # row r samples seed + r
        sample = rollout_sampler(self, generate)  # our sampler, or vLLM holding the policy's current weights
        rollout = sample(pipe.model, self.tokenizer, prompt_ids, max_new_tokens=cfg.max_completion_length,
                         temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed, num_samples=2)
        t_gen = time.time() - t0
        if cfg.optimize_device_cache:
            release_device_cache()
        completions = self.tokenizer.batch_decode(rollout.completions(), skip_special_tokens=True)
        rep = [r for r in mine for _ in range(2)]
        columns = reward_columns(rep, rollout.completions())
        per_func, _ = self.reward.score_each([r["prompt"] for r in rep], completions, columns)
        rewards = combine_rewards(per_func, self.reward.weights)
        clipped = torch.tensor([r == "length" for r in rollout.finish_reasons], dtype=torch.bool)
        if cfg.missing_eos_penalty is not None:
            rewards = rewards - cfg.missing_eos_penalty * clipped.float()
        chosen, rejected, tie = pair_up(rewards)
        # global counts: every process weighs its pairs by the same step-wide number of untied pairs
        all_rewards, all_tie = self.gather(rewards), self.gather(tie.float())
        untied = int((1 - all_tie).sum())
        weights = pair_weights(tie, untied, self.world * cfg.gradient_accumulation_steps)
        batch = {key: v.to(acc.device) for key, v in rollout.to_batch().items() if key != "old_logprobs"}
        sums: dict[str, float] = {}
        for m in range(cfg.gradient_accumulation_steps):
            s = slice(m * cfg.per_device_train_batch_size, (m + 1) * cfg.per_device_train_batch_size)
            rows = torch.cat([chosen[s], rejected[s]]).to(acc.device)  # [chosen..., rejected...] as offline DPO
            b = {key: v[rows] for key, v in batch.items()}
            ref_c, ref_r = self._ref_logps(b).chunk(2)
            loss_fn = partial(dpo_batch_loss, loss_type=cfg.loss_type, beta=cfg.beta,
                              label_smoothing=cfg.label_smoothing, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r,
                              pair_weight=weights[s])
            if cfg.packing:  # the pairs' real tokens packed, as offline DPO's packed micro-batches (pack_pairs)
                p = {key: v.to(acc.device) for key, v in pack_rollout_rows(rollout, rows.tolist()).items()}
                r = pipe.forward_backward(p["input_ids"], None, p["labels"], loss_fn=loss_fn,
                                          position_ids=p["position_ids"], sequence_index=p["sequence_index"]).result()
            else:
                r = pipe.forward_backward(b["input_ids"], b["attention_mask"], b["labels"], loss_fn=loss_fn,
                                          position_ids=position_ids_from_mask(b["attention_mask"])).result()
            for key, v in r.metrics.items():  # weighted sums: their total over the step is the mean
                sums[key] = sums.get(key, 0.0) + v / cfg.gradient_accumulation_steps
        o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        row = self.reduce(sums)
        pairs = all_rewards.view(-1, 2)
        margin = (pairs.max(dim=1).values - pairs.min(dim=1).values)[all_tie == 0]
        lengths, clip_all = self.gather(rollout.lengths.float()), self.gather(clipped.float())
        row.update({
            "objective/scores": float(torch.nanmean(all_rewards)) if not all_rewards.isnan().all() else 0.0,
            "objective/scores_margin": float(margin.mean()) if untied else 0.0,
            # mean over the trained answers of log pi - log ref (rewards/* are beta times it)
            "objective/kl": (row["rewards/chosen"] + row["rewards/rejected"]) / (2 * cfg.beta),
            "online_dpo/ties": float(all_tie.mean()), "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(clip_all.mean()), "grad_norm": o.grad_norm, "learning_rate": o.learning_rate,
            "step_time": time.time() - t0, "time/generation": t_gen,
        })
        for j, name in enumerate(self.reward.names):
            col = self.gather(per_func[:, j])
            row[f"rewards/{name}/mean"] = float(torch.nanmean(col)) if not col.isnan().all() else 0.0
        return {"step": pipe.step, **row}

    def save(self, out_dir: str | None = None) -> str:
        """Write the final model and tokenizer (LoRA: the PEFT adapter); every process must call it."""
        out = out_dir or self.cfg.output_dir
        save_pretrained(self.pipeline.model, self.tokenizer, out, self.accelerator, merged=self.cfg.save_merged)
        self.accelerator.wait_for_everyone()
        return out
