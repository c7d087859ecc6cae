"""RL losses on sampled tokens: hand-computed values, gradients, normalisation, engine wrappers."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algos.policy_losses import compute_policy_loss, ppo_value_loss
from rl.algos.reduce import NORMALIZATIONS, aggregate
from rl.engine.losses import LOSS_FNS, token_logprobs

LN2, LN4 = math.log(2.0), math.log(4.0)


def importance_sampling_loss(logp, old, adv, mask, normalization="token_mean", **kw):
    return compute_policy_loss(logp, old, adv, mask, loss_type="importance_sampling", normalization=normalization, **kw)


def ppo_policy_loss(logp, old, adv, mask, **kw):
    return compute_policy_loss(logp, old, adv, mask, loss_type="ppo", **kw)


def cispo_clip_loss(logp, old, adv, mask, **kw):
    return compute_policy_loss(logp, old, adv, mask, loss_type="cispo_clip", **kw)


def dro_loss(logp, old, adv, mask, **kw):
    return compute_policy_loss(logp, old, adv, mask, loss_type="dro", **kw)


def _two_tokens():
    # one sequence, two tokens: p = (1/2, 1/4), sampler q = (1/4, 1/4) -> ratio r = (2, 1)
    logp = torch.tensor([[-LN2, -LN4]], requires_grad=True)
    old = torch.tensor([[-LN4, -LN4]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    return logp, old, adv, mask


def test_aggregate_modes():
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0], [7.0, 7.0]])
    m = torch.tensor([[1, 1], [1, 0], [0, 0]])
    assert aggregate(x, m, "sum").item() == pytest.approx(6.0)
    assert aggregate(x, m, "token_mean").item() == pytest.approx(2.0)
    # (1.5 + 3) / 2: the empty third sequence is not counted
    assert aggregate(x, m, "sequence_mean").item() == pytest.approx(2.25)
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(x, m, "mean")


def test_importance_sampling_hand_computed():
    logp, old, adv, mask = _two_tokens()
    # per token -(r * A) = (-2, +1)
    loss, m = importance_sampling_loss(logp, old, adv, mask, "sum")
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert m["policy/ratio_mean"].item() == pytest.approx(1.5, abs=1e-6)
    assert m["policy/approx_kl"].item() == pytest.approx(0.25 * LN2 ** 2, abs=1e-6)
    loss.backward()
    # d/dlogp of -(exp(logp - old) A) = -r A
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, 1.0]]), atol=1e-6)
    loss_mean, _ = importance_sampling_loss(logp, old, adv, mask, "token_mean")
    assert loss_mean.item() == pytest.approx(-0.5, abs=1e-6)


def test_ppo_clip_hand_computed():
    logp, old, adv, mask = _two_tokens()
    # token 1: r=2, A=1 -> min(2, 1.2) = 1.2 (clipped); token 2: r=1, A=-1 -> -1
    loss, m = ppo_policy_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=0.2, normalization="sum")
    assert loss.item() == pytest.approx(-1.2 + 1.0, abs=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 1.0]]), atol=1e-6)  # no gradient when clipped
    # asymmetric: epsilon_high=1.5 leaves r=2 inside [0.8, 2.5]
    loss2, m2 = ppo_policy_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=1.5, normalization="sum")
    assert loss2.item() == pytest.approx(-2.0 + 1.0, abs=1e-6)
    assert m2["policy/clipfrac"].item() == 0.0


def test_ppo_clip_low_with_negative_advantage():
    logp = torch.tensor([[math.log(0.5)]])
    old = torch.zeros(1, 1)  # r = 0.5
    adv = torch.tensor([[-1.0]])
    mask = torch.ones(1, 1)
    # clip_low 0.2: min(-0.5, 0.8 * -1) = -0.8 -> loss 0.8, clipped
    loss, m = ppo_policy_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=0.2, normalization="sum")
    assert loss.item() == pytest.approx(0.8, abs=1e-6) and m["policy/clipfrac"].item() == 1.0
    # clip_low 0.6: r=0.5 is inside [0.4, 1.2] -> loss 0.5, not clipped
    loss, m = ppo_policy_loss(logp, old, adv, mask, epsilon=0.6, epsilon_high=0.2, normalization="sum")
    assert loss.item() == pytest.approx(0.5, abs=1e-6) and m["policy/clipfrac"].item() == 0.0


def test_cispo_hand_computed():
    logp, old, adv, mask = _two_tokens()
    # cispo_clip (Tinker's cispo): weights sg(clip(r, 0.8, 1.2)) = (1.2, 1); per token -w * logp * A
    loss, m = cispo_clip_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=0.2, normalization="sum")
    assert loss.item() == pytest.approx(-1.2 * -LN2 * 1.0 + -1.0 * -LN4 * -1.0, abs=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # the clipped weight is a constant: every token keeps a gradient -w * A (unlike PPO)
    assert torch.allclose(logp.grad, torch.tensor([[-1.2, 1.0]]), atol=1e-6)


def test_dro_hand_computed():
    logp, old, adv, mask = _two_tokens()
    loss, _ = dro_loss(logp, old, adv, mask, dro_beta=0.1, normalization="sum")
    # token 1: -(-ln2 * 1 - 0.05 * ln2^2); token 2: -(-ln4 * -1 - 0)
    expected = (LN2 + 0.05 * LN2 ** 2) + (-LN4)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # d/dlogp = -A + beta (logp - old)
    assert torch.allclose(logp.grad, torch.tensor([[-1.0 + 0.1 * LN2, 1.0]]), atol=1e-6)


def test_value_loss_clipped_hand_computed():
    v = torch.tensor([[1.0, 2.0]])
    old_v = torch.tensor([[1.5, 1.5]])
    ret = torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2)
    # token 1: (1-0)^2 = 1 vs clip 1.3 -> 1.69 (max); token 2: (2-1)^2 = 1 vs clip 1.7 -> 0.49
    loss, m = ppo_value_loss(v, old_v, ret, mask, clip_range_value=0.2)
    assert loss.item() == pytest.approx((0.5 * 1.69 + 0.5 * 1.0) / 2, abs=1e-6)
    assert m["value/clipfrac"].item() == pytest.approx(0.5)
    plain, _ = ppo_value_loss(v, None, ret, mask)
    assert plain.item() == pytest.approx(0.5, abs=1e-6)


def test_per_sequence_advantages_broadcast_and_mask():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = logp.clone()  # r = 1
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # per token -A over counted tokens: (-2, -2) and (+1)
    loss, _ = importance_sampling_loss(logp, old, adv, mask, "sum")
    assert loss.item() == pytest.approx(-3.0)
    loss, _ = importance_sampling_loss(logp, old, adv, mask, "sequence_mean")
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)
    with pytest.raises(ValueError, match="advantages"):
        importance_sampling_loss(logp, old, torch.ones(3), mask)


def _logits_batch(seed=0, B=2, T=6, V=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :2] = -100  # a prompt that is not scored
    return logits, labels


def test_engine_wrappers_match_pure_functions():
    logits, labels = _logits_batch()
    logp, mask = token_logprobs(logits, labels)
    old = (logp.detach() + 0.3 * torch.randn_like(logp)) * mask
    adv = torch.randn_like(logp)
    for name, extra in [
        ("importance_sampling", {}),
        ("ppo", {"epsilon": 0.1, "epsilon_high": 0.3}),
        ("cispo_clip", {"epsilon": 0.1, "epsilon_high": 0.3}),
        ("cispo", {"epsilon_high": 1.1}),
        ("dro", {"dro_beta": 0.2}),
    ]:
        for norm in NORMALIZATIONS:
            length = {"max_length": 7} if norm == "constant" else {}
            got, metrics = LOSS_FNS[name](logits, labels, None, advantages=adv, old_logprobs=old,
                                            normalization=norm, **extra, **length)
            want, _ = compute_policy_loss(logp, old, adv, mask, loss_type=name, normalization=norm, **extra, **length)
            assert got.item() == pytest.approx(want.item(), abs=1e-6), (name, norm)
            assert "loss/policy" in metrics and "policy/approx_kl" in metrics
    # the reference's spelling, and (B, T) tensors aligned with labels
    a, _ = LOSS_FNS["ppo"](logits, labels, None, advantages=adv, old_log_probs=old)
    b, _ = LOSS_FNS["ppo"](logits, labels, None, advantages=torch.cat([adv[:, :1], adv], 1),
                             old_logprobs=torch.cat([old[:, :1], old], 1))
    assert a.item() == pytest.approx(b.item(), abs=1e-6)
    # chunked log-probs give the same loss
    c, _ = LOSS_FNS["ppo"](logits, labels, None, advantages=adv, old_logprobs=old, chunk_size=2)
    assert c.item() == pytest.approx(a.item(), abs=1e-6)


def test_engine_wrapper_errors_are_one_line_and_actionable():
    logits, labels = _logits_batch()
    adv = torch.ones(2)
    with pytest.raises(ValueError, match="old_logprobs"):
        LOSS_FNS["ppo"](logits, labels, None, advantages=adv)
    with pytest.raises(ValueError, match="advantages"):
        LOSS_FNS["cispo"](logits, labels, None, old_logprobs=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="not both"):
        LOSS_FNS["dro"](logits, labels, None, advantages=adv, old_logprobs=torch.zeros(2, 5),
                          old_log_probs=torch.zeros(2, 5))
    with pytest.raises(TypeError, match="epsilon_hgih"):
        LOSS_FNS["ppo"](logits, labels, None, advantages=adv, old_logprobs=torch.zeros(2, 5), epsilon_hgih=0.3)


def test_ppo_engine_value_loss_with_value_predictions():
    logits, labels = _logits_batch()
    logp, mask = token_logprobs(logits, labels)
    old = logp.detach()
    adv = torch.ones_like(logp)
    preds = torch.randn(2, 6, requires_grad=True)  # a value head's (B, T) output
    values, returns = torch.zeros(2, 5), torch.ones(2, 5)
    loss, m = LOSS_FNS["ppo"](logits, labels, None, advantages=adv, old_logprobs=old, values=values,
                                returns=returns, value_preds=preds, vf_coef=0.5, clip_range_value=0.2)
    v_loss, _ = ppo_value_loss(preds[:, :-1], values, returns, mask, 0.2)
    pol, _ = ppo_policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(pol.item() + 0.5 * v_loss.item(), abs=1e-6)
    assert m["loss/value"].item() == pytest.approx(v_loss.item(), abs=1e-6)
    loss.backward()
    assert preds.grad is not None and preds.grad[:, -1].abs().sum() == 0  # last position predicts nothing


def test_weighted_cross_entropy():
    logits, labels = _logits_batch()
    logp, mask = token_logprobs(logits, labels)
    w = torch.rand(2, 5)
    got, _ = LOSS_FNS["cross_entropy"](logits, labels, None, weights=w, normalization="sum")
    assert got.item() == pytest.approx(-(logp * w * mask).sum().item(), abs=1e-5)
    plain, _ = LOSS_FNS["cross_entropy"](logits, labels, None)  # token mean of the NLL (HF's convention)
    assert plain.item() == pytest.approx(-((logp * mask).sum() / mask.sum()).item(), abs=1e-6)
