"""rl.algos.policy_losses: every registered policy loss with hand-computed values and gradients, the
aggregations, the objective around the terms, and the engine wrappers."""

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


def test_ppo_two_sided_clip_delta_hand_computed():
    """delta (INTELLECT-2) caps the unclipped ratio: r = 2 with A = -1 gives -min(-2, -1.2) = 2 (PPO's
    unbounded side, gradient -r A = 2); with delta 1.5, -min(-1.5, -1.2) = 1.5 and no gradient (capped)."""
    logp = torch.tensor([[-LN2]], requires_grad=True)
    old, adv, mask = torch.tensor([[-LN4]]), torch.tensor([[-1.0]]), torch.ones(1, 1)
    loss, m = ppo_policy_loss(logp, old, adv, mask, epsilon=0.2)
    assert loss.item() == pytest.approx(2.0, abs=1e-6) and m["policy/clipfrac"].item() == 0.0
    loss.backward()
    assert logp.grad.item() == pytest.approx(2.0, abs=1e-6)
    logp.grad = None
    loss, m = ppo_policy_loss(logp, old, adv, mask, epsilon=0.2, delta=1.5)
    assert loss.item() == pytest.approx(1.5, abs=1e-6) and m["policy/clipfrac"].item() == 0.0
    loss.backward()
    assert logp.grad.item() == 0.0


def test_trl_loss_type_names_are_one_term_with_their_aggregations():
    """On-policy (r = 1) the clipped surrogate is -A per token. Rows: A = 1 on 2 tokens, A = 2 on 1 token, so
    per token (-1, -1 | -2), sum -4: dapo and ppo = -4 / 3 tokens (num_items 8 replaces the 3: -0.5), bnpo
    -4 / 3 whatever num_items says (this micro-batch), grpo = ((-1 - 1) / 2 + -2) / 2 = -1.5 (sequence
    mean), dr_grpo = -4 / (2 rows * max_length 4) = -0.5 with gradient -A / 8 per token."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 2.0])
    want = {"ppo": -4 / 3, "dapo": -4 / 3, "bnpo": -4 / 3, "grpo": -1.5, "dr_grpo": -0.5}
    for name, value in want.items():
        loss, _ = compute_policy_loss(logp, logp.detach(), adv, mask, loss_type=name, max_length=4)
        assert loss.item() == pytest.approx(value, abs=1e-6), name
    for name, value in (("dapo", -0.5), ("ppo", -0.5), ("bnpo", -4 / 3)):
        loss, _ = compute_policy_loss(logp, logp.detach(), adv, mask, loss_type=name, num_items=8.0)
        assert loss.item() == pytest.approx(value, abs=1e-6), name
    lp = logp.clone().requires_grad_(True)
    compute_policy_loss(lp, logp, adv, mask, loss_type="dr_grpo", max_length=4)[0].backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 8, -1 / 8, 0.0], [-2 / 8, 0.0, 0.0]]))
    # an explicit normalization wins over the loss type's own
    loss, _ = compute_policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", normalization="sum")
    assert loss.item() == pytest.approx(-4.0, abs=1e-6)


def test_cispo_trl_caps_the_weight_at_epsilon_high_hand_computed():
    """TRL's cispo: weight sg(min(r, epsilon_high)), no lower clip. r = (2, 1), A = (1, -1), cap 1.5: weights
    (1.5, 1), per token -w A logp = (-1.5 * -ln2, -(-1) * -ln4) = (1.5 ln2, -2 ln2), sum -0.5 ln2, gradient
    -w A = (-1.5, 1); cap 5 (ScaleRL's): weights (2, 1), sum 2 ln2 - 2 ln2 = 0. A ratio of 1/4 stays 1/4
    (cispo_clip would lift it to 1 - epsilon = 0.8): -0.25 * 1 * ln(1/16) = ln2 vs 0.8 * 4 ln2 = 3.2 ln2."""
    logp, old, adv, mask = _two_tokens()
    loss, m = compute_policy_loss(logp, old, adv, mask, loss_type="cispo", epsilon_high=1.5, normalization="sum")
    assert loss.item() == pytest.approx(-0.5 * LN2, abs=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, 1.0]]))
    loss, m = compute_policy_loss(logp, old, adv, mask, loss_type="cispo", epsilon_high=5.0, normalization="sum")
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and m["policy/clipfrac"].item() == 0.0
    low, old_low, one = torch.tensor([[math.log(1 / 16)]]), torch.tensor([[-LN4]]), torch.ones(1, 1)
    loss, _ = compute_policy_loss(low, old_low, one, one, loss_type="cispo", epsilon_high=5.0, normalization="sum")
    assert loss.item() == pytest.approx(LN2, abs=1e-6)
    loss, _ = compute_policy_loss(low, old_low, one, one, loss_type="cispo_clip", epsilon=0.2, normalization="sum")
    assert loss.item() == pytest.approx(3.2 * LN2, abs=1e-6)


def test_sapo_soft_gate_hand_computed():
    """SAPO: -sigmoid(tau (r - 1)) 4 / tau A. Token 1: r = 2, A = 1, tau_pos = 1: -4 sigmoid(1) = -2.9242343;
    token 2: r = 1, A = -1, tau_neg = 1.05: +4 * 0.5 / 1.05 = 1.9047619. Gradient -4 A r s (1 - s) with
    s = sigmoid(tau (r - 1)): token 1 -8 sigmoid(1) (1 - sigmoid(1)) = -1.5728954; token 2 (on-policy) -A = 1."""
    logp, old, adv, mask = _two_tokens()
    loss, m = compute_policy_loss(logp, old, adv, mask, loss_type="sapo", normalization="sum")
    s1 = 1 / (1 + math.exp(-1))
    assert loss.item() == pytest.approx(-4 * s1 + 2 / 1.05, abs=1e-6)
    assert -4 * s1 == pytest.approx(-2.9242343, abs=1e-6)
    assert m["policy/clipfrac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-8 * s1 * (1 - s1), 1.0]]))
    assert logp.grad[0, 0].item() == pytest.approx(-1.5728954, abs=1e-6)


def test_objective_kl_and_token_weights_hand_computed():
    """compute_policy_loss's shared parts. On-policy, A = 0 (no policy term), ref log-ratio d = -0.5 on the
    first token: k3 = e^d - d - 1 = 0.1065307, times beta 0.1, token mean over 2 tokens: 0.0053265.
    token_weights scale the term only: IS with r = (2, 1), A = (1, -1), w = (0.5, 3): -(0.5 * 2 - 3 * 1) = 2."""
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    k3 = math.exp(-0.5) + 0.5 - 1
    loss, m = compute_policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), loss_type="ppo", ref_logp=ref,
                                  beta=0.1)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-7) and m["kl"].item() == pytest.approx(k3 / 2, abs=1e-7)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), beta=0.1)
    lp, old, adv, mask = _two_tokens()
    loss, _ = compute_policy_loss(lp, old, adv, mask, loss_type="importance_sampling", normalization="sum",
                                  token_weights=torch.tensor([[0.5, 3.0]]))
    assert loss.item() == pytest.approx(2.0, abs=1e-6)


def test_ppo_default_is_bit_identical_to_the_former_formula():
    """The PPO trainer's default (loss_type ppo, epsilon = epsilon_high = clip_ratio, token mean) computes
    exactly the former ppo_policy_loss: value and gradient equal to the bit (torch.equal, not a tolerance)."""
    g = torch.Generator().manual_seed(3)
    base = -torch.rand(4, 6, generator=g) * 2
    old = base + 0.4 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.25).float()
    a, b = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    ratio = torch.exp(a - old)  # the former formula, verbatim
    former = aggregate(-torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv), mask, "token_mean")
    former.backward()
    now, m = compute_policy_loss(b, old, adv, mask, loss_type="ppo", epsilon=0.2)
    now.backward()
    assert torch.equal(now.detach(), former.detach()) and torch.equal(a.grad, b.grad)
    assert 0 < m["policy/clipfrac"].item() < 1  # the clip was exercised


def test_a_users_loss_is_one_function_with_the_term_signature():
    """A `package.module:function` loss_type gets the same objective around it (here: plain -A logp, REINFORCE)."""
    import sys
    import types

    from rl.algos.policy_losses import Term

    mod = types.ModuleType("my_losses_for_test")

    def reinforce(logp, old_logp, advantages, mask, p):
        return Term(-advantages * logp, torch.exp(logp - old_logp), torch.zeros_like(logp, dtype=torch.bool))

    mod.reinforce = reinforce
    sys.modules["my_losses_for_test"] = mod
    try:
        logp, old, adv, mask = _two_tokens()
        loss, m = compute_policy_loss(logp, old, adv, mask, loss_type="my_losses_for_test:reinforce",
                                      normalization="sum")
        # -(1 * -ln2) - (-1 * -ln4) = ln2 - 2 ln2
        assert loss.item() == pytest.approx(-LN2, abs=1e-6) and "policy/approx_kl" in m
    finally:
        del sys.modules["my_losses_for_test"]


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
