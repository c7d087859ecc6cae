"""PPO's models and the math on their outputs: the policy with a value head, a separate critic, the
response-space log-probs, the engine losses, and the no-grad scoring forward of a rollout.

Alignment, the part the reference got wrong: for a batch laid out as [left-padded prompt (P) | response (N)],
response token j sits at input position P + j and is predicted by the logits (and valued by the hidden
state) at position P - 1 + j. Every per-token tensor here is (B, N) in that "response space": log-probs,
values, KL, rewards, advantages, returns, mask. Position ids are counted from each row's first real token,
exactly as during sampling, so the recomputed log-probs equal the sampler's (checked in tests/unit/trainers/test_ppo.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from rl.algos.advantages import gae, whiten
from rl.algos.kl import kl_penalized_rewards, per_token_kl
from rl.algos.policy_losses import compute_policy_loss, ppo_value_loss
from rl.algos.reduce import masked_mean
from rl.engine.chunked import HeadLogits, chunked_token_logprobs
from rl.engine.packing import IGNORE_INDEX, position_ids_from_mask, unpack_targets
from rl.engine.scoring import sequence_logprobs
from rl.models.value import write_policy


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
    `rl.engine.chunked.HeadLogits` (the engine's chunked LM head): then no (B, N, V) tensor is built."""
    if isinstance(logits, HeadLogits):
        return (response_logits(logits, prompt_width) / temperature).logprobs(tokens, with_entropy)
    logp, entropy = _logprobs_at(response_logits(logits, prompt_width), tokens, temperature, with_entropy)
    return (logp, entropy) if with_entropy else logp


def _logprobs_at(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """log softmax(logits / temperature) at `targets` (..., ) in fp32, and the entropy of that
    distribution (None without `with_entropy`); logits (..., V)."""
    lg = logits.float()
    if temperature != 1.0:
        lg = lg / temperature
    logz = torch.logsumexp(lg, dim=-1)
    logp = lg.gather(-1, targets[..., None]).squeeze(-1) - logz
    entropy = logz - (torch.softmax(lg, dim=-1) * lg).sum(-1) if with_entropy else None
    return logp, entropy


def packed_response_logprobs(logits, labels: torch.Tensor, target_index: torch.Tensor, prompt_width: int,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`response_logprobs(..., with_entropy=True)` from the logits of packed rows (R, W, V) (or their
    `HeadLogits`): labels (R, W) hold the response tokens (-100 elsewhere) and `target_index` (B, P+N-1)
    is `rl.engine.packing.pack_padded`'s, which brings the per-target log-probs and entropies back to the
    rollout's layout; returns (logp, entropy), each (B, N), 0 where the packed rows hold no response token."""
    if isinstance(logits, HeadLogits):
        logp, _, entropy = chunked_token_logprobs(logits / temperature, labels, with_entropy=True)
    else:
        target = labels[:, 1:]
        logp, entropy = _logprobs_at(logits[:, :-1], target.clamp(min=0), temperature, with_entropy=True)
        counted = target != IGNORE_INDEX
        logp, entropy = logp * counted, entropy * counted
    back = [unpack_targets(x, target_index)[:, prompt_width - 1:] for x in (logp, entropy)]
    return back[0], back[1]


def packed_values(value: torch.Tensor, target_index: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Values of packed rows (R, W) -> the (B, N) response-space values `value[:, P-1:-1]` of the
    rollout: the state at position t values the target at t+1, so the values travel with the targets."""
    return unpack_targets(value[:, :-1], target_index)[:, prompt_width - 1:]


# PPO's logged policy metrics (TRL's PPO names), whichever loss_type computes them
PPO_METRICS = ("loss/policy", "policy/clipfrac", "policy/approx_kl", "policy/ratio_mean", "policy/ratio_max")


def loss_params(cfg) -> dict:
    """PPO's policy-loss keys of `cfg`, read in this one place (`policy_loss`'s keyword arguments): the
    registered policy loss (`loss_type`, default "ppo": the symmetric clip), its clip range, the length
    budget (the divisor of a loss type that aggregates by a constant, dr_grpo), the entropy bonus and the
    sampling temperature the log-probs use."""
    return dict(loss_type=cfg.loss_type, epsilon=cfg.epsilon, max_length=cfg.max_completion_length,
                entropy_coef=cfg.entropy_coef, temperature=cfg.temperature)


def policy_loss(model, inputs, outputs, *, P, tokens, mask, old_logprobs, advantages, old_values=None,
                returns=None, loss_type="ppo", epsilon=0.2, epsilon_high=None, max_length=None, value_clip=0.2,
                value_coef=1.0, entropy_coef=0.0, temperature=1.0, packed_labels=None, target_index=None,
                token_weights=None):
    """The engine loss of the policy on rows [prompt P | response N]: the registered policy loss `loss_type`
    (`rl.algos.policy_losses.compute_policy_loss`; "ppo": the clipped surrogate with epsilon = epsilon_high,
    token mean) - entropy_coef * mean entropy, plus value_coef times the clipped value loss when the policy
    carries the value head (`returns` given). `token_weights` (B, N): the rollout-mismatch correction of a vLLM
    rollout (`rl.algos.mismatch`), multiplying each token's policy-gradient term. Packed rows (`rl.engine.packing.pack_padded`): their
    `packed_labels` and `target_index` bring the log-probs, entropies and values back to response space,
    where the rest is unchanged."""
    if target_index is not None:
        logp, entropy = packed_response_logprobs(outputs.logits, packed_labels, target_index, P, temperature)
    else:
        logp, entropy = response_logprobs(outputs.logits, tokens, P, temperature, with_entropy=True)
    loss, metrics = compute_policy_loss(logp, old_logprobs, advantages, mask, loss_type=loss_type, epsilon=epsilon,
                                        epsilon_high=epsilon_high, max_length=max_length, token_weights=token_weights)
    metrics = {k: v for k, v in metrics.items() if k in PPO_METRICS}
    ent = masked_mean(entropy, mask)
    loss = loss - entropy_coef * ent
    metrics["policy/entropy"] = ent.detach()
    if returns is not None and outputs.value is not None:
        v = outputs.value[:, P - 1:-1] if target_index is None else packed_values(outputs.value, target_index, P)
        v_loss, v_metrics = ppo_value_loss(v, old_values, returns, mask, value_clip)
        loss = loss + value_coef * v_loss
        metrics.update(v_metrics)
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def critic_loss(model, inputs, outputs, *, P, mask, old_values, returns, value_clip=0.2, value_coef=1.0,
                target_index=None):
    """The engine loss of a separate critic: value_coef times the clipped value loss (packed rows: see
    `policy_loss`)."""
    v = outputs.value[:, P - 1:-1] if target_index is None else packed_values(outputs.value, target_index, P)
    v_loss, metrics = ppo_value_loss(v, old_values, returns, mask, value_clip)
    return value_coef * v_loss, metrics


@torch.no_grad()
def score_forward(model, reference, critic, batch: dict, P: int, *, device, micro_batch_size: int,
                  temperature: float = 1.0, logprob_chunk_size: int | None = None, head_capture=None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Old log-probs, old values and reference log-probs of a rollout, (B, N) each, in micro-batches.

    `model` is the (wrapped) policy, `reference()` a context manager giving the reference model
    (`functools.partial(ReferencePolicy.use, pipeline)`), or None when there is none (kl_penalty_coef
    = 0: the reference log-probs are then the old ones, a KL of 0), `critic` the separate value model
    or None (values then come from the policy's head), `head_capture(ids)` the engine's chunked-LM-head
    context (`ForwardBackwardPipeline.head_capture`) or None. `batch` holds input_ids / attention_mask
    (B, P+N) and tokens (B, N). The reference's LM head runs chunk by chunk when its logits would be
    large (`rl.engine.generation.sequence_logprobs`)."""
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    toks = batch["tokens"].to(device)
    pos = position_ids_from_mask(mask)
    old_lp, old_v, ref_lp = [], [], []
    model.eval()
    try:
        for s in range(0, ids.shape[0], micro_batch_size):
            sl = slice(s, s + micro_batch_size)
            with head_capture(ids[sl]) if head_capture is not None else contextlib.nullcontext():
                out = model(input_ids=ids[sl], attention_mask=mask[sl], position_ids=pos[sl], use_cache=False)
            old_lp.append(response_logprobs(out.logits, toks[sl], P, temperature))
            if out.value is not None:
                old_v.append(out.value[:, P - 1:-1].float())
            del out
            if reference is not None:
                labels = torch.cat([torch.full_like(ids[sl][:, :P], -100), toks[sl]], 1)
                with reference() as ref:
                    lp, _ = sequence_logprobs(ref, ids[sl], mask[sl], labels, chunk_size=logprob_chunk_size,
                                              position_ids=pos[sl], temperature=temperature)
                ref_lp.append(lp[:, P - 1:])
            else:  # kl_penalty_coef = 0: no KL penalty, no reference forward (the KL then reads 0)
                ref_lp.append(old_lp[-1])
            if critic is not None:
                critic.eval()
                old_v.append(critic(input_ids=ids[sl], attention_mask=mask[sl], position_ids=pos[sl]).value[:, P - 1:-1])
                critic.train()
    finally:
        model.train()
    return torch.cat(old_lp), torch.cat(old_v), torch.cat(ref_lp)


def parameter_counts(params) -> tuple[int, int]:
    """(parameters held by this process, all parameters); under ZeRO-3 the first is a shard."""
    params = list(params)
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    return local, sum(getattr(p, "ds_numel", None) or p.numel() for p in params)


def ppo_advantages(cfg, scores: torch.Tensor, eos_missing: torch.Tensor, old_logp: torch.Tensor,
                   ref_logp: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> dict:
    """Per-token rewards and GAE advantages of one rollout batch, all (B, N) fp32 in response space.

    scores (B,) lose `missing_eos_penalty` where no EOS came and are clipped to +-reward_clip;
    r_t = -kl_coef * KL_t plus the score at the last response token (`kl_penalized_rewards`);
    advantages and returns by GAE(gamma, lam), whitened over the mask when `whiten_advantages`.
    Returns the masked old/ref log-probs and values too, as the update and the metrics use them."""
    if cfg.missing_eos_penalty:
        scores = scores - cfg.missing_eos_penalty * eos_missing.float()
    if cfg.reward_clip:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    old_logp, ref_logp = old_logp * mask, ref_logp * mask
    kl = per_token_kl(old_logp, ref_logp, cfg.kl_estimator) * mask
    rewards, non_score = kl_penalized_rewards(scores, kl, mask, kl_coef)
    old_values = old_values.float() * mask
    adv, returns = gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv = whiten(adv, mask)
    return {"scores": scores, "kl": kl, "non_score": non_score, "advantages": adv, "returns": returns,
            "old_logp": old_logp, "ref_logp": ref_logp, "old_values": old_values}


def rollout_stats(exp: dict, raw_scores: torch.Tensor, eos_missing: torch.Tensor, mask: torch.Tensor) -> dict:
    """This process's rollout metrics (TRL's names), scalar tensors, from `ppo_advantages`' result."""
    scores, non_score, returns = exp["scores"], exp["non_score"].sum(-1), exp["returns"]
    return {
        "objective/scores": scores.mean(), "objective/scores_raw": raw_scores.mean(),
        "objective/kl": exp["kl"].sum(-1).mean(), "objective/entropy": (-exp["old_logp"]).sum(-1).mean(),
        "objective/non_score_reward": non_score.mean(), "objective/rlhf_reward": (scores + non_score).mean(),
        "val/explained_variance": torch.tensor(explained_variance(exp["old_values"], returns, mask),
                                               device=scores.device),
        "response_length": mask.sum(-1).mean(), "eos_fraction": 1.0 - eos_missing.float().mean(),
        "val/returns_mean": (returns * mask).sum() / mask.sum().clamp(min=1),
    }


def save_policy(acc, pipeline, tokenizer, out: Path, summary: dict, merged: bool = False) -> None:
    """Write a PPOModel as an HF model directory with its value head beside it (`write_policy`) plus
    `ppo_summary.json`; every process must call it (ZeRO-3 gathers)."""
    state = acc.get_state_dict(pipeline.model)
    if acc.is_main_process:
        write_policy(pipeline.unwrapped_model, state, out, tokenizer, merged=merged)
        (out / "ppo_summary.json").write_text(json.dumps(summary, indent=2))
    acc.wait_for_everyone()
