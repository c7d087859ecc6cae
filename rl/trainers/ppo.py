"""PPO for RLHF (Ouyang et al. 2022; Ziegler et al. 2019): a policy, a frozen reference, a value function.

One iteration (round):
  1. rollout   sample `per_device_train_batch_size` completions per process from the policy (`rl.engine.generation.generate`:
               left-padded prompts, KV cache, per-row seeds; ZeRO-3 gathers the weights once);
  2. scoring   a scalar score per completion (reward function, reward model or environment), then one
               no-grad forward of the policy (old log-probs and values) and of the reference;
  3. rewards   per token r_t = -beta * KL_t, plus the score at the LAST response token only;
               GAE (Schulman et al. 2016) as a vectorised reverse scan over the response mask;
               optional whitening of the advantages;
  4. update    `num_iterations` passes over shuffled minibatches of `mini_batch_size` rollouts, each split
               into `gradient_accumulation_steps` micro-batches through the engine:
               loss = clipped policy loss (Schulman et al. 2017, eq. 7)
                      + vf_coef * clipped value loss - entropy_coef * entropy (response tokens only);
  5. KL control Ziegler et al.'s adaptive coefficient: coef *= 1 + clip(KL/target - 1, -0.2, 0.2) * n / horizon,
               with n = rollouts in the iteration (all processes) and KL the mean per-sequence KL sum.
Each optimizer step of 4. is one step of `Trainer.fit` (logging_steps, eval_steps, save_steps, max_steps
and signals count them): steps 1-3 and 5 run at an iteration's first step, and their result stays cached (and in a
checkpoint taken mid-iteration, so a resume continues on the same rollout exactly) for the others.

Alignment of response tokens and logits: rl.trainers.ppo_math.

Log-probs for the loss, the KL and the old policy all use logits / temperature without top-k/top-p
filtering (TRL's choice): the filters only shape exploration, and a filtered distribution has zero
mass where the unfiltered one does not, which would make the ratio and the KL undefined.

Deviations from the reference implementation: one value per TOKEN (not per sequence); minibatches and
gradient accumulation; the `n_steps` factor in the KL controller; no `trust_remote_code` unless asked.
Checked against hand-computed GAE/KL-controller values and a naive loop (tests/unit/trainers/test_ppo.py); TRL 1.16
has no PPO trainer any more, so there is no numerical peer for the whole loop.

The models and the losses on their outputs are in rl.trainers.ppo_math, the schema, sizes and prompts in
rl.trainers.ppo_config, the reward glue in rl.trainers.ppo_rewards; their public names are importable from here too.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

from rl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
)
from rl.algos.mismatch import rollout_correction
from rl.engine.dist import is_deepspeed, zero_stage
from rl.engine.generation import generate
from rl.engine.packing import pack_padded
from rl.engine.pipeline import ForwardBackwardPipeline
from rl.engine.state import PER_PROCESS, checkpoint_dir
from rl.errors import ConfigError
from rl.models.loading import (
    release_device_cache,
    resolve_dtype,
    trainable_fraction,
)
from rl.models.reward import load_reward_model
from rl.models.value import Critic, PPOModel
from rl.rollout.episodes import run_episodes
from rl.rollout.prompts import prompt_order
from rl.trainers.base import Trainer
from rl.trainers.sampling import episode_sampler
from rl.trainers.ppo_config import (
    PPOConfig,
    encode_prompts,
    load_prompt_data,
    ppo_dry_run_models,
    ppo_plan,
)
from rl.trainers.ppo_math import (
    critic_loss,
    loss_params,
    parameter_counts,
    policy_loss,
    ppo_advantages,
    rollout_stats,
    save_policy,
    score_forward,
)
from rl.trainers.ppo_rewards import (
    build_reward_source,
    ppo_scores,
)


class PPOTrainer(Trainer):
    """PPO with a shared value head or a separate critic, a frozen (or adapter-disabled) reference, and
    any reward source; runs single-process, DDP and DeepSpeed ZeRO-2/3 (policy and reference sharded).

        trainer = PPOTrainer(PPOConfig(model_name=..., ...), reward_fn=my_reward_fn)
        history = trainer.train(prompts, rounds=100)   # one metrics dict per optimizer step
        trainer.save()
    """

    def __init__(self, config: PPOConfig, *, model: nn.Module | None = None, tokenizer=None,
                 reward_fn: Callable | None = None, reward_model=None):
        cfg = config
        self._critic_rm = None

        def rewards():  # before the accelerator: a missing source fails in a second, nothing is ZeRO-3 sharded
            if cfg.value_model == "critic":
                self._critic_rm = load_reward_model(cfg.critic_model_path or cfg.reward_model_path or cfg.model_name,
                                                    dtype="float32", trainable=True,
                                                    trust_remote_code=cfg.trust_remote_code)
                for p in self._critic_rm.head.parameters():
                    p.requires_grad_(True)
            return build_reward_source(cfg, self.tokenizer, reward_fn, reward_model)

        # beta = 0 stays 0 (adaptive KL multiplies it): no KL penalty, so no reference at all
        model = self.build(config, model=model, tokenizer=tokenizer, micro_batch_size=cfg.micro_batch_size,
                           padding_side="left", rewards=rewards,
                           reference=dict(name=cfg.ref_model, needed=cfg.beta > 0))
        if self._critic_rm is not None and is_deepspeed(self.accelerator):
            raise ConfigError("value_model=critic is not supported under DeepSpeed yet; use value_model=shared "
                              "(the value head is sharded with the policy)")
        self.train_dtype = resolve_dtype(cfg.dtype)
        self.policy = PPOModel(model, value_head=cfg.value_model == "shared")
        self.critic = Critic(self._critic_rm) if self._critic_rm is not None else None
        self.kl_ctl = (AdaptiveKLController(cfg.beta, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl
                       else FixedKLController(cfg.beta))
        self.history: list[dict] = []
        self._exp = None  # the iteration's rollout while its optimizer steps are not all taken

    # ------------------------------------------------------------------ sizes and setup
    def plan(self, n_prompts: int, rounds: int | None = None) -> dict:
        """Derived sizes, computed once."""
        return ppo_plan(self.cfg, n_prompts, self.world, rounds)

    def _setup(self, plan: dict) -> None:
        if self.pipeline is not None:
            return
        cfg, acc = self.cfg, self.accelerator
        self.pipeline = self._pipeline(self.policy, cfg.learning_rate, checkpoint_dir(cfg.output_dir), plan)
        self.critic_pipeline = None
        if self.critic is not None:
            self.critic_pipeline = self._pipeline(self.critic, cfg.critic_learning_rate or cfg.learning_rate,
                                                  checkpoint_dir(cfg.output_dir) / "critic", plan)
        self.reference.place(acc)

    def _pipeline(self, model: nn.Module, lr: float, ckpt: Path, plan: dict) -> ForwardBackwardPipeline:
        return self.build_pipeline(model, plan["total_steps"], self.cfg.micro_batch_size, learning_rate=lr, ckpt=ckpt)

    # ------------------------------------------------------------------ one iteration
    def _rollout(self, prompt_ids: list[list[int]], seed: int):
        cfg = self.cfg
        model = self.pipeline.model if self.pipeline is not None else self.policy
        # a multi-turn environment (rl.envs.tool_math) runs whole episodes; their tool tokens are out of the loss
        env = getattr(self.reward, "env", None)
        sample = episode_sampler(self, generate, run_episodes, env)  # ours or vLLM; whole episodes if multi-turn
        rollout = sample(model, self.tokenizer, prompt_ids, max_new_tokens=cfg.max_completion_length,
                         temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
        if cfg.optimize_device_cache:
            release_device_cache()
        return rollout

    def _decode(self, rollout) -> list[str]:
        return [self.tokenizer.decode(c, skip_special_tokens=True) for c in rollout.completions()]

    def _experience(self, prompt_texts: list[str], prompt_ids: list[list[int]], metadata: list[dict] | None,
                    iteration: int) -> dict:
        """Steps 1-3 and 5 of one iteration on this process's prompts: what its steps_per_iteration
        optimizer steps share (the rollout, its advantages and returns, the ppo_epochs shuffles of the
        minibatches, the rollout's metrics averaged over processes). The KL controller moves here: its
        new value only enters the next iteration's rewards."""
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
        # the policy's own tokens: every response token, but an episode's tool tokens (attended, not trained)
        loss_mask = rollout.loss_mask[:, :N] if getattr(rollout, "loss_mask", None) is not None else mask
        batch = {"input_ids": torch.cat([rollout.prompt_ids, tokens], 1),
                 "attention_mask": torch.cat([rollout.prompt_mask, mask], 1), "tokens": tokens}
        critic = self.critic_pipeline.model if self.critic_pipeline is not None else None
        old_logp, old_values, ref_logp = score_forward(
            pipe.model, partial(self.reference.use, pipe) if self.reference.exists else None, critic, batch, P,
            device=pipe.device, micro_batch_size=cfg.micro_batch_size, temperature=cfg.temperature,
            logprob_chunk_size=cfg.logprob_chunk_size, head_capture=pipe.head_capture)
        t_score, dev, kl_coef = time.time() - t1, pipe.device, self.kl_ctl.value
        maskf = loss_mask.to(dev).float()  # 3. rewards and advantages (fp32, on the device)
        is_w, mismatch = rollout_correction(cfg, old_logp, rollout.logprobs[:, :N].to(dev), maskf)  # vLLM's mismatch
        eos_missing = torch.tensor([r != "stop" for r in rollout.finish_reasons], device=dev)
        exp = ppo_advantages(cfg, scores.to(dev), eos_missing, old_logp, ref_logp, old_values.to(dev), maskf, kl_coef)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + iteration)
        # 5. the rollout's metrics (averaged over processes), KL controller
        local = {k: float(v) for k, v in rollout_stats(exp, raw_scores.to(dev), eos_missing, maskf).items()}
        stats = self.reduce({**local, **extra, **mismatch})
        self.kl_ctl.update(stats["objective/kl"], cfg.per_device_train_batch_size * self.world)
        stats.update({"kl_coef": kl_coef, "time/generation": t_gen, "time/scoring": t_score})
        self.last_rollout = {"prompts": prompt_texts, "responses": responses, "scores": raw_scores.tolist()}
        return {"iteration": iteration, "world": self.world, "P": P, "stats": stats, "last_rollout": self.last_rollout,
                "data": {"tokens": tokens.to(dev), "mask": maskf, "old_logprobs": exp["old_logp"],
                         "advantages": exp["advantages"], "old_values": exp["old_values"], "returns": exp["returns"],
                         "ids": batch["input_ids"].to(dev), "attn": batch["attention_mask"].to(dev),
                         **({} if is_w is None else {"token_weights": is_w})},
                # packing: the response tokens as labels of the [prompt | response] rows (pack_padded)
                "labels": torch.cat([torch.full_like(rollout.prompt_ids, -100),
                                     tokens.masked_fill(loss_mask == 0, -100)], 1).cpu(),
                "orders": [torch.randperm(B, generator=gen) for _ in range(cfg.num_iterations)]}

    def _update(self, ex: dict, k: int):
        """4. the k-th optimizer step of an iteration: minibatch k % mini_batches of PPO epoch
        k // mini_batches (its micro-batches through the engine). Returns (loss metrics averaged over the
        micro-batches and processes, the policy's OptimStepResult)."""
        cfg, pipe, dev, P = self.cfg, self.pipeline, self.pipeline.device, ex["P"]
        common = dict(P=P, **loss_params(cfg), value_clip=cfg.value_clip, value_coef=cfg.vf_coef)
        data = {key: v for key, v in ex["data"].items() if key not in ("ids", "attn")}
        ids, attn, labels = ex["data"]["ids"], ex["data"]["attn"], ex["labels"]
        epoch, mb = divmod(k, self._plan["mini_batches_per_epoch"])
        mb_idx = ex["orders"][epoch][mb * cfg.mini_batch_size:(mb + 1) * cfg.mini_batch_size]
        sums, counts = {}, {}  # per metric: the sum over the micro-batches, their number
        for micro in mb_idx.split(cfg.micro_batch_size):
            micro = micro.to(dev)
            kw = {key: v[micro] for key, v in data.items()}
            f_ids, f_mask, f_in, f_kw = ids[micro], attn[micro], {}, {}
            if cfg.packing:  # padding-free rows; the losses read them back into response space
                b = pack_padded(f_ids.cpu(), f_mask.cpu(), labels[micro.cpu()], self.tokenizer.pad_token_id or 0)
                f_ids, f_mask, f_in = b["input_ids"], None, {"position_ids": b["position_ids"]}
                f_kw = {"target_index": b["target_index"].to(dev)}
                kw["packed_labels"] = b["labels"].to(dev)
            if self.critic_pipeline is None:
                fn = partial(policy_loss, **common)
                r = pipe.forward_backward_custom(fn, f_ids, f_mask, model_inputs=f_in, **kw, **f_kw).result()
            else:
                fn = partial(policy_loss, **{key: v for key, v in common.items()
                                             if key not in ("value_clip", "value_coef")})
                pk = {key: v for key, v in kw.items() if key not in ("old_values", "returns")}
                r = pipe.forward_backward_custom(fn, f_ids, f_mask, model_inputs=f_in, **pk, **f_kw).result()
                cfn = partial(critic_loss, P=P, value_clip=cfg.value_clip, value_coef=cfg.vf_coef)
                rc = self.critic_pipeline.forward_backward_custom(
                    cfn, f_ids, f_mask, model_inputs=f_in, mask=kw["mask"], old_values=kw["old_values"],
                    returns=kw["returns"], **f_kw).result()
                r.metrics.update(rc.metrics)
            for key, v in r.metrics.items():
                sums[key] = sums.get(key, 0.0) + v
                counts[key] = counts.get(key, 0) + 1
        o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        if self.critic_pipeline is not None:
            self.critic_pipeline.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        return self.reduce({key: sums[key] / counts[key] for key in sums}), o

    # ------------------------------------------------------------------ data
    def encode_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt (see rl.trainers.ppo_config.encode_prompts)."""
        return encode_prompts(self.tokenizer, prompts, self.cfg)

    load_data = staticmethod(load_prompt_data)  # (prompts, metadata, eval_prompts, eval_metadata) of a recipe
    dry_run_models = staticmethod(ppo_dry_run_models)  # the models a run holds, for the dry-run plan

    # ------------------------------------------------------------------ the loop
    def train(self, prompts: Sequence[str] | None = None, rounds: int | None = None,
              metadata: Sequence[dict] | None = None, eval_prompts: Sequence[str] | None = None,
              eval_metadata: Sequence[dict] | None = None, *, num_iterations: int | None = None) -> list[dict]:
        """Run PPO on `prompts` for `rounds` rounds (`num_iterations=`, the reference docs' name; default: max_steps,
        else num_train_epochs passes); returns one metrics dict per optimizer step, with its `iteration` (also `self.history`).

        Every process passes the same prompts; iteration i uses a seeded shuffle of them, and process r
        takes every world-th of the iteration's `per_device_train_batch_size * world` prompts. `metadata` (one dict per
        prompt, e.g. {"answer": ...}) is handed to the reward source. Without prompts, the reward's
        environment supplies them (and their metadata)."""
        cfg, acc = self.cfg, self.accelerator
        env = getattr(self.reward, "env", None)
        if prompts is None and env is not None:
            prompts, metadata = list(env.prompts), list(env.metadata)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        if not prompts:
            raise ConfigError("train() got no prompts")
        if metadata is not None and len(metadata) != len(prompts):
            raise ConfigError(f"metadata has {len(metadata)} entries for {len(prompts)} prompts")
        plan = self.plan(len(prompts), rounds if rounds is not None else num_iterations)
        self._plan = plan
        tracker = self.open_run(plan["total_steps"], desc="ppo", plot_keys=[
            "objective/scores", "objective/kl", "kl_coef", "loss/policy", "loss/value", "val/explained_variance",
            "policy/clipfrac", "response_length", "objective/entropy"])
        self._setup(plan)
        n_train, n_all = trainable_fraction(self.policy)
        tracker.write(f"ppo: {len(prompts)} prompts, {plan['iterations']} iterations x {plan['global_batch']} "
                      f"rollouts, {plan['steps_per_iteration']} optimizer steps each; {self.processes}, "
                      f"ZeRO stage {zero_stage(acc)}; trainable {n_train:,}/{n_all:,} parameters; "
                      f"reward: {self.reward.name}; value: {cfg.value_model}; reference: "
                      f"{self.reference.description}")
        if zero_stage(acc) == 3:
            tracker.write("zero3 shards on rank 0: " + ", ".join(f"{k} {a:,}/{b:,}" for k, (a, b) in self.shard_report().items()))
        self._prompts, self._encoded, self._metadata = prompts, self.encode_prompts(prompts), metadata
        if eval_metadata is not None and (eval_prompts is None or len(eval_metadata) != len(eval_prompts)):
            raise ConfigError(f"eval_metadata has {len(eval_metadata)} entries for "
                              f"{len(eval_prompts or [])} eval prompts")
        self._eval_prompts, self._eval_metadata = eval_prompts, eval_metadata
        rows = self.fit(plan["total_steps"], tracker)
        self.history += rows
        return self.history

    # ------------------------------------------------------------------ the lifecycle's hooks
    def train_step(self) -> dict:
        """One optimizer step; an iteration's first step makes its rollout (`_experience`), kept until its
        steps_per_iteration steps are taken (and in a checkpoint taken between them)."""
        spi, pipe = self._plan["steps_per_iteration"], self.pipeline
        it, k = divmod(pipe.step, spi)
        t0 = time.time()
        if self._exp is None or self._exp["iteration"] != it:
            prompts, metadata = self._prompts, self._metadata
            idx = self._global_indices(it, len(prompts))[self.accelerator.process_index::self.world]
            self._exp = self._experience([prompts[i] for i in idx], [self._encoded[i] for i in idx],
                                         [dict(metadata[i]) for i in idx] if metadata is not None else None, it)
        ex, t_train = self._exp, time.time()
        metrics, o = self._update(ex, k)
        if k + 1 == spi:
            self._exp = None  # used up: its memory is free while the next rollout is sampled
        return {"step": pipe.step, **ex["stats"], **metrics, "learning_rate": o.learning_rate,
                "grad_norm": o.grad_norm if o.grad_norm is not None else 0.0, "time/training": time.time() - t_train,
                "step_time": time.time() - t0, "iteration": it + 1,
                "epoch": (it + (k + 1) / spi) * self._plan["global_batch"] / len(self._prompts)}

    def evaluate_now(self) -> dict | None:
        return self.evaluate(self._eval_prompts, self._eval_metadata) if self._eval_prompts else None

    def checkpoint_extra(self) -> dict:
        """Within an iteration its rollout goes into the checkpoint (each process its own rows), so a resume
        continues on it exactly instead of sampling it again with a policy that has taken some updates."""
        extra = {"iteration": self.pipeline.step // self._plan["steps_per_iteration"], "kl_coef": self.kl_ctl.value}
        if self._exp is not None:
            extra[PER_PROCESS] = {"experience": self._exp}
        return extra

    def restore(self, extra: dict) -> None:
        self.kl_ctl.value = float(extra["kl_coef"])
        ex, self._exp = extra.get(PER_PROCESS, {}).get("experience"), None
        # another number of processes splits the rollout otherwise: that resume samples it afresh (not exact)
        if ex is not None and ex["world"] == self.world:
            self._exp = {**ex, "data": {k: v.to(self.pipeline.device) for k, v in ex["data"].items()}}
            self.last_rollout = ex["last_rollout"]

    def checkpoint_parts(self, name: str) -> list[Path]:
        """The critic's engine state lives in `checkpoints/critic/<name>` beside the policy's."""
        return [checkpoint_dir(self.run_dir) / "critic" / name] if self.critic_pipeline is not None else []

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
        policy = self.pipeline.unwrapped_model
        out = {"policy": parameter_counts(policy.base_model.parameters())}
        if policy.value_head is not None:
            out["value head"] = parameter_counts(policy.value_head.parameters())
        if self.reference.mode == "copy":
            out["reference"] = parameter_counts(self.reference.model.parameters())
        if self.critic_pipeline is not None:
            out["critic"] = parameter_counts(self.critic_pipeline.unwrapped_model.parameters())
        return out

    def _global_indices(self, iteration: int, n: int) -> list[int]:
        """The iteration's per_device_train_batch_size * world prompt indices: consecutive slices of per-epoch seeded
        shuffles (so every prompt is used once per epoch), identical on every process."""
        return prompt_order(iteration, n, self._plan["global_batch"], self.cfg.seed)

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
        return self.reduce({"eval/scores": float(scores.mean()),
                            "eval/response_length": float(rollout.mask.sum(-1).float().mean())})

    # ------------------------------------------------------------------ saving
    def save(self, out_dir: str | None = None) -> str:
        """Write the policy as an HF model directory (LoRA: the adapter; no value head) plus
        `value_head.safetensors`; every process must call it (ZeRO-3 gathers the weights)."""
        out = Path(out_dir or self.cfg.output_dir)
        save_policy(self.accelerator, self.pipeline, self.tokenizer, out, self.history[-1] if self.history else {},
                    merged=self.cfg.save_merged)
        return str(out)
