"""GRPO's batch assembly: DAPO's dynamic-sampling picks, the length-grouped micro-batches of the training
forward, and the reward metrics of a step (prompt rows and their encoding are in rl.rollout.prompts).

Dynamic sampling (DAPO, Yu et al. 2025, sec. 3.2): each round every process samples and scores its
share of fresh prompts; rewards are gathered, so every process sees the same keep mask (W, k) per
round (`rl.algos.dapo.groups_with_spread`) and takes the same decisions without another collective.
Rounds continue until every process holds k groups with reward spread, or max_sampling_rounds; each
process then trains on its own first k kept groups (shapes stay those of a plain step), and a process
still short takes dropped groups (advantage 0, counted as dapo/filled_groups) rather than stopping a
run on an unlucky step. Groups never move between processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rl.algos.advantages import nanstd
from rl.algos.mismatch import importance_weights
from rl.algos.off_policy import off_policy_terms
from rl.algos.policy_losses import grpo_loss
from rl.config.plan import cadence
from rl.engine import losses
from rl.engine.generation import Rollout
from rl.engine.packing import left_pad, unpack_targets
from rl.trainers.rewards import combine_rewards

# ------------------------------------------------------------------------------ dynamic sampling

def pick_groups(keep: list[torch.Tensor], k: int) -> tuple[torch.Tensor, int]:
    """Each process's k groups out of its rounds, kept ones first (in sampling order), then dropped ones.

    keep: one (W, k) bool per round, True where the group has reward spread. Returns (picks (W, k)
    long: indices into a process's groups of all rounds, round-major, i.e. round * k + j; filled: how
    many picked groups are dropped ones, over all processes)."""
    mask = torch.cat(keep, dim=1)  # (W, R*k)
    order = torch.arange(mask.shape[1])
    # a stable sort on "dropped" puts kept groups first, each part in its sampling order
    picks = torch.stack([order[torch.argsort((~row).long(), stable=True)][:k] for row in mask])
    filled = int((~mask.gather(1, picks)).sum())
    return picks, filled


def picked_rows(picks: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(W, k) group indices -> (W, k*G) completion indices (a group's G completions are contiguous)."""
    G = num_generations
    return (picks[:, :, None] * G + torch.arange(G)).reshape(picks.shape[0], -1)


def take_global(per_round: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """One gathered tensor per round, (W*n, ...) process-major -> the picked (W*k*G, ...) rows, where
    rows (W, k*G) index a process's completions over all rounds (round-major)."""
    W = rows.shape[0]
    parts = torch.cat([t.reshape(W, -1, *t.shape[1:]) for t in per_round], dim=1)  # (W, R*n, ...)
    return torch.stack([parts[p, rows[p]] for p in range(W)]).reshape(-1, *per_round[0].shape[1:])


def select_rollout(rollouts: list[Rollout], rows: list[int]) -> Rollout:
    """The given rows of the rollouts' concatenation as one rollout, re-padded (prompts on the left,
    completions on the right) to the widest picked row. One rollout with every row: itself."""
    if len(rollouts) == 1 and rows == list(range(rollouts[0].tokens.shape[0])):
        return rollouts[0]
    flat = [(ro, i) for ro in rollouts for i in range(ro.tokens.shape[0])]
    picked = [flat[r] for r in rows]
    first = rollouts[0]
    device = first.tokens.device
    N = max(int(ro.mask[i].sum()) for ro, i in picked)
    tokens = torch.full((len(rows), N), first.pad_token_id, dtype=first.tokens.dtype, device=device)
    logprobs = torch.zeros(len(rows), N, dtype=first.logprobs.dtype, device=device)
    mask = torch.zeros(len(rows), N, dtype=first.mask.dtype, device=device)
    for j, (ro, i) in enumerate(picked):
        keep = ro.mask[i].bool()
        n = int(keep.sum())
        tokens[j, :n], logprobs[j, :n], mask[j, :n] = ro.tokens[i][keep], ro.logprobs[i][keep], 1
    prompts = [ro.prompts[i] for ro, i in picked]
    prompt_ids, prompt_mask = left_pad(prompts, first.pad_token_id, device)
    out = Rollout(tokens=tokens, logprobs=logprobs, mask=mask, prompts=prompts, prompt_ids=prompt_ids,
                  prompt_mask=prompt_mask, pad_token_id=first.pad_token_id,
                  finish_reasons=[ro.finish_reasons[i] for ro, i in picked])
    if getattr(first, "loss_mask", None) is None:
        return out
    # episodes (rl.envs.tool_math): keep which tokens are the policy's; tool tokens stay out of the loss
    loss_mask = torch.zeros_like(mask)
    for j, (ro, i) in enumerate(picked):
        loss_mask[j, :int(ro.mask[i].sum())] = ro.loss_mask[i][ro.mask[i].bool()]
    return type(first)(**{**vars(out), "loss_mask": loss_mask, "tool_calls": [ro.tool_calls[i] for ro, i in picked],
                          "turns": [ro.turns[i] for ro, i in picked]})


# ------------------------------------------------------------------------------ micro-batches

def length_grouped_slices(attention_mask: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Length-grouped micro-batches: the B rows sorted by attended length (prompt + completion, longest
    first; ties keep their order), cut into `parts` groups of B // parts rows; each group's indices are
    returned in ascending order. (B, T) mask -> `parts` (B // parts,) index tensors.

    Why: a micro-batch then pads only to its own longest row (`take_micro_batch`), so with uneven completion
    lengths most micro-batches are much narrower than the batch. Equal group sizes keep every loss
    aggregation the same as contiguous slices (token_mean divides by the step's token count,
    sequence_mean and constant by rows per micro-batch), so only the padding changes; with equal
    lengths the groups are the contiguous slices themselves."""
    B = attention_mask.shape[0]
    size = B // parts
    order = torch.argsort(attention_mask.sum(-1).cpu(), descending=True, stable=True)
    return [order[i * size:(i + 1) * size].sort().values for i in range(parts)]


def take_micro_batch(batch: dict, rows: torch.Tensor | slice, with_span: bool = False):
    """The micro-batch `rows` of a batch whose prompts are left-padded and completions right-padded
    (`Rollout.to_batch`), trimmed to its own widest row: only the columns [a, b) where some of its rows
    attend are kept. (B, T) tensors -> [:, a:b]; (B, T-1) tensors aligned with labels[:, 1:] (old / ref
    log-probs) -> [:, a:b-1]; (B,) per-row tensors -> their rows. Positions counted from the mask
    (`rl.engine.generation.position_ids_from_mask`) are unchanged by dropping leading all-pad columns, so the model sees
    each row as before. With `with_span`, returns (micro-batch, (a, b))."""
    if isinstance(rows, torch.Tensor):
        rows = rows.to(batch["attention_mask"].device)
    mask = batch["attention_mask"][rows]
    T = mask.shape[1]
    cols = mask.any(0).nonzero().squeeze(1)
    a, b = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, T)
    out = {}
    for k, v in batch.items():
        v = v[rows]
        if v.dim() >= 2 and v.shape[1] == T:
            v = v[:, a:b]
        elif v.dim() >= 2 and v.shape[1] == T - 1:
            v = v[:, a:b - 1]
        out[k] = v
    return (out, (a, b)) if with_span else out


# ------------------------------------------------------------------------------ metrics

def nanmean(x: torch.Tensor) -> float:
    """Mean ignoring NaNs (unscored completions); 0.0 when nothing was scored."""
    v = torch.nanmean(x.float())
    return float(v) if not torch.isnan(v) else 0.0


def reward_metrics(rewards: torch.Tensor, per_func: torch.Tensor, names: list[str], components: dict,
                   lengths: torch.Tensor, truncated: torch.Tensor, advantages: torch.Tensor,
                   num_generations: int) -> dict:
    """A step's metrics on the global batch, TRL's names. rewards, lengths, truncated, advantages: (B,);
    per_func (B, F) one column per reward source (names); components: name -> (B,) environment parts."""
    G = num_generations
    std = nanstd(rewards.view(-1, G), dim=1)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    metrics = {
        "reward": nanmean(rewards), "reward_std": float(nanstd(rewards)) if rewards.numel() > 1 else 0.0,
        "frac_reward_zero_std": float(zero_std.float().mean()), "num_zero_std_groups": int(zero_std.sum()),
        "completions/mean_length": float(lengths.float().mean()), "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(truncated.mean()),
        "advantages/mean_abs": float(advantages.abs().mean()),
    }
    for j, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = nanmean(per_func[:, j])
        metrics[f"rewards/{name}/std"] = float(nanstd(per_func[:, j]))
    for name, v in components.items():  # an environment's components, e.g. rewards/correctness/mean
        metrics[f"rewards/{name}/mean"] = nanmean(v)
    return metrics


def loss_params(cfg) -> dict:
    """GRPO's loss keys of `cfg`, read in this one place (`grpo_loss`'s keyword arguments): which loss
    (`loss_type`, TRL's names), its clip range, KL and aggregation."""
    return dict(loss_type=cfg.loss_type, beta=cfg.beta, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                loss_aggregation=cfg.loss_aggregation, max_completion_length=cfg.max_completion_length,
                use_bias_correction_kl=cfg.use_bias_correction_kl,
                importance_sampling_level=cfg.importance_sampling_level, delta=cfg.delta,
                **{k: getattr(cfg, k) for k in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                                                "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")})


def micro_loss_kwargs(cfg, mb: dict, gb: dict) -> dict:
    """`grpo_loss_fn`'s keywords for micro-batch `mb` of generation batch `gb`: the loss keys, the vLLM
    mismatch correction's, and a stale batch's off-policy correction (`loss_kw`, rl.trainers.grpo_async)."""
    return dict(advantages=mb["advantages"], old_logprobs=mb.get("old"), ref_logprobs=mb.get("ref"),
                temperature=cfg.temperature, num_items=gb["num_items"], **loss_params(cfg),
                behaviour_logprobs=mb.get("behaviour"), is_cap=cfg.vllm_importance_sampling_clip_max,
                is_mode=cfg.vllm_importance_sampling_mode, is_apply=cfg.vllm_importance_sampling_correction,
                is_clip_min=cfg.vllm_importance_sampling_clip_min, **gb.get("loss_kw", {}))


def fold_micro_metrics(sums: dict, extremes: dict, metrics: dict, parts: int) -> None:
    """Add one micro-batch's metrics: `*/max` and `*/min` as extremes over the micro-batches, the rest
    as their mean over `parts` micro-batches."""
    for key, v in metrics.items():
        if key.endswith(("/max", "/min")):
            pick = max if key.endswith("/max") else min
            extremes[key] = pick(extremes.get(key, v), v)
        else:
            sums[key] = sums.get(key, 0.0) + v / parts


def grpo_loss_fn(logits, labels, attention_mask=None, *, advantages, old_logprobs=None, ref_logprobs=None,
                 temperature: float = 1.0, target_index=None, behaviour_logprobs=None, is_cap: float = 3.0,
                 is_mode: str = "token_truncate", is_apply: bool = True, is_clip_min: float | None = None,
                 off_policy: str | None = None, behav_imp_weight_cap: float = 5.0, **kw):
    """Engine signature `(logits, labels, attention_mask, **kw) -> (loss, metrics)`.

    old_logprobs/ref_logprobs are (B, T-1) aligned with labels[:, 1:]; old_logprobs None means the
    current policy (detached), i.e. ratio 1 (num_iterations = 1). Packed rows (`rl.engine.packing.pack_padded`):
    logits and labels are the packed rows' and `target_index` (B, T-1) brings their log-probs back to
    the rollout's padded layout, where the rest of the loss runs as before. behaviour_logprobs (B, T-1):
    the rollout engine's (vLLM's) log-probs of the sampled tokens; their mismatch with the old policy is
    measured, and with `is_apply` corrected by truncated importance weights (`rl.algos.mismatch`).
    off_policy: a batch sampled by an older policy (max_staleness): its correction by name, `behaviour` or
    `decoupled` (`rl.algos.off_policy`, with behav_imp_weight_cap), on behaviour_logprobs (the sampler's)."""
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp, mask = losses.token_logprobs(logits, labels)
    if target_index is not None:
        logp, mask = unpack_targets(logp, target_index), unpack_targets(mask, target_index)
    weights, extra = None, {}
    if off_policy is not None:
        old, weights, extra = off_policy_terms(off_policy, logp, behaviour_logprobs, mask, behav_imp_weight_cap)
    else:
        old = logp.detach() if old_logprobs is None else old_logprobs
        if behaviour_logprobs is not None:
            low = {} if is_clip_min is None else {"clip_min": is_clip_min}  # the config refuses it where unsupported
            weights, extra = importance_weights(old, behaviour_logprobs, mask, is_cap, is_mode, **low)
            weights = weights if is_apply else None
    loss, metrics = grpo_loss(logp, old, advantages, mask, ref_logp=ref_logprobs, token_weights=weights, **kw)
    return loss, {**metrics, **extra}


def log_completions(trainer, generation: int, prompts: list, completions: list[str], rewards: torch.Tensor) -> None:
    """TRL's log_completions: this process's prompts, completions and rewards (each source's, and their sum with
    reward_weights) of a generation batch whose first step is a logging step, appended to
    `<output_dir>/completions.jsonl` (num_completions_to_print rows at most; log_unique_prompts: one per prompt)."""
    cfg = trainer.cfg
    step, total = generation * cfg.num_iterations + 1, trainer._plan["total_steps"]
    if not cadence(cfg, total).log_at(step, total):
        return
    summed = combine_rewards(rewards, trainer.reward.weights).tolist()
    rows = [{"step": step, "prompt": p, "completion": c, "reward": r, **dict(zip(trainer.reward.names, each))}
            for p, c, r, each in zip(prompts, completions, summed, rewards.tolist())]
    if cfg.log_unique_prompts:  # the first row of each prompt, in order
        rows = list({json.dumps(r["prompt"]): r for r in reversed(rows)}.values())[::-1]
    with open(Path(cfg.output_dir) / "completions.jsonl", "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows[:cfg.num_completions_to_print])
