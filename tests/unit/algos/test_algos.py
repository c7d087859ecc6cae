"""rl.algos: registries, GAE as a reverse scan (vs the former (B, N, N) form, a naive loop and hand
numbers), exact value/clipfrac, the k2 estimator, aggregation, and GRPO training log-probs equal to the
sampler's on an absolute-position model with left-padded prompts."""

from __future__ import annotations

import math

import pytest
import torch

from rl import algos
from rl.algos import registry
from rl.algos.advantages import compute_advantages, gae
from rl.algos.dapo import groups_with_spread, overlong_penalty
from rl.algos.kl import k2_kl, k3_kl, per_token_kl
from rl.algos.policy_losses import compute_policy_loss, grpo_loss, ppo_value_loss
from rl.algos.preference import preference_loss
from rl.algos.reduce import aggregate
from rl.engine.losses import LOSS_FNS

KINDS = ("advantage_estimator", "policy_loss", "kl_estimator", "preference_loss")


# ------------------------------------------------------------------------------------------ registry

def test_registry_lists_every_kind_and_errors_name_the_valid_choices():
    assert algos.names("advantage_estimator") == ("grpo", "dr_grpo", "grpo_batch", "rloo", "reinforce_pp")
    assert algos.names("policy_loss") == ("ppo", "dapo", "bnpo", "grpo", "dr_grpo", "gspo", "cispo", "cispo_clip",
                                          "sapo", "luspo", "vespo", "importance_sampling", "dro")
    assert algos.names("kl_estimator") == ("k1", "k2", "k3")
    assert algos.names("preference_loss") == ("sigmoid", "ipo", "hinge", "orpo", "simpo")
    with pytest.raises(ValueError) as e:
        algos.get("advantage_estimator", "gpro")
    msg = str(e.value)
    assert msg == ("unknown advantage_estimator 'gpro'; choose one of: grpo, dr_grpo, grpo_batch, rloo, reinforce_pp "
                   "(or give 'package.module:function')")
    assert "\n" not in msg
    with pytest.raises(ValueError, match="unknown registry kind 'advantage'; kinds: .*advantage_estimator"):
        algos.get("advantage", "grpo")
    # the callers' errors are the registry's
    with pytest.raises(ValueError, match="unknown advantage_estimator 'x'; choose one of: grpo"):
        compute_advantages(torch.zeros(4), 2, "x")
    with pytest.raises(ValueError, match="unknown preference_loss 'dpo'; choose one of: sigmoid, ipo"):
        preference_loss("dpo", *[torch.zeros(1)] * 4, torch.ones(1), torch.ones(1), beta=0.1)


def test_registering_twice_is_an_error_and_a_new_estimator_is_one_function(monkeypatch):
    monkeypatch.setitem(registry._TABLES, "advantage_estimator", dict(registry._TABLES["advantage_estimator"]))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("advantage_estimator", "grpo")(lambda rewards, num_generations: rewards)

    @registry.register("advantage_estimator", "raw")
    def raw(rewards, num_generations):
        return rewards * 2

    assert compute_advantages(torch.tensor([1.0, 3.0]), 2, "raw").tolist() == [2.0, 6.0]
    # ... and a valid config value, with no other edit (the config's choices are the registry's names)
    from rl.config.fields import build
    from rl.trainers.grpo_config import GRPOConfig

    assert build(GRPOConfig, {"model_name": "tiny:llama", "advantage_estimator": "raw"}).advantage_estimator == "raw"


def test_every_policy_loss_is_an_engine_loss():
    assert set(algos.names("policy_loss")) <= set(LOSS_FNS)


# ------------------------------------------------------------------------------------------ GAE

def quadratic_gae(rewards, values, mask, gamma, lam):
    """The former rl/ppo.py implementation: one (B, N, N) weighted sum over valid successors."""
    B, N = rewards.shape
    m = mask.to(torch.float64)
    r = rewards.to(torch.float64) * m
    v = values.to(torch.float64) * m
    pos = torch.arange(N)
    idx = torch.where(m > 0, pos.expand(B, N), torch.full_like(pos.expand(B, N), N))
    nxt = torch.cat([idx[:, 1:], torch.full((B, 1), N, dtype=idx.dtype)], dim=1)
    nxt = torch.flip(torch.cummin(torch.flip(nxt, [1]), dim=1).values, [1])
    next_v = torch.cat([v, torch.zeros(B, 1, dtype=v.dtype)], dim=1).gather(1, nxt)
    delta = (r + gamma * next_v - v) * m
    rank = m.cumsum(-1) - 1
    diff = rank[:, None, :] - rank[:, :, None]
    upper = (pos[None, :] >= pos[:, None]).to(m.dtype)
    weights = torch.pow(torch.as_tensor(gamma * lam, dtype=m.dtype), diff.clamp(min=0)) * upper * m[:, None, :]
    adv = torch.einsum("btk,bk->bt", weights, delta) * m
    return adv.to(rewards.dtype), ((adv + v) * m).to(rewards.dtype)


def naive_gae(rewards, values, mask, gamma, lam):
    """Python loop over t per row; masked positions are skipped (value and advantage carried over)."""
    B, N = len(rewards), len(rewards[0])
    adv = [[0.0] * N for _ in range(B)]
    for b in range(B):
        last, next_v = 0.0, 0.0
        for t in reversed(range(N)):
            if not mask[b][t]:
                continue
            last = rewards[b][t] + gamma * next_v - values[b][t] + gamma * lam * last
            adv[b][t] = last
            next_v = values[b][t]
    return torch.tensor(adv, dtype=torch.float64)


def test_gae_hand_computed_with_uneven_lengths_and_a_hole():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 7.0], [0.5, 3.0, 1.0, 0.0], [4.0, 4.0, 4.0, 4.0]])
    values = torch.tensor([[0.5, 1.0, 0.2, 9.0], [1.0, 5.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)  # gamma * lam = 0.25
    # row 0 (3 tokens): A2 = 2 - .2 = 1.8; A1 = 0 + .5*.2 - 1 + .25*1.8 = -.45; A0 = 1 + .5 - .5 + .25*-.45
    # row 1 (hole at t=1, skipped): A3 = 0 - 0 = 0; A2 = 1 + .5*0 - 2 + 0 = -1; A0 = .5 + .5*2 - 1 + .25*-1
    want = torch.tensor([[1.0 - 0.1125, -0.45, 1.8, 0.0], [0.25, 0.0, -1.0, 0.0], [0.0] * 4])
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, (want + values) * mask, atol=1e-6, rtol=0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_scan_equals_former_implementation_and_naive_loop(gamma, lam, dtype):
    g = torch.Generator().manual_seed(1)
    B, N = 7, 40
    rewards = torch.randn(B, N, generator=g).to(dtype)
    values = torch.randn(B, N, generator=g).to(dtype)
    lengths = torch.tensor([40, 1, 0, 23, 39, 7, 16])
    mask = (torch.arange(N)[None] < lengths[:, None]).long()
    mask[3, [0, 5, 6]] = 0  # holes (e.g. an environment's tokens inside a response)
    mask[6, 15] = 0
    adv, ret = gae(rewards, values, mask, gamma, lam)
    q_adv, q_ret = quadratic_gae(rewards, values, mask, gamma, lam)
    assert adv.dtype == dtype
    torch.testing.assert_close(adv, q_adv, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, q_ret, atol=1e-6, rtol=0)
    n_adv = naive_gae(rewards.double().tolist(), values.double().tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv.double(), n_adv, atol=1e-6 if dtype == torch.float32 else 1e-10, rtol=0)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


# ------------------------------------------------------------------------------------------ losses

def test_value_clipfrac_counts_only_clipped_tokens():
    # |v - old| = 0.16 < c = 0.2: nothing is clipped. In fp32, old + (v - old) rounds to a value one ulp
    # away from v whose error to the return is larger, so the former formula counted this token.
    old = torch.tensor([[0.08823567628860474]])
    v = torch.tensor([[-0.07268961519002914]])
    ret, mask, c = torch.tensor([[0.5]]), torch.ones(1, 1), 0.2
    former = old + torch.clamp(v - old, -c, c)
    assert former.item() != v.item() and ((former - ret) ** 2 > (v - ret) ** 2).all()
    loss, m = ppo_value_loss(v, old, ret, mask, clip_range_value=c)
    assert m["value/clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(0.5 * (v.item() - 0.5) ** 2, abs=1e-7)
    # truly clipped tokens still count: v = 1.0 is 0.9 above old, V_clip = old + 0.2 = 0.3;
    # return 0: (0.3)^2 < 1 -> the unclipped error is the max, not counted; return 2: (1.7)^2 > 1 -> counted
    v2, old2 = torch.tensor([[1.0, 1.0]]), torch.tensor([[0.1, 0.1]])
    loss, m = ppo_value_loss(v2, old2, torch.tensor([[0.0, 2.0]]), torch.ones(1, 2), clip_range_value=c)
    assert m["value/clipfrac"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx((0.5 * 1.0 + 0.5 * 1.7 ** 2) / 2, abs=1e-6)


def test_k2_and_k3_estimators():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    torch.testing.assert_close(k2_kl(logp, ref), torch.tensor([[0.125, 0.5, 0.0]]))
    torch.testing.assert_close(per_token_kl(logp, ref, "k2"), k2_kl(logp, ref))
    d = ref - logp
    torch.testing.assert_close(k3_kl(logp, ref), torch.exp(d) - d - 1)
    # expm1 keeps small differences: the exp form loses them to cancellation in fp32
    tiny = torch.tensor([1e-4]), torch.tensor([0.0])
    assert k3_kl(*tiny).item() == pytest.approx(0.5e-8, rel=1e-2)


def test_aggregate_constant_and_num_items():
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    m = torch.tensor([[1, 1], [1, 0]])
    assert aggregate(x, m, "constant", max_length=5).item() == pytest.approx(6.0 / (2 * 5))
    assert aggregate(x, m, "token_mean", num_items=12.0).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="max_length"):
        aggregate(x, m, "constant")


def test_grpo_loss_reuses_the_ppo_surrogate():
    """Without KL and with token_mean, GRPO's loss is the PPO clipped surrogate (one copy of the math)."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g)
    old = logp + 0.4 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    a, _ = grpo_loss(logp, old, adv, mask, epsilon_low=0.1, epsilon_high=0.3)
    b, _ = compute_policy_loss(logp, old, adv, mask, loss_type="ppo", epsilon=0.1, epsilon_high=0.3)
    assert a.item() == pytest.approx(b.item(), abs=1e-7)
    with pytest.raises(ValueError, match="loss_aggregation must be one of token_mean, sequence_mean, constant"):
        grpo_loss(logp, old, adv, mask, loss_aggregation="sum")


def test_gspo_hand_computed_one_ratio_per_sequence():
    """Row 0: log-ratios [ln 2, 0] -> s = exp(ln 2 / 2) = sqrt 2, A = 1: high-clipped, loss -1.28 and no
    gradient. Row 1: one counted token (the padded one's ratio e^4 must not count), s = 0.9, A = -2, inside
    [0.8, 1.28]: loss -(0.9 * -2) = 1.8, gradient -A * s / |y| = 1.8 on its token."""
    logp = torch.tensor([[math.log(0.5), -1.0], [math.log(0.45), 3.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), -1.0], [math.log(0.5), -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, m = compute_policy_loss(logp, old, adv, mask, loss_type="gspo", epsilon=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx((-1.28 + 1.8) / 2, abs=1e-6)  # sequence_mean: the paper's 1/G sum_i
    assert m["policy/clipfrac"].item() == pytest.approx(0.5)
    assert m["policy/seq_ratio_mean"].item() == pytest.approx((math.sqrt(2) + 0.9) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [1.8 / 2, 0.0]]))
    # token_mean weights each sequence by its length: (2 * -1.28 + 1.8) / 3
    loss, _ = compute_policy_loss(logp.detach(), old, adv, mask, loss_type="gspo", epsilon=0.2, epsilon_high=0.28,
                                  normalization="token_mean")
    assert loss.item() == pytest.approx((2 * -1.28 + 1.8) / 3, abs=1e-6)
    # GRPO with importance_sampling_level=sequence is the same loss (one copy of the math); token level is not
    a, g = grpo_loss(logp.detach(), old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                     loss_aggregation="sequence_mean", importance_sampling_level="sequence")
    assert a.item() == pytest.approx((-1.28 + 1.8) / 2, abs=1e-6)
    assert g["clip_ratio/high_mean"].item() == pytest.approx(0.5)  # counted per sequence
    b, _ = grpo_loss(logp.detach(), old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                     loss_aggregation="sequence_mean")
    assert b.item() != pytest.approx(a.item(), abs=1e-3)
    with pytest.raises(ValueError, match="importance_sampling_level must be token or sequence"):
        grpo_loss(logp, old, adv, mask, importance_sampling_level="seq")


def test_overlong_penalty_hand_computed():
    """DAPO eq. 13 with L_max = 10, L_buf = 4: 0 up to 6 tokens, then -1/4 per token, -1 at 10 and beyond."""
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, factor=0.5),
                               torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    assert overlong_penalty(lengths, 10, 0).eq(0).all()  # buffer 0: off
    # the whole budget as buffer: linear from the first token
    torch.testing.assert_close(overlong_penalty(torch.tensor([0, 5, 10]), 10, 10), torch.tensor([0.0, -0.5, -1.0]))


def test_dynamic_sampling_filter_keeps_groups_with_reward_spread():
    nan = float("nan")
    rewards = torch.tensor([1.0, 1.0, 1.0,   0.0, 1.0, 0.0,   nan, 2.0, nan,   nan, 1.0, 2.0,   nan, nan, nan,
                            0.5, 0.5, 0.5 + 1e-9])
    # all equal | spread | one scored (no spread to speak of) | spread among the scored | none scored | equal
    # within float tolerance (the same isclose as frac_reward_zero_std)
    assert groups_with_spread(rewards, 3).tolist() == [False, True, False, True, False, False]
    with pytest.raises(ValueError, match="multiple of num_generations"):
        groups_with_spread(torch.ones(4), 3)


# ------------------------------------------------------------------------------------------ GRPO positions

def test_grpo_training_logprobs_equal_the_samplers_on_gpt2(tmp_path, monkeypatch):
    """Left-padded prompts of different lengths on an absolute-position model (tiny:gpt2): the training
    forward, the old-policy forward (num_iterations=2) and the frozen reference (beta > 0) score the
    sampled tokens as the sampler did, because all of them count positions from each row's first token."""
    from rl.config.fields import build
    from rl.engine.losses import token_logprobs
    from rl.trainers import grpo

    rollouts, seen = [], []
    real_generate, real_loss_fn = grpo.generate, grpo.grpo_loss_fn

    def recording_generate(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        rollouts.append(out)
        return out

    def recording_loss_fn(logits, labels, attention_mask=None, **kw):
        logp, mask = token_logprobs(logits.detach() / kw["temperature"], labels)
        seen.append({"logp": logp, "mask": mask, "old": kw["old_logprobs"], "ref": kw["ref_logprobs"]})
        return real_loss_fn(logits, labels, attention_mask, **kw)

    monkeypatch.setattr(grpo, "generate", recording_generate)  # the name the trainer calls
    monkeypatch.setattr(grpo, "grpo_loss_fn", recording_loss_fn)
    cfg = build(grpo.GRPOConfig, dict(model_name="tiny:gpt2", output_dir=str(tmp_path), learning_rate=1e-3,
                                      per_device_train_batch_size=4, num_generations=2, max_completion_length=5, max_length=40,
                                      max_steps=2, num_iterations=2, beta=0.1, temperature=0.8,
                                      report_to=["none"], dtype="float32", seed=0))
    rows = [{"prompt": "1+1="}, {"prompt": "123456789 + 987654321 + 5 ="}]
    t = grpo.GRPOTrainer(cfg, reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
                         train_prompts=rows)
    # GPT-2's configs default to dropout 0.1, which the training forward (train mode) would add on top
    for module in [*t._model.modules(), *t.reference.model.modules()]:
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    t.train()
    rollout = rollouts[0]
    assert (rollout.prompt_mask == 0).any(), "the prompts must be left-padded for this test to mean anything"
    sampled = rollout.to_batch()["old_logprobs"]
    first = seen[0]  # the first micro-batch, before any optimizer step: policy == sampler == reference
    mask = first["mask"].bool()
    assert mask.sum() >= 4
    for key in ("logp", "old", "ref"):
        diff = (first[key] - sampled).abs()[mask].max().item()
        assert diff < 1e-4, (key, diff)
    # the check can fail: the same forward without the sampler's positions scores the tokens differently
    batch = rollout.to_batch()
    ref_model = t.reference.model
    with torch.no_grad():
        logits = ref_model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    no_pos = token_logprobs(logits / cfg.temperature, batch["labels"])[0]
    assert (no_pos - sampled).abs()[mask].max().item() > 1e-3


def test_grpo_loss_type_dispatches_through_the_one_registry():
    """GRPO's `loss_type` picks the term from the one "policy_loss" registry: "cispo_clip" (the former
    policy_loss=cispo) and "dapo" (the former clip) give the same value and gradient as the registered losses
    called directly (beta 0, token mean), as PPO and the engine call them."""
    torch.manual_seed(0)
    old = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    for name, direct in (("cispo_clip", "cispo_clip"), ("dapo", "ppo")):
        a = (old + 0.3 * torch.randn(3, 5)).requires_grad_(True)
        b = a.detach().clone().requires_grad_(True)
        got, _ = grpo_loss(a, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28, loss_type=name)
        want, _ = compute_policy_loss(b, old, adv[:, None].expand(3, 5), mask, loss_type=direct, epsilon=0.2,
                                      epsilon_high=0.28, normalization="token_mean")
        got.backward()
        want.backward()
        assert got.item() == pytest.approx(want.item(), abs=1e-6), name
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    with pytest.raises(ValueError, match="unknown policy_loss 'nope'"):
        grpo_loss(a, old, adv, mask, loss_type="nope")
