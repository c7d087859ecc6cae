"""Off-policy corrections for a batch sampled by an older policy (asynchronous rollouts, `max_staleness` > 0):
which log-probs are the loss's old policy, and which weight multiplies each token's term.

Notation (B, N) per token: logp the policy being trained (pi_theta, with gradient), behaviour the log-probs
the sampler recorded for its own tokens (pi_behav: our sampler's, or vLLM's, of the older weights that
sampled the batch), mask 1 on counted tokens. `off_policy_correction` chooses:

    behaviour   TRL 1.16's AsyncGRPO (trl.experimental.async_grpo, `compute_loss`): the behaviour log-probs
                are the old policy, so the clipped ratio is the whole correction, no other weight:
                    loss_t = -min(r A, clip(r, 1 - eps, 1 + eps_high) A),   r = exp(logp - behaviour)
                (AReaL without its decoupled loss is the same.) The engine/trainer mismatch of vLLM is
                inside r, as in TRL's AsyncGRPO.
    decoupled   AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL", sec. 5; `use_decoupled_loss`): a
                proximal policy pi_prox, the weights at the step that trains on the batch, anchors the clip,
                and the behaviour importance weight w = pi_prox / pi_behav corrects for who sampled:
                    loss_t = w_t * -min(u A, clip(u, 1 - eps, 1 + eps_high) A),   u = exp(logp - prox)
                    w_t = exp(prox - behaviour) where it is <= behav_imp_weight_cap, else 0
                (AReaL's cap filters: a token over it leaves the loss, `rl.algos.mismatch`'s token_mask mode).
                AReaL recomputes prox with a no-grad forward of the current weights before its updates. Here
                every batch is one optimizer step (max_staleness needs num_iterations=1), so that forward would
                give the training forward's own log-probs: prox = logp detached, taken from the training
                forward (no second forward). Then u = 1 (its gradient is grad logp) and the gradient is
                w_t A grad logp_t.

A batch of staleness 0 gets neither (the trainer keeps the synchronous loss on it, with vLLM's mismatch
correction where use_vllm). Metrics (TRL's names): sampling/* compare the policy being trained with the
behaviour log-probs on the trained tokens (`rl.algos.mismatch.importance_weights`; its ratio metrics are
the weights applied with decoupled, and the pi_theta / pi_behav the clip sees with behaviour).
"""

from __future__ import annotations

import torch

from rl.algos.mismatch import importance_weights

OFF_POLICY_CORRECTIONS = ("behaviour", "decoupled")


def off_policy_terms(correction: str, logp: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                     behav_imp_weight_cap: float) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(old log-probs for the loss's ratio, (B, N) detached token weights or None, sampling/* metrics) of a
    stale batch under `correction` (module docstring)."""
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"off_policy_correction must be one of {', '.join(OFF_POLICY_CORRECTIONS)}, "
                         f"got {correction!r}")
    prox = logp.detach()
    weights, metrics = importance_weights(prox, behaviour, mask, behav_imp_weight_cap, "token_mask")
    if correction == "behaviour":
        return behaviour, None, metrics
    return prox, weights, metrics
