"""Truncated importance sampling of the rollout/trainer mismatch (rl.algos.mismatch), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algos.mismatch import importance_weights
from rl.algos.policy_losses import grpo_loss

OLD = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
BEH = torch.tensor([[0.0, -1.5, -0.5, 7.0]])  # the last token is padding (mask 0): ignored everywhere
MASK = torch.tensor([[1, 1, 1, 0]])


def test_token_modes_by_hand():
    # old - behaviour = 0, 0.5, -1.5 -> ratios 1, e^0.5 = 1.6487, e^-1.5 = 0.2231; cap 1.5 clips the second
    w, m = importance_weights(OLD, BEH, MASK, cap=1.5, mode="token_truncate")
    assert w.tolist()[0] == pytest.approx([1.0, 1.5, math.exp(-1.5), 0.0], abs=1e-6)
    assert float(m["sampling/sampling_logp_difference/mean"]) == pytest.approx(2.0 / 3, abs=1e-6)
    assert float(m["sampling/sampling_logp_difference/max"]) == pytest.approx(1.5, abs=1e-6)
    assert float(m["sampling/importance_sampling_ratio/clipped_frac"]) == pytest.approx(1.0 / 3, abs=1e-6)
    assert float(m["sampling/importance_sampling_ratio/min"]) == pytest.approx(math.exp(-1.5), abs=1e-6)
    assert float(m["sampling/importance_sampling_ratio/max"]) == pytest.approx(1.5, abs=1e-6)
    w, _ = importance_weights(OLD, BEH, MASK, cap=1.5, mode="token_mask")
    assert w.tolist()[0] == pytest.approx([1.0, 0.0, math.exp(-1.5), 0.0], abs=1e-6)


def test_sequence_modes_by_hand():
    # the sequence's ratio is the product: exp(0 + 0.5 - 1.5) = e^-1 for every token of it
    w, m = importance_weights(OLD, BEH, MASK, cap=1.5, mode="sequence_truncate")
    assert w.tolist()[0] == pytest.approx([math.exp(-1)] * 3 + [0.0], abs=1e-6)
    assert float(m["sampling/importance_sampling_ratio/clipped_frac"]) == 0.0
    w, m = importance_weights(OLD, BEH, MASK, cap=0.3, mode="sequence_mask")  # e^-1 = 0.37 > 0.3: masked
    assert w.abs().sum() == 0 and float(m["sampling/importance_sampling_ratio/clipped_frac"]) == 1.0
    with pytest.raises(ValueError, match="token_truncate"):
        importance_weights(OLD, BEH, MASK, cap=2.0, mode="tis")


def test_the_weights_scale_each_tokens_policy_gradient_term():
    logp = torch.tensor([[-0.5, -1.2, -2.0, 0.0]], requires_grad=True)
    adv = torch.tensor([1.0])
    w = torch.tensor([[1.0, 0.5, 2.0, 0.0]])
    loss_w, _ = grpo_loss(logp, logp.detach(), adv, MASK, token_weights=w)
    (g_w,) = torch.autograd.grad(loss_w, logp)
    loss, _ = grpo_loss(logp, logp.detach(), adv, MASK)
    (g,) = torch.autograd.grad(loss, logp)
    # ratio 1: per-token term -A r_t, token_mean over 3 tokens -> d/dlogp_t = -A w_t / 3
    assert g.tolist()[0] == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 0.0], abs=1e-6)
    assert g_w.tolist()[0] == pytest.approx([-1 / 3, -0.5 / 3, -2 / 3, 0.0], abs=1e-6)
    ones, _ = grpo_loss(logp, logp.detach(), adv, MASK, token_weights=torch.ones_like(w))
    assert float(ones.detach()) == float(loss.detach())


def test_clip_min_and_trls_default_mode_by_hand():
    """TRL 1.16: the default mode is sequence_mask; vllm_importance_sampling_clip_min clamps from below in the
    truncate modes and masks below in the mask modes (IcePop)."""
    import inspect

    assert inspect.signature(importance_weights).parameters["mode"].default == "sequence_mask"
    # ratios 1, e^0.5 = 1.65, e^-1.5 = 0.22; bounds [0.5, 1.5]
    w, m = importance_weights(OLD, BEH, MASK, cap=1.5, mode="token_truncate", clip_min=0.5)
    assert w.tolist()[0] == pytest.approx([1.0, 1.5, 0.5, 0.0], abs=1e-6)
    assert float(m["sampling/importance_sampling_ratio/clipped_frac"]) == pytest.approx(2 / 3, abs=1e-6)
    w, m = importance_weights(OLD, BEH, MASK, cap=1.5, mode="token_mask", clip_min=0.5)
    assert w.tolist()[0] == pytest.approx([1.0, 0.0, 0.0, 0.0], abs=1e-6)
    # sequences: row 0's ratio e^-1 = 0.37; row 1 (old = behaviour) ratio 1; clip_min 0.5 masks row 0 alone
    old, beh = torch.cat([OLD, torch.zeros(1, 4)]), torch.cat([BEH, torch.zeros(1, 4)])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    w, m = importance_weights(old, beh, mask, cap=3.0, mode="sequence_mask", clip_min=0.5)
    assert w.flatten().tolist() == pytest.approx([0.0] * 4 + [1.0, 1.0, 0.0, 0.0], abs=1e-6)
    # per sequence, as TRL: min 0 (row 0 masked), mean (0 + 1) / 2, max 1; half the sequences out of bounds
    assert [float(m[f"sampling/importance_sampling_ratio/{k}"]) for k in ("min", "mean", "max", "clipped_frac")] == \
        pytest.approx([0.0, 0.5, 1.0, 0.5], abs=1e-6)
    w, _ = importance_weights(old, beh, mask, cap=3.0, mode="sequence_truncate", clip_min=0.5)
    assert w.flatten().tolist() == pytest.approx([0.5, 0.5, 0.5, 0.0, 1.0, 1.0, 0.0, 0.0], abs=1e-6)


def test_ppo_policy_loss_scales_each_tokens_term_by_the_correction():
    """PPO's engine loss with a vLLM rollout's weights: on-policy (ratio 1) the gradient of token t's log-prob
    is -A_t w_t / n (token mean over n tokens) instead of -A_t / n; and the weights come from the keys."""
    from types import SimpleNamespace

    from rl.algos.mismatch import rollout_correction
    from rl.trainers.ppo_math import policy_loss, response_logprobs

    P, tokens = 2, torch.tensor([[3, 1, 2, 0]])
    logits = torch.randn(1, P + 4, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = SimpleNamespace(logits=logits, value=None)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5, 0.0]])
    old = response_logprobs(logits, tokens, P).detach()
    w = torch.tensor([[1.0, 0.5, 2.0, 0.0]])
    grads = []
    for weights in (None, w):
        loss, _ = policy_loss(None, None, out, P=P, tokens=tokens, mask=mask, old_logprobs=old, advantages=adv,
                              token_weights=weights)
        (g,) = torch.autograd.grad(loss, logits)
        grads.append(g)
    # the loss is linear in each token's weight at ratio 1: the weighted gradient is the sum of the per-token
    # gradients scaled by w, i.e. the unweighted one for tokens whose w is 1 (token 0) and different elsewhere
    assert torch.allclose(grads[0][0, P - 1], grads[1][0, P - 1])           # token 0: w = 1
    assert torch.allclose(grads[0][0, P] * 0.5, grads[1][0, P], atol=1e-7)  # token 1: w = 0.5
    assert torch.allclose(grads[0][0, P + 1] * 2, grads[1][0, P + 1], atol=1e-7)
    cfg = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_cap=3.0,
                          vllm_importance_sampling_mode="token_truncate")
    got, metrics = rollout_correction(cfg, OLD, BEH, MASK)
    assert got.tolist()[0] == pytest.approx([1.0, math.exp(0.5), math.exp(-1.5), 0.0], abs=1e-6)
    assert set(metrics) >= {"sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/mean"}
    assert rollout_correction(SimpleNamespace(**{**vars(cfg), "vllm_importance_sampling_correction": False}),
                              OLD, BEH, MASK)[0] is None
    assert rollout_correction(SimpleNamespace(use_vllm=False), OLD, BEH, MASK) == (None, {})
