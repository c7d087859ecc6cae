"""PPO for RLHF (Ouyang et al. 2022; Ziegler et al. 2019): a policy, a frozen reference, a value function.

One iteration:
  1. rollout   sample `batch_size` completions per process from the policy (`rl.engine.generation.generate`:
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
from rl.engine.dist import is_deepspeed, zero_stage
from rl.engine.generation import generate
from rl.engine.packing import pack_padded
from rl.engine.pipeline import ForwardBackwardPipeline
from rl.engine.state import checkpoint_dir
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
from rl.trainers.sampling import rollout_sampler
from rl.trainers.ppo_config import (
    PPOConfig,
    encode_prompts,
    load_prompt_data,
    ppo_dry_run_models,
    ppo_plan,
)
from rl.trainers.ppo_math import (
    critic_loss,
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
        history = trainer.train(prompts, num_iterations=100)   # one metrics dict per iteration
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

        # kl_penalty_coef = 0 stays 0 (adaptive KL multiplies it): no KL penalty, so no reference at all
        model = self.build(config, model=model, tokenizer=tokenizer, micro_batch_size=cfg.micro_batch_size,
                           padding_side="left", rewards=rewards,
                           reference=dict(name=cfg.ref_model, needed=cfg.kl_penalty_coef > 0))
        if self._critic_rm is not None and is_deepspeed(self.accelerator):
            raise ConfigError("value_model=critic is not supported under DeepSpeed yet; use value_model=shared "
                              "(the value head is sharded with the policy)")
        self.train_dtype = resolve_dtype(cfg.dtype)
        self.policy = PPOModel(model, value_head=cfg.value_model == "shared")
        self.critic = Critic(self._critic_rm) if self._critic_rm is not None else None
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
        gen = rollout_sampler(self, generate)  # our sampler, or vLLM holding the policy's current weights
        engine = {} if gen is generate else {"generate_fn": gen}
        sample = partial(run_episodes, env=env, **engine) if getattr(env, "multi_turn", False) else gen
        rollout = sample(model, self.tokenizer, prompt_ids, max_new_tokens=cfg.max_new_tokens,
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
        # the policy's own tokens: every response token, but an episode's tool tokens (attended, not trained)
        loss_mask = rollout.loss_mask[:, :N] if getattr(rollout, "loss_mask", None) is not None else mask
        batch = {"input_ids": torch.cat([rollout.prompt_ids, tokens], 1),
                 "attention_mask": torch.cat([rollout.prompt_mask, mask], 1), "tokens": tokens}
        critic = self.critic_pipeline.model if self.critic_pipeline is not None else None
        old_logp, old_values, ref_logp = score_forward(
            pipe.model, partial(self.reference.use, pipe) if self.reference.exists else None, critic, batch, P,
            device=pipe.device, micro_batch_size=cfg.micro_batch_size, temperature=cfg.temperature,
            logprob_chunk_size=cfg.logprob_chunk_size, head_capture=pipe.head_capture)
        t_score = time.time() - t1
        # 3. rewards and advantages (fp32, on the device)
        t2 = time.time()
        dev = pipe.device
        maskf = loss_mask.to(dev).float()
        eos_missing = torch.tensor([r != "stop" for r in rollout.finish_reasons], device=dev)
        kl_coef = self.kl_ctl.value
        exp = ppo_advantages(cfg, scores.to(dev), eos_missing, old_logp, ref_logp, old_values.to(dev), maskf, kl_coef)
        adv, returns, old_logp, old_values = exp["advantages"], exp["returns"], exp["old_logp"], exp["old_values"]
        # 4. PPO epochs over shuffled minibatches
        common = dict(P=P, clip_ratio=cfg.clip_ratio, value_clip=cfg.value_clip, value_coef=cfg.value_coef,
                      entropy_coef=cfg.entropy_coef, temperature=cfg.temperature)
        data = {"tokens": tokens.to(dev), "mask": maskf, "old_logprobs": old_logp, "advantages": adv,
                "old_values": old_values, "returns": returns}
        ids, attn = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
        # packing: the response tokens as labels of the [prompt | response] rows, for rl.engine.packing.pack_padded
        labels = torch.cat([torch.full_like(rollout.prompt_ids, -100), tokens.masked_fill(loss_mask == 0, -100)], 1).cpu()
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
                    f_ids, f_mask, f_in, f_kw = ids[micro], attn[micro], {}, {}
                    if cfg.packing:  # padding-free rows; the losses read them back into response space
                        b = pack_padded(f_ids.cpu(), f_mask.cpu(), labels[micro.cpu()],
                                        self.tokenizer.pad_token_id or 0)
                        f_ids, f_mask, f_in = b["input_ids"], None, {"position_ids": b["position_ids"]}
                        f_kw = {"target_index": b["target_index"].to(dev)}
                        kw["packed_labels"] = b["labels"].to(dev)
                    if self.critic_pipeline is None:
                        fn = partial(policy_loss, **common)
                        r = pipe.forward_backward_custom(fn, f_ids, f_mask, model_inputs=f_in, **kw, **f_kw).result()
                    else:
                        fn = partial(policy_loss, **{k: v for k, v in common.items()
                                                     if k not in ("value_clip", "value_coef")})
                        pk = {k: v for k, v in kw.items() if k not in ("old_values", "returns")}
                        r = pipe.forward_backward_custom(fn, f_ids, f_mask, model_inputs=f_in, **pk, **f_kw).result()
                        cfn = partial(critic_loss, P=P, value_clip=cfg.value_clip, value_coef=cfg.value_coef)
                        rc = self.critic_pipeline.forward_backward_custom(
                            cfn, f_ids, f_mask, model_inputs=f_in, mask=kw["mask"], old_values=kw["old_values"],
                            returns=kw["returns"], **f_kw).result()
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
        local = rollout_stats(exp, raw_scores.to(dev), eos_missing, maskf)
        local = {k: float(v) for k, v in local.items()}
        local.update({k: sums[k] / counts[k] for k in sums}, **extra)
        metrics = self.reduce(local)
        self.kl_ctl.update(metrics["objective/kl"], cfg.batch_size * self.world)
        metrics.update({"kl_coef": kl_coef, "learning_rate": lr, "grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
                        "time/generation": t_gen, "time/scoring": t_score, "time/training": t_train,
                        "time/iteration": time.time() - t0})
        self.last_rollout = {"prompts": prompt_texts, "responses": responses, "scores": raw_scores.tolist()}
        return metrics

    # ------------------------------------------------------------------ data
    def encode_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt (see rl.trainers.ppo_config.encode_prompts)."""
        return encode_prompts(self.tokenizer, prompts, self.cfg)

    load_data = staticmethod(load_prompt_data)  # (prompts, metadata, eval_prompts, eval_metadata) of a recipe
    dry_run_models = staticmethod(ppo_dry_run_models)  # the models a run holds, for the dry-run plan

    # ------------------------------------------------------------------ the loop
    def train(self, prompts: Sequence[str] | None = None, num_iterations: int | None = None,
              metadata: Sequence[dict] | None = None, eval_prompts: Sequence[str] | None = None,
              eval_metadata: Sequence[dict] | None = None) -> list[dict]:
        """Run PPO on `prompts` (strings); returns one metrics dict per iteration (also `self.history`).

        Every process passes the same prompts; iteration i uses a seeded shuffle of them, and process r
        takes every world-th of the iteration's `batch_size * world` prompts. `metadata` (one dict per
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
        plan = self.plan(len(prompts), num_iterations)
        self._plan = plan
        tracker = self.open_run(plan["iterations"], desc="ppo", plot_keys=[
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
        return self.evaluate(self._eval_prompts, self._eval_metadata) if self._eval_prompts else None

    def checkpoint_extra(self) -> dict:
        return {"iteration": self._iteration, "kl_coef": self.kl_ctl.value}

    def restore(self, extra: dict) -> None:
        self._iteration = int(extra["iteration"])
        self.kl_ctl.value = float(extra["kl_coef"])

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
        """The iteration's batch_size * world prompt indices: consecutive slices of per-epoch seeded
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
