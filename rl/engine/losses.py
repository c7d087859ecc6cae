"""Token log-probs and the engine's built-in losses (`LOSS_FNS`, the engine signature).

`token_logprobs` is the one log-prob of the labels every loss and trainer uses (from full logits, or
chunk by chunk from a `rl.engine.chunked.HeadLogits`). The RL math itself (policy, value, KL,
preference losses, advantages) lives in `rl.algos`; here each registered policy loss is wrapped into
the engine's signature `(logits, labels, attention_mask, **kwargs) -> (loss, metrics)` under its own
name (`policy_loss_fn`), plus "ppo" with its optional value loss and "cross_entropy" with weights and
an explicit normalization.

Shapes: B = batch, T = sequence length, V = vocabulary. Logits (B, T, V) predict token t+1 at
position t, so every per-token quantity below has length T-1 and is aligned with `labels[:, 1:]`.
Losses return `(scalar_loss, metrics)` where metrics are detached scalars.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from rl import algos
from rl.algos.policy_losses import (
    compute_policy_loss,
    per_token,
    ppo_value_loss,
)
from rl.algos.reduce import aggregate, masked_mean
from rl.engine.chunked import HeadLogits, chunked_token_logprobs

IGNORE_INDEX = -100


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each next token.

    Args:
        logits: (B, T, V) model outputs, or a `rl.engine.chunked.HeadLogits` (the engine's training forward
            above a size threshold): then the LM head runs chunk by chunk, with recomputation in
            backward, and the (B, T, V) logits never exist.
        labels: (B, T) token ids, IGNORE_INDEX (-100) where no loss is wanted.
        chunk_size: if set, the log-softmax is taken over that many positions at a time, so the
            fp32 copy of the logits is never materialised for the whole sequence at once.
    Returns:
        logp (B, T-1) in fp32, zero where masked, and mask (B, T-1) as float (1 = counted).
    """
    if isinstance(logits, HeadLogits):
        return chunked_token_logprobs(logits, labels)
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    safe = target.masked_fill(~mask, 0)
    shifted = logits[:, :-1]
    if chunk_size is None or chunk_size >= shifted.shape[1]:
        logp = _gather_logprobs(shifted, safe)
    else:
        logp = torch.cat([_gather_logprobs(shifted[:, s:s + chunk_size], safe[:, s:s + chunk_size])
                          for s in range(0, shifted.shape[1], chunk_size)], dim=1)
    return logp * mask, mask.float()


def _gather_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # log p(id) = logit[id] - logsumexp(logits): avoids a (B, T, V) log_softmax tensor.
    logits = logits.float()
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# ---------------------------------------------------------------- engine-signature wrappers
# The RL math is in rl.algos (one copy each); every registered policy loss is also an engine loss of
# the same name.
# `(logits, labels, attention_mask, **kw) -> (loss, metrics)`, registered in LOSS_FNS. Per-token
# kwargs are (B, T-1) aligned with labels[:, 1:]; (B, T) aligned with labels is also accepted
# (the first column is dropped) and (B,) is one value per sequence.

def _align(x, labels: torch.Tensor):
    if torch.is_tensor(x) and x.dim() == 2 and x.shape[1] == labels.shape[1]:
        return x[:, 1:]
    return x


def _old(kw: dict, labels: torch.Tensor, logp: torch.Tensor, loss: str) -> torch.Tensor:
    """`old_logprobs` or the reference's `old_log_probs` (one of them, required)."""
    a, b = kw.pop("old_logprobs", None), kw.pop("old_log_probs", None)
    if a is not None and b is not None:
        raise ValueError(f"{loss}: pass old_logprobs or old_log_probs, not both")
    old = a if a is not None else b
    if old is None:
        raise ValueError(f"{loss} needs old_logprobs= (the sampler's per-token log-probs, (B, T-1))")
    return per_token(_align(old, labels), logp, "old_logprobs").detach()


def _no_extra(kw: dict, loss: str) -> None:
    if kw:
        raise TypeError(f"{loss} got unexpected keyword arguments: {', '.join(sorted(kw))}")


# the keyword arguments an engine policy loss takes: compute_policy_loss's hyper-parameters (no reference
# model, no mismatch weights: those belong to a trainer that has them aligned already)
_POLICY_HYPER = set(inspect.signature(compute_policy_loss).parameters) - {
    "logp", "old_logp", "advantages", "mask", "loss_type", "token_weights", "ref_logp", "beta", "use_bias_correction_kl"}


def policy_loss_fn(name: str) -> Callable:
    """The engine loss of the registered policy loss `name` (`rl.algos.policy_losses.compute_policy_loss`):
    kwargs advantages, old_logprobs | old_log_probs, chunk_size, and the loss's hyper-parameters
    (normalization, epsilon, epsilon_high, num_items, max_length, ...)."""
    fn = algos.get("policy_loss", name)

    def loss_fn(logits, labels, attention_mask=None, **kw):
        logp, mask = token_logprobs(logits, labels, chunk_size=kw.pop("chunk_size", None))
        adv = kw.pop("advantages", None)
        if adv is None:
            raise ValueError(f"{name} needs advantages= ((B, T-1) per token or (B,) per sequence)")
        old = _old(kw, labels, logp, name)
        hyper = {k: kw.pop(k) for k in list(kw) if k in _POLICY_HYPER}
        _no_extra(kw, name)
        return compute_policy_loss(logp, old, _align(adv, labels), mask, loss_type=name, **hyper)

    loss_fn.__name__ = f"{name}_loss_fn"
    loss_fn.__doc__ = f"Engine loss {name!r} (`rl.algos` policy loss {fn.__name__}): " + policy_loss_fn.__doc__
    return loss_fn


def ppo_loss_fn(logits, labels, attention_mask=None, **kw):
    """Engine loss "ppo": the "ppo" policy loss's kwargs, plus a value loss when `returns` is given
    with `values` (the rollout's value estimates) and/or `value_preds` (the model's current values,
    with gradient; the engine passes them when the model's output has a `value` field):
    loss = policy + vf_coef * value."""
    values, returns = kw.pop("values", None), kw.pop("returns", None)
    preds = kw.pop("value_preds", None)
    vf_coef, clip_v = kw.pop("vf_coef", 0.1), kw.pop("clip_range_value", 0.2)
    if returns is not None and values is None and preds is None:
        raise ValueError("ppo: returns= was given without values= (or a model that outputs values)")
    norm = kw.get("normalization", "token_mean")
    loss, metrics = _ppo_policy_fn(logits, labels, attention_mask, **kw)
    if returns is None:
        return loss, metrics
    mask = (labels[:, 1:] != IGNORE_INDEX).float()
    old_v = _align(values, labels) if values is not None else None
    new_v = preds
    if new_v is None:
        # No value head in this model: the loss is a constant, reported for monitoring only.
        new_v = per_token(old_v, mask, "values")
        old_v = None
    else:
        new_v = new_v.squeeze(-1) if new_v.dim() == 3 else new_v
        if new_v.shape[1] == mask.shape[1] + 1:
            # a value head's (B, T) output: V at position t scores the state before token t+1,
            # aligned with logits[:, :-1] like the log-probs
            new_v = new_v[:, :-1]
    v_loss, v_metrics = ppo_value_loss(new_v, old_v, _align(returns, labels), mask, clip_v, norm)
    loss = loss + vf_coef * v_loss
    return loss, {**metrics, **v_metrics, "loss/total": loss.detach()}


_ppo_policy_fn = policy_loss_fn("ppo")


def weighted_cross_entropy_loss_fn(logits, labels, attention_mask=None, weights=None,
                                   normalization: str = "token_mean", chunk_size: int | None = None):
    """Engine loss "cross_entropy": -logp * weights over labelled tokens, with the explicit
    normalization and chunked log-probs. `weights` (B, T-1), (B, T) or (B,)."""
    logp, mask = token_logprobs(logits, labels, chunk_size=chunk_size)
    w = per_token(_align(weights, labels), logp, "weights") if weights is not None else 1.0
    loss = aggregate(-logp * w, mask, normalization)
    return loss, {"nll": masked_mean(-logp, mask).detach(), "num_tokens": mask.sum()}


# The engine's losses by name (`forward_backward(..., loss_fn="<name>")`): every registered policy loss, PPO's
# with its value term, and the (weighted) cross-entropy.
LOSS_FNS: dict[str, Callable] = {**{name: policy_loss_fn(name) for name in algos.names("policy_loss")},
                                 "cross_entropy": weighted_cross_entropy_loss_fn, "ppo": ppo_loss_fn}
