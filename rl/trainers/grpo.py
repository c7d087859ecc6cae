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

GSPO (Zheng et al. 2025; importance_sampling_level=sequence, TRL's name): r_t is the sequence's
s_i = exp(mean_t (logp_t - old_t)), in the surrogate and the KL factor. DAPO (Yu et al. 2025):
epsilon_high, token_mean, dynamic_sampling (rl.trainers.grpo_batch), overlong_buffer (rl.algos.dapo).
Schema and sizes: rl.trainers.grpo_config; evaluation: rl.rollout.eval (public names importable from here).

Deviations and choices: with num_iterations = 1 the old policy is the current one (ratio 1, as TRL
does); with more iterations the old log-probs are recomputed by a no-grad forward before the first
update. Each optimizer step is one step of `Trainer.fit` (as TRL's steps are): the generation batch
is sampled at every num_iterations-th step and cached for the others; a checkpoint taken between them
holds it, so a resume continues on the same batch exactly (with another number of processes it is
sampled afresh by the resumed policy). Log-probs use logits / temperature, like the sampler (TRL
does the same). Groups never span processes: each process generates whole groups, rewards are gathered so that advantages and reward
metrics are computed on the global batch (reinforce_pp needs it). Micro-batches are length-grouped
(rows sorted by length, cut into equal groups, each padded only to its own longest row:
`rl.trainers.grpo_batch.length_grouped_slices`, `take_micro_batch`); TRL pads every micro-batch to the
longest completion of the step. Checked against TRL 1.16's GRPOTrainer/RLOOTrainer formulas in
tests/unit/trainers/test_grpo.py.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Sequence

import torch

from rl.algos.advantages import (
    compute_advantages,
)
from rl.algos.dapo import groups_with_spread, overlong_penalty
from rl.config.plan import prompts_step_problem
from rl.engine import segments
from rl.engine.dist import zero_stage
from rl.engine.generation import generate
from rl.engine.packing import pack_padded, pack_shared_prompts, position_ids_from_mask, unpack_targets
from rl.engine.scoring import sequence_logprobs
from rl.engine.state import PER_PROCESS
from rl.errors import ConfigError
from rl.models.loading import (
    release_device_cache,
)
from rl.rollout.episodes import run_episodes
from rl.rollout.eval import greedy_eval, unique_eval_set
from rl.rollout.prompts import encode_prompt, step_prompts
from rl.trainers.grpo_batch import (  # grpo_loss_fn: importable from here, as before
    grpo_loss_fn,
    length_grouped_slices,
    fold_micro_metrics,
    log_completions,
    micro_loss_kwargs,
    pick_groups,
    picked_rows,
    reward_metrics,
    select_rollout,
    take_global,
    take_micro_batch,
)
from rl.trainers.grpo_async import AsyncRollouts
from rl.trainers.grpo_config import GRPOConfig, grpo_sizes
from rl.trainers.online import OnlineTrainer
from rl.trainers.sampling import episode_sampler
from rl.trainers.rewards import (
    combine_rewards,
    reward_columns,
)

# ============================================================================ pure math
# Advantages and the loss are in rl.algos, the reward sources and combine_rewards in rl.trainers.rewards,
# the loss in the engine's signature (grpo_loss_fn) in rl.trainers.grpo_batch.

# ============================================================================ trainer

class GRPOTrainer(AsyncRollouts, OnlineTrainer):
    """GRPO-family trainer on the shared engine.

    `GRPOTrainer(config, *, model=None, tokenizer=None, reward_funcs=None, train_prompts=None)`:
    reward_funcs are extra callables in TRL's signature (added after the config's); train_prompts is a
    list of {"prompt": str, <column>: value, ...} rows when no environment is configured (the launch
    script reads them from data.path)."""

    _gen: dict | None = None  # the generation batch whose num_iterations updates are not all taken yet

    def __init__(self, config: GRPOConfig, *, model=None, tokenizer=None,
                 reward_funcs: Sequence[Callable] | None = None, train_prompts: list[dict] | None = None):
        self.async_setup(config)  # rollout_processes: this process's side, before the accelerator exists
        # beta = 0: no reference model at all (no memory, no forward)
        self.build(config, model=model, tokenizer=tokenizer, reference=dict(needed=config.beta > 0),
                   rewards=lambda: self.build_env_rewards(
                       reward_funcs, train_prompts, "no reward source: set env_type (e.g. env_type=math), "
                       "reward_model_path or reward_funcs (e.g. reward_funcs=[correctness]), or pass "
                       "reward_funcs= to GRPOTrainer"))
        self.async_built()

    @staticmethod
    def dry_run_models(cfg: GRPOConfig) -> dict:
        """The models a run holds, for the dry-run memory plan: the reference as `ReferencePolicy` decides."""
        models = {"policy (trainable)": cfg.model_name}
        if cfg.beta > 0:  # beta = 0 loads no reference model
            # LoRA: the reference is the policy with the adapters off (no copy is loaded)
            models["reference (frozen)"] = "policy without adapters" if cfg.lora.enabled else cfg.model_name
        if cfg.reward_model_path:
            models["reward model (frozen)"] = cfg.reward_model_path
        return models

    def plan(self) -> dict:
        """Derived sizes, computed once: completions and prompts per step (global and per process)."""
        cfg = self.cfg
        from_rows = self.train_prompts is not None and self.env is None
        sizes = grpo_sizes(cfg, self.world, len(self.train_prompts) if from_rows else None)
        per_process, prompts_per_step = sizes["completions_per_process"], sizes["prompts_per_step"]
        prompts_per_process, steps_per_epoch = sizes["prompts_per_process"], sizes["steps_per_epoch"]
        # checked with max_steps too: a step draws prompts_per_step distinct rows (ZeroDivisionError before)
        if steps_per_epoch == 0:
            raise ConfigError(prompts_step_problem(cfg, len(self.train_prompts), self.world, cfg.num_generations))
        if cfg.max_steps:
            total = cfg.max_steps
        elif from_rows:
            total = steps_per_epoch * cfg.num_train_epochs * cfg.num_iterations
        else:
            raise ConfigError("an environment draws prompts without end: set max_steps")
        return {"completions_per_step": per_process * self.world, "completions_per_process": per_process,
                "prompts_per_step": prompts_per_step, "prompts_per_process": prompts_per_process,
                "total_steps": total}

    # ------------------------------------------------------------------ rollout pieces
    @torch.no_grad()
    def _logprobs(self, model, batch: dict, micro: list[torch.Tensor], prompt_width: int) -> torch.Tensor:
        """(B, T-1) log-probs of the batch's labels under `model` at the sampling temperature, with the
        sampler's positions (counted from each row's first real token of the left-padded prompt).

        Scored one micro-batch of rows at a time (`micro`, from `_micro_batches`), each trimmed to its own
        widest row by `take_micro_batch` (or packed with shared prompts, `_shared`); the results are put back
        in the batch's row order and width (0 outside the labels), so they index like the batch itself."""
        out = torch.zeros(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1, dtype=torch.float32,
                          device=batch["input_ids"].device)
        shared = self._share and segments.enable(model)  # a separate reference model gets the kernel too
        for rows in micro:
            mb, (a, b) = take_micro_batch(batch, rows, with_span=True)
            mask = mb["attention_mask"]
            kw = dict(chunk_size=self.cfg.logprob_chunk_size, temperature=self.cfg.temperature)
            if shared:
                pk = self._shared(mb, prompt_width - a)
                lp = unpack_targets(sequence_logprobs(model, pk["input_ids"], None, pk["labels"], **kw, model_inputs=
                                                      segments.shared_prefix_inputs(pk))[0], pk["target_index"])
            else:
                lp = sequence_logprobs(model, mb["input_ids"], mask, mb["labels"],
                                       position_ids=position_ids_from_mask(mask), **kw)[0]
            out[rows.to(out.device)[:, None], torch.arange(a, b - 1, device=out.device)] = lp.float()
        return out

    def _micro_batches(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """The step's micro-batches of rows: consecutive ones with shared prompts (a group stays together,
        so its prompt is computed once), else length-grouped (each padded only to its own longest row)."""
        parts = self.cfg.gradient_accumulation_steps
        if self._share:
            return list(torch.arange(attention_mask.shape[0]).chunk(parts))
        return length_grouped_slices(attention_mask, parts)

    def _shared(self, mb: dict, prompt_width: int) -> dict:
        """A micro-batch packed with its groups' prompts computed once (`pack_shared_prompts`)."""
        return pack_shared_prompts(mb["input_ids"], mb["attention_mask"], mb["labels"], prompt_width)

    def _ref_logprobs(self, batch: dict, micro: list[torch.Tensor], prompt_width: int) -> torch.Tensor:
        with self.reference.use(self.pipeline) as model:
            return self._logprobs(model, batch, micro, prompt_width)

    # ------------------------------------------------------------------ training
    def train(self) -> list[dict]:
        if self.is_rollout_process:  # rollout_processes: this one only samples (rl.trainers.grpo_async)
            return self.async_train(None)
        cfg, acc = self.cfg, self.accelerator
        plan = self._plan = self.plan()
        tracker = self.open_run(plan["total_steps"], desc="grpo", plot_keys=[
            "reward", "eval/accuracy", "reward_std", "frac_reward_zero_std", "kl", "completions/mean_length", "loss",
            "grad_norm", "clip_ratio/region_mean"])
        self.pipeline = self.build_pipeline(self._model, plan["total_steps"], cfg.per_device_train_batch_size)
        self.reference.place(acc)
        # the groups' prompts computed once in the training forwards (rl.engine.segments: SDPA models)
        self._share = cfg.share_prompt_forward and segments.prefix_sharing(self.pipeline.unwrapped_model)
        tracker.write(f"grpo ({cfg.advantage_estimator}, {cfg.loss_aggregation}): {plan['total_steps']} steps of "
                      f"{plan['prompts_per_step']} prompts x {cfg.num_generations} generations "
                      f"({self.processes}, ZeRO stage {zero_stage(acc)}), beta {cfg.beta}, "
                      f"trainable {self.trainable:,}/{self.total_params:,} parameters")
        self._eval_set = unique_eval_set(self.eval_env, cfg.eval_num_prompts) if self.eval_env is not None else None
        # the held-out accuracy before the first step is the starting point's (the pipeline reports it)
        return self.async_train(lambda: self.fit(plan["total_steps"], tracker, eval_at_start=True))

    def evaluate_now(self) -> dict | None:
        return self.evaluate(self._eval_set) if self._eval_set is not None else None

    def checkpoint_extra(self) -> dict:
        """Between the updates of a generation batch the batch goes into the checkpoint (each process its
        own rows): a resume then continues on it exactly, instead of re-sampling it with a policy that has
        already taken some of its updates."""
        extra = {"step": self.pipeline.step}
        if self._gen is not None:
            extra[PER_PROCESS] = {"generation_batch": self._gen}
        return self.async_checkpoint(extra)  # max_staleness / rollout_processes: the rollout position

    def restore(self, extra: dict) -> None:
        gb, self._gen = extra.get(PER_PROCESS, {}).get("generation_batch"), None
        # another number of processes splits the batch otherwise: that resume samples it afresh (not exact)
        if gb is not None and gb["world"] == self.world:
            dev = self.accelerator.device
            self._gen = {**gb, "batch": {k: v.to(dev) for k, v in gb["batch"].items()}}
        self.async_restore(extra)

    def round_prompts(self, generation: int, round_: int, process: int | None = None) -> tuple[list[dict], list]:
        """The prompt rows of one sampling round that `process` (default: this one) samples, and their token ids."""
        cfg, plan = self.cfg, self._plan
        k, p = plan["prompts_per_process"], self.accelerator.process_index if process is None else process
        rows = step_prompts(self.env, self.train_prompts, cfg.order_seed, generation, plan["prompts_per_step"], round_)
        mine = rows[p * k:(p + 1) * k]
        return mine, [encode_prompt(self.tokenizer, r["prompt"], cfg.prompt_budget, cfg.chat_template) for r in mine]

    def sampling_kwargs(self, generation: int, round_: int) -> dict:
        """The sampler's keywords of one round (every engine's `generate` takes them)."""
        cfg, plan = self.cfg, self._plan
        # distinct, reproducible sampling seeds per step, round and process (row r of a call uses seed + r)
        seed = (cfg.seed * 7_919 + (generation * self.world + self.accelerator.process_index) *
                plan["completions_per_process"] + round_ * 2 ** 40)
        return dict(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_k=cfg.top_k,
                    top_p=cfg.top_p, seed=seed, num_samples=cfg.num_generations, dtype=cfg.rollout_dtype)

    def _sample_round(self, generation: int, round_: int, rollout=None) -> dict:
        """Sample and score this process's groups of one round; the rewards (overlong shaping included),
        per-source rewards, components, lengths and truncation flags gathered over processes. `rollout`: this
        round's samples when they were drawn elsewhere (a vLLM server ahead of the trainer, rl.trainers.grpo_async)."""
        cfg = self.cfg
        mine, prompt_ids = self.round_prompts(generation, round_)
        t_gen = time.time()
        if rollout is None:
            # a multi-turn environment (rl.envs.tool_math) runs whole episodes: tool tokens get labels -100 in to_batch
            sample = episode_sampler(self, generate, run_episodes, self.env)  # ours or vLLM; episodes if multi-turn
            rollout = sample(self.pipeline.model, self.tokenizer, prompt_ids, **self.sampling_kwargs(generation, round_))
        t_gen = time.time() - t_gen
        if cfg.optimize_device_cache:
            release_device_cache()
        completions = self.tokenizer.batch_decode(rollout.completions(), skip_special_tokens=True)
        rep = [r for r in mine for _ in range(cfg.num_generations)]
        columns = reward_columns(rep, rollout.completions())
        local, components = self.reward.score_each([r["prompt"] for r in rep], completions, columns)
        if cfg.log_completions and self.accelerator.is_main_process and round_ == 0:  # TRL's key: this process's rows
            log_completions(self, generation, [r["prompt"] for r in rep], completions, local)

        gather = self.gather
        lengths = gather(rollout.lengths.float())
        truncated = gather(torch.tensor([float(r == "length") for r in rollout.finish_reasons]))
        per_func = gather(local)
        penalty = overlong_penalty(lengths, cfg.max_completion_length, cfg.overlong_buffer, cfg.overlong_penalty)
        return {"rollout": rollout, "rewards": combine_rewards(per_func, self.reward.weights) + penalty,
                "per_func": per_func, "lengths": lengths, "truncated": truncated, "penalty": penalty,
                "t_gen": t_gen, "components": {name: gather(v) for name, v in components.items()}}

    def _rollout(self, generation: int, first=None) -> tuple:
        """The step's groups: one round, or with dynamic sampling rounds until every process holds
        prompts_per_process groups with reward spread (rl.trainers.grpo_batch). Returns (this process's
        rollout, the picked rounds' gathered tensors by key, dapo/* metrics). `first`: the first round's
        samples, drawn elsewhere."""
        cfg, W, k, G = self.cfg, self.world, self._plan["prompts_per_process"], self.cfg.num_generations
        rounds, keep = [], []
        for r in range(cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
            rounds.append(self._sample_round(generation, r, first if r == 0 else None))
            keep.append(groups_with_spread(rounds[-1]["rewards"], G).view(W, k) if cfg.dynamic_sampling
                        else torch.ones(W, k, dtype=torch.bool))
            if (torch.cat(keep, dim=1).sum(1) >= k).all():
                break
        picks, filled = pick_groups(keep, k)
        rows = picked_rows(picks, G)
        picked = {key: take_global([ro[key] for ro in rounds], rows)
                  for key in ("rewards", "per_func", "lengths", "truncated", "penalty")}
        picked["components"] = {name: take_global([ro["components"][name] for ro in rounds], rows)
                                for name in rounds[0]["components"]}
        rollout = select_rollout([ro["rollout"] for ro in rounds], rows[self.accelerator.process_index].tolist())
        dapo = {}
        if cfg.dynamic_sampling:
            dapo = {"dapo/sampling_rounds": len(rounds), "dapo/dropped_groups": int((~torch.cat(keep)).sum()),
                    "dapo/filled_groups": filled}
        if cfg.overlong_buffer:
            dapo["dapo/overlong_penalty"] = float(picked["penalty"].mean())
        picked["t_gen"] = sum(ro["t_gen"] for ro in rounds)
        return rollout, picked, dapo

    def _generation_batch(self, generation: int, rollout=None) -> dict:
        """What the num_iterations updates of one generation share: sample (dynamic sampling: several
        rounds), score, advantages, the reference's and (num_iterations > 1) the old policy's log-probs.
        `rollout`: the (first round's) samples when they were drawn elsewhere."""
        cfg, acc, pipe = self.cfg, self.accelerator, self.pipeline
        rollout, g, dapo = self._rollout(generation, rollout)
        advantages_all = compute_advantages(g["rewards"], cfg.num_generations, cfg.advantage_estimator)
        n_local = rollout.tokens.shape[0]
        advantages = advantages_all[acc.process_index * n_local:(acc.process_index + 1) * n_local]
        metrics = {**reward_metrics(g["rewards"], g["per_func"], self.reward.names, g["components"], g["lengths"],
                                    g["truncated"], advantages_all, cfg.num_generations), **dapo}
        batch = {k: v.to(acc.device) for k, v in rollout.to_batch().items()}
        if cfg.mask_truncated_completions:  # TRL's key (DAPO's overlong filtering): truncated rows carry no loss
            cut = g["truncated"][acc.process_index * n_local:(acc.process_index + 1) * n_local].bool()
            batch["labels"][cut.to(acc.device)] = -100
        ref_lp = old_lp = None
        micro, P = self._micro_batches(batch["attention_mask"]), rollout.prompt_ids.shape[1]
        if cfg.beta > 0:
            # in this thread, not the engine's worker: ZeRO-3's parameter fetching is per thread
            ref_lp = self._ref_logprobs(batch, micro, P)
        if cfg.num_iterations > 1:
            old_lp = self._logprobs(pipe.model, batch, micro, P)
        # vLLM's (our bf16 sampler's) log-probs of its samples: their mismatch with the trainer's is measured, corrected
        behaviour = batch["old_logprobs"] if cfg.use_vllm or cfg.rollout_dtype != "float32" else None
        per_row = {k: v for k, v in {"advantages": advantages.to(acc.device), "old": old_lp, "ref": ref_lp,
                                     "behaviour": behaviour}.items()
                   if v is not None}
        # token_mean over the whole step: the engine divides by accumulation, DDP/ZeRO average processes
        n_tokens = acc.reduce(batch["labels"][:, 1:].ne(-100).sum().float(), "sum") if self.world > 1 else \
            batch["labels"][:, 1:].ne(-100).sum().float()
        return {"generation": generation, "world": self.world, "batch": {**batch, **per_row}, "micro": micro, "P": P,
                "num_items": float(n_tokens.clamp(min=1)) / (self.world * cfg.gradient_accumulation_steps),
                "metrics": metrics, "completion_tokens": float(g["lengths"].sum()), "t_gen": g["t_gen"]}

    def train_step(self) -> dict:
        """One optimizer step on the current generation batch, sampled first when the previous one has had
        its num_iterations updates; the batch stays cached between steps (and in a checkpoint taken
        between them), so fit() logs, evaluates, saves and stops at every optimizer step."""
        cfg, pipe = self.cfg, self.pipeline
        t0 = time.time()
        generation, async_row = pipe.step // cfg.num_iterations, {}
        if self.buffered:  # max_staleness / rollout_processes (rl.trainers.grpo_async): sampled ahead
            gb, async_row = self.async_generation_batch()
        else:
            if self._gen is None or self._gen["generation"] != generation:
                self._gen = self._generation_batch(generation)
            gb = self._gen
        batch, micro, P = gb["batch"], gb["micro"], gb["P"]
        t_train = time.time()
        sums: dict[str, float] = {}
        extremes: dict[str, float] = {}
        for s in micro:
            mb, (a, _) = take_micro_batch(batch, s, with_span=True)
            loss_fn = partial(grpo_loss_fn, **micro_loss_kwargs(cfg, mb, gb))
            if self._share:  # each group's prompt once, its completions attending to it; no padding
                b = self._shared(mb, P - a)
                r = pipe.forward_backward(b["input_ids"], None, b["labels"], target_index=b["target_index"],
                                          loss_fn=loss_fn,
                                          model_inputs=segments.shared_prefix_inputs(b)).result()
            elif cfg.packing:  # the rows' real tokens packed; positions restart per row, as the sampler counts
                b = pack_padded(mb["input_ids"], mb["attention_mask"], mb["labels"],
                                self.tokenizer.pad_token_id or 0)
                r = pipe.forward_backward(b["input_ids"], None, b["labels"], position_ids=b["position_ids"],
                                          target_index=b["target_index"], loss_fn=loss_fn
                                          ).result()
            else:  # the sampler's positions: on absolute-position models (GPT-2) left padding shifts them
                r = pipe.forward_backward(mb["input_ids"], mb["attention_mask"], mb["labels"],
                                          loss_fn=loss_fn,
                                          position_ids=position_ids_from_mask(mb["attention_mask"])).result()
            fold_micro_metrics(sums, extremes, {"loss": r.loss, **r.metrics}, len(micro))
        o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        self.async_after_step()  # rollout_processes: the new weights (version pipe.step) to them
        if pipe.step % cfg.num_iterations == 0:
            self._gen = None  # used up: its memory is free while the next one is sampled
        row = {"step": pipe.step, **gb["metrics"], **self.reduce(sums), **self.reduce_extremes(extremes),
               "grad_norm": o.grad_norm, "learning_rate": o.learning_rate}
        row["step_time"] = time.time() - t0
        row["time/generation"] = gb["t_gen"]
        row["time/train"] = time.time() - t_train
        row["completion_tokens_per_s"] = gb["completion_tokens"] / max(row["step_time"], 1e-9)
        if self.buffered:
            row.update(async_row, **{"time/training": row["time/train"]})
        return row

    def evaluate(self, eval_set) -> dict:
        prompts, metas = eval_set
        model = self.pipeline.model if self.pipeline is not None else self._model
        return greedy_eval(model, self.tokenizer, self.eval_env, prompts, metas, self.cfg.max_completion_length,
                           self.cfg.prompt_budget, batch_size=self.cfg.per_device_eval_batch_size,
                           chat=self.cfg.chat_template)
