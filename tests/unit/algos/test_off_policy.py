"""The two off-policy corrections of a stale batch (rl.algos.off_policy), by hand, and `behaviour` against TRL
1.16's AsyncGRPOTrainer.compute_loss on the same log-probs."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rl.algos.off_policy import off_policy_terms
from rl.algos.policy_losses import grpo_loss
from rl.trainers.grpo_batch import grpo_loss_fn

e = math.exp
# two sequences, 3 and 2 counted tokens; the padding (mask 0) carries nonsense that must not count
LOGP = [[-1.0, -0.5, -2.0, 0.0], [-0.3, -1.0, 0.0, 0.0]]
BEHAVIOUR = torch.tensor([[-1.2, -0.5, -0.2, 9.0], [-0.6, -0.9, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
A = torch.tensor([1.0, -1.0])  # one advantage per sequence


def _loss(correction: str, cap: float = 5.0):
    logp = torch.tensor(LOGP, requires_grad=True)
    old, weights, metrics = off_policy_terms(correction, logp, BEHAVIOUR, MASK, cap)
    loss, _ = grpo_loss(logp, old, A, MASK, token_weights=weights, epsilon_low=0.2, epsilon_high=0.2,
                        loss_type="dapo")
    loss.backward()
    return float(loss.detach()), logp.grad[MASK.bool()].tolist(), metrics


def test_behaviour_is_the_clipped_ratio_on_the_behaviour_logprobs_by_hand():
    # r = exp(logp - behaviour) = e^0.2, 1, e^-1.8 | e^0.3, e^-0.1; A = +1 then -1; eps 0.2
    # A = +1: -min(r, clip(r, 0.8, 1.2)) = -1.2 (clipped: no gradient), -1, -e^-1.8 (the unclipped is smaller)
    # A = -1: -min(-r, -clip(r)) = e^0.3 (not clipped: the negative branch is unbounded), e^-0.1 (inside)
    loss, grad, metrics = _loss("behaviour")
    assert loss == pytest.approx((-1.2 - 1 - e(-1.8) + e(0.3) + e(-0.1)) / 5, abs=1e-6)
    # d/dlogp of -r A / 5 is -r A / 5 where not clipped
    assert grad == pytest.approx([0.0, -1 / 5, -e(-1.8) / 5, e(0.3) / 5, e(-0.1) / 5], abs=1e-6)
    # sampling/*: the policy being trained against the sampler's log-probs, over counted tokens
    assert float(metrics["sampling/sampling_logp_difference/max"]) == pytest.approx(1.8, abs=1e-6)
    assert float(metrics["sampling/importance_sampling_ratio/max"]) == pytest.approx(e(0.3), abs=1e-6)


def test_decoupled_weights_each_token_by_pi_prox_over_pi_behaviour_and_leaves_out_those_over_the_cap():
    # prox = logp (the current weights, one optimizer step per batch): u = 1, the term is -w A with
    # w = exp(prox - behaviour) = e^0.2, 1, e^-1.8 | e^0.3, e^-0.1, a constant (no gradient through w)
    loss, grad, _ = _loss("decoupled", cap=5.0)
    assert loss == pytest.approx((-e(0.2) - 1 - e(-1.8) + e(0.3) + e(-0.1)) / 5, abs=1e-6)
    assert grad == pytest.approx([-e(0.2) / 5, -1 / 5, -e(-1.8) / 5, e(0.3) / 5, e(-0.1) / 5], abs=1e-6)
    # cap 1.2: e^0.2 = 1.22 and e^0.3 = 1.35 are over it, their tokens leave the loss (AReaL's filter);
    # the divisor stays the 5 counted tokens
    loss, grad, metrics = _loss("decoupled", cap=1.2)
    assert loss == pytest.approx((-1 - e(-1.8) + e(-0.1)) / 5, abs=1e-6)
    assert grad == pytest.approx([0.0, -1 / 5, -e(-1.8) / 5, 0.0, e(-0.1) / 5], abs=1e-6)
    assert float(metrics["sampling/importance_sampling_ratio/clipped_frac"]) == pytest.approx(2 / 5, abs=1e-6)
    with pytest.raises(ValueError, match="behaviour, decoupled"):
        off_policy_terms("tis", torch.tensor(LOGP), BEHAVIOUR, MASK, 5.0)


def test_behaviour_equals_trl_async_grpo_loss_and_gradient():
    """TRL 1.16's AsyncGRPOTrainer.compute_loss (trl.experimental.async_grpo), called on a stand-in trainer and a
    model that returns our log-probs, against grpo_loss_fn with off_policy="behaviour" on the same logits: the
    loss, its gradient in the logits and the clip ratio metrics agree."""
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 7, 11
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :2] = -100  # the prompt
    labels[1, 5:] = -100  # a shorter completion
    logits0 = torch.randn(B, T, V, generator=g)
    mask = labels[:, 1:].ne(-100)
    with torch.no_grad():
        lp = torch.log_softmax(logits0[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    behaviour = (lp + 0.4 * torch.randn(lp.shape, generator=g)).masked_fill(~mask, 0.0)  # an older policy's
    adv = torch.tensor([1.5, -0.7, 0.3])

    ours_logits = logits0.clone().requires_grad_(True)
    loss, metrics = grpo_loss_fn(ours_logits, labels, advantages=adv, behaviour_logprobs=behaviour,
                                 off_policy="behaviour", epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo")
    loss.backward()

    trl_logits = logits0.clone().requires_grad_(True)
    n = int(mask.sum())
    rows = torch.arange(B)[:, None].expand_as(mask)[mask]

    def model(**_):  # TRL's fused head returns the selected tokens' log-probs; ours are the same tokens'
        logp = torch.log_softmax(trl_logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
        return SimpleNamespace(log_probs=logp[mask][None], entropy=torch.zeros(1, n))

    flat = torch.arange(n)[None]
    inputs = {"attention_mask": torch.ones(1, n), "token_index": flat, "input_ids": flat, "position_ids": flat,
              "shift_labels": flat, "old_log_probs": behaviour[mask][None], "advantages": adv[rows][None],
              "segment_id": rows[None], "tree_kv_index": -torch.ones(1, 1), "tree_cu_seqlens_q": -torch.ones(1, 1),
              "tree_cu_seqlens_k": -torch.ones(1, 1), "tree_max_seqlens": torch.tensor([[n, n]]),
              "global_n_tokens": torch.tensor([float(n)]), "global_n_forward_tokens": torch.tensor([float(n)]),
              "mean_seq_len": torch.tensor([n / B])}
    acc = SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x)
    stand_in = SimpleNamespace(epsilon_low=0.2, epsilon_high=0.28, aux_loss_enabled=False, accelerator=acc,
                               current_gradient_accumulation_steps=1, _metrics={"train": defaultdict(list)},
                               _step_forward_tokens=0.0, _step_trained_tokens=0.0, _step_seq_len_weighted=0.0,
                               _step_samples=0.0, _step_forward_s=0.0)
    trl_loss = AsyncGRPOTrainer.compute_loss(stand_in, model, inputs)
    trl_loss.backward()

    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), abs=1e-6)
    assert float((ours_logits.grad - trl_logits.grad).abs().max()) < 1e-7
    assert float(ours_logits.grad.abs().sum()) > 0
    trl_metrics = stand_in._metrics["train"]
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert float(metrics[key]) == pytest.approx(trl_metrics[key][0], abs=1e-6), key
    assert trl_metrics["clip_ratio/region_mean"][0] > 0  # the clip acted somewhere: the comparison can fail
