"""GRPO family: advantages and loss against hand-computed numbers and against TRL 1.16's own code
(GRPOTrainer._compute_loss run on identical log-probs; the advantage formulas of its
_generate_and_score_completions / RLOOTrainer, replicated from the source), reward plumbing, config errors,
and a short single-process run that learns a rewarded pattern."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

from rl.algos.advantages import (
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rl.algos.kl import k3_kl
from rl.algos.policy_losses import compute_policy_loss, grpo_loss
from rl.config.fields import build
from rl.errors import ConfigError
from rl.trainers.grpo import GRPOTrainer
from rl.trainers.grpo_config import GRPOConfig
from rl.trainers.rewards import (
    FunctionReward,
    RewardError,
    WeightedSum,
    combine_rewards,
)
from tests.conftest import LEARN_SEED, learned

NAN = float("nan")


# ------------------------------------------------------------------------------- hand-computed

def test_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    s = math.sqrt(1 / 3)  # Bessel-corrected std of [1, 0, 0, 1]
    want = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    torch.testing.assert_close(dr_grpo_advantages(r, 4), want)
    torch.testing.assert_close(grpo_advantages(r, 4), want / torch.tensor([s] * 4 + [1.0] * 4).add(1e-4)
                               * torch.tensor([1.0] * 4 + [0.0] * 4))
    # leave-one-out: 1 - (0 + 0 + 1) / 3 = 2/3; 0 - 2/3
    torch.testing.assert_close(rloo_advantages(r, 4), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))
    # REINFORCE++-baseline: centred [.5,-.5,-.5,.5,0,0,0,0], batch std sqrt(1/7)
    torch.testing.assert_close(reinforce_pp_advantages(r, 4), want / (math.sqrt(1 / 7) + 1e-4))


def test_advantages_none_rewards_are_left_out():
    r = torch.tensor([1.0, NAN, 0.0, 2.0])  # group of 4 with one unscored completion
    a = dr_grpo_advantages(r, 4)
    torch.testing.assert_close(a, torch.tensor([0.0, 0.0, -1.0, 1.0]))
    torch.testing.assert_close(rloo_advantages(r, 4), torch.tensor([1 - 1.0, 0.0, 0 - 1.5, 2 - 0.5]))
    with pytest.raises(ValueError, match="multiple of num_generations"):
        compute_advantages(torch.ones(5), 4)
    with pytest.raises(ValueError, match="unknown advantage_estimator"):
        compute_advantages(torch.ones(4), 4, "ppo")


def test_combine_rewards_weights_and_none():
    per = torch.tensor([[1.0, 0.5], [NAN, 1.0], [NAN, NAN]])
    torch.testing.assert_close(combine_rewards(per, [2.0, 1.0])[:2], torch.tensor([2.5, 1.0]))
    assert math.isnan(float(combine_rewards(per, [2.0, 1.0])[2]))


def test_loss_hand_computed_clip_and_aggregations():
    logp = torch.tensor([[math.log(0.5), math.log(0.9), 0.0], [math.log(0.2), 0.0, 0.0]])
    old = torch.tensor([[math.log(0.25), math.log(0.9), 0.0], [math.log(0.4), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    # ratios: row0 [2, 1], row1 [0.5]; eps_low 0.2, eps_high 0.28
    # row0 t0: min(2*1, 1.28*1) = 1.28 -> -1.28 (high-clipped); t1: -1
    # row1 t0: min(0.5*-2, 0.8*-2) = -1.6 -> +1.6 (low-clipped)
    per = [-1.28, -1.0, 1.6]
    kw = dict(epsilon_low=0.2, epsilon_high=0.28)
    loss, m = grpo_loss(logp, old, adv, mask, loss_aggregation="token_mean", **kw)
    assert loss.item() == pytest.approx(sum(per) / 3, abs=1e-6)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)
    assert m["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert m["clip_ratio/region_mean"].item() == pytest.approx(2 / 3)
    loss, _ = grpo_loss(logp, old, adv, mask, loss_aggregation="sequence_mean", **kw)
    assert loss.item() == pytest.approx(((-1.28 - 1.0) / 2 + 1.6) / 2, abs=1e-6)
    loss, _ = grpo_loss(logp, old, adv, mask, loss_aggregation="constant", max_completion_length=4, **kw)
    assert loss.item() == pytest.approx(sum(per) / (2 * 4), abs=1e-6)
    loss, _ = grpo_loss(logp, old, adv, mask, loss_aggregation="token_mean", num_items=6.0, **kw)
    assert loss.item() == pytest.approx(sum(per) / 6, abs=1e-6)


def test_k3_kl_term_and_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    d = -0.5
    k3 = math.exp(d) - d - 1
    assert k3_kl(logp, ref)[0, 1].item() == 0.0
    loss, m = grpo_loss(logp, logp.detach(), torch.zeros(1), mask, ref_logp=ref, beta=0.1,
                        use_bias_correction_kl=False)
    assert m["kl"].item() == pytest.approx(k3 / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-6)
    loss.backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    assert logp.grad[0, 0].item() == pytest.approx(0.1 * (1 - math.exp(d)) / 2, abs=1e-6)
    # with the ratio factor (on-policy: value 1) the gradient gains k3 * d(ratio)/dlogp = k3
    lp2 = logp.detach().clone().requires_grad_(True)
    grpo_loss(lp2, lp2.detach(), torch.zeros(1), mask, ref_logp=ref, beta=0.1)[0].backward()
    assert lp2.grad[0, 0].item() == pytest.approx(0.1 * (1 - math.exp(d) + k3) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp, torch.zeros(1), mask, beta=0.1)


# ------------------------------------------------------------------------------- TRL 1.16

def _trl_advantages(rewards_per_func, weights, G, scale_rewards):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, sum_then_normalize branch (verbatim logic)."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean_grouped = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale_rewards in ("group", "none"):
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean_grouped
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(adv, nan=0.0), is_std_zero


def _trl_rloo_advantages(rewards, G):
    """TRL 1.16 RLOOTrainer leave-one-out baseline (normalize_advantages=False)."""
    grouped = rewards.view(-1, G)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    return torch.nan_to_num(rewards - baselines, nan=0.0)


def test_advantages_match_trl():
    g = torch.Generator().manual_seed(0)
    G = 4
    per_func = torch.randint(0, 3, (24, 2), generator=g).float()
    per_func[3, 0] = NAN  # a function returned None
    per_func[7] = NAN  # nobody scored this completion
    per_func[8:12] = 1.0  # a zero-variance group
    w = torch.tensor([1.0, 0.5])
    rewards = combine_rewards(per_func, w)
    want, zero = _trl_advantages(per_func, w, G, "group")
    torch.testing.assert_close(compute_advantages(rewards, G, "grpo"), want)
    assert zero[8:12].all() and zero.sum() == 4
    want, _ = _trl_advantages(per_func, w, G, "none")
    torch.testing.assert_close(compute_advantages(rewards, G, "dr_grpo"), want)
    torch.testing.assert_close(compute_advantages(rewards, G, "rloo"), _trl_rloo_advantages(rewards, G))


class _FakeAccelerator:
    num_processes = 1
    sync_gradients = True

    def reduce(self, t, reduction="sum"):
        return t

    def gather(self, t):
        return t

    def gather_for_metrics(self, t):
        return t


def _loss_inputs(seed: int, B: int, noise: float):
    """Per-token log-probs of B completions of 5 tokens (rows 0 and 4 shorter), old ones `noise` away from them,
    a reference 0.2 away, and one advantage per completion: the inputs of the TRL loss cross-checks."""
    g = torch.Generator().manual_seed(seed)
    base = -torch.rand(B, 5, generator=g) * 2
    old = base + noise * torch.randn(B, 5, generator=g)
    ref = base + 0.2 * torch.randn(B, 5, generator=g)
    mask = torch.ones(B, 5)
    mask[0, 3:] = 0
    mask[4, 1:] = 0
    return base, old, ref, mask, torch.randn(B, generator=g)


def _trl_loss(loss_type, logp, old, ref, adv, mask, beta, eps_low, eps_high, max_len, bias_kl, level="token",
              is_ratio=None, **args_kw):
    """Run TRL 1.16's GRPOTrainer._compute_loss on given per-token log-probs (no model); `is_ratio` (B, N): the
    vLLM importance-sampling ratios (TRL's use_vllm path), `args_kw` more GRPOConfig keys (delta, vespo_*)."""
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    # activation_checkpointing off by its current name: TRL's default (on) goes through a deprecated alias
    args = TRLConfig(output_dir="/tmp/trl-unused", bf16=False, activation_checkpointing=False, beta=beta,
                     epsilon=eps_low, epsilon_high=eps_high, loss_type=loss_type, max_completion_length=max_len, report_to=[],
                     use_bias_correction_kl=bias_kl, importance_sampling_level=level, **args_kw)
    fake = types.SimpleNamespace(
        args=args, loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
        max_completion_length=max_len, importance_sampling_level=level, off_policy_mask_threshold=None,
        top_entropy_quantile=1.0, use_vllm=is_ratio is not None, vllm_importance_sampling_correction=True,
        aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, accelerator=_FakeAccelerator(),
        model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)})
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    fake.get_gamma_weights = TRLTrainer.get_gamma_weights
    B, N = logp.shape
    inputs = {"prompt_ids": torch.ones(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.ones(B, N, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = TRLTrainer._compute_loss(fake, None, inputs)
    return loss, fake._metrics["train"]


@pytest.mark.parametrize("ours,theirs", [("sequence_mean", "grpo"), ("constant", "dr_grpo"), ("token_mean", "dapo")])
@pytest.mark.parametrize("beta,bias_kl", [(0.0, True), (0.04, True), (0.04, False)])
def test_loss_and_gradient_match_trl(ours, theirs, beta, bias_kl):
    base, old, ref, mask, adv = _loss_inputs(seed=1, B=6, noise=0.3)  # ratios well outside [0.8, 1.28]
    L = 7
    lp_ours = base.clone().requires_grad_(True)
    loss, m = grpo_loss(lp_ours, old, adv, mask, ref_logp=ref, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                        loss_aggregation=ours, max_completion_length=L, use_bias_correction_kl=bias_kl)
    loss.backward()
    lp_trl = base.clone().requires_grad_(True)
    trl_loss, trl_m = _trl_loss(theirs, lp_trl, old, ref, adv, mask, beta, 0.2, 0.28, L, bias_kl)
    trl_loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp_ours.grad, lp_trl.grad, rtol=1e-5, atol=1e-7)
    for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert m[k].item() == pytest.approx(trl_m[k][0], abs=1e-6)
    assert m["clip_ratio/region_mean"].item() > 0  # the clip really was exercised
    if beta:
        assert m["kl"].item() == pytest.approx(trl_m["kl"][0], rel=1e-5)


@pytest.mark.parametrize("ours,theirs", [("sequence_mean", "grpo"), ("constant", "dr_grpo"), ("token_mean", "dapo")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_loss_and_gradient_match_trl_sequence_level(ours, theirs, beta):
    """GSPO: TRL 1.16's importance_sampling_level="sequence" on identical inputs, loss, gradient and clip
    metrics to 1e-6 (the KL factor is the sequence ratio there too). Per-token noise 0.6 spreads the
    sequence ratios well beyond the 0.05/0.08 clip range, so clipping is exercised."""
    base, old, ref, mask, adv = _loss_inputs(seed=2, B=8, noise=0.6)
    L = 7
    lp_ours = base.clone().requires_grad_(True)
    loss, m = grpo_loss(lp_ours, old, adv, mask, ref_logp=ref, beta=beta, epsilon_low=0.05, epsilon_high=0.08,
                        loss_aggregation=ours, max_completion_length=L, importance_sampling_level="sequence")
    loss.backward()
    lp_trl = base.clone().requires_grad_(True)
    trl_loss, trl_m = _trl_loss(theirs, lp_trl, old, ref, adv, mask, beta, 0.05, 0.08, L, True, "sequence")
    trl_loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_trl.grad, rtol=1e-6, atol=1e-6)
    for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert m[k].item() == pytest.approx(trl_m[k][0], abs=1e-6)
    assert 0 < m["clip_ratio/region_mean"].item() < 1  # some sequences clipped, some not
    if beta:
        assert m["kl"].item() == pytest.approx(trl_m["kl"][0], rel=1e-6)
    # the registered policy loss "gspo" is the same math (no KL): equal to GRPO's sequence level at beta 0
    if not beta:
        lp = base.clone().requires_grad_(True)
        gl, _ = compute_policy_loss(lp, old, adv, mask, loss_type="gspo", epsilon=0.05, epsilon_high=0.08,
                                    normalization=ours, max_length=L)
        assert gl.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_type_by_trls_name_matches_trl(loss_type, beta):
    """GRPO's `loss_type` with TRL 1.16's names and meanings: each name alone (no loss_aggregation) gives TRL's
    loss and gradient on identical inputs, the aggregation included (grpo: sequence mean, bnpo: this batch's
    token mean, dr_grpo: / max_completion_length, dapo and cispo: the step's token mean). cispo's epsilon_high
    is TRL's cap on the weight (1.3 clips some ratios here)."""
    base, old, ref, mask, adv = _loss_inputs(seed=3, B=6, noise=0.3)
    L = 7
    eps_high = 1.3 if loss_type == "cispo" else 0.28
    lp_ours = base.clone().requires_grad_(True)
    loss, m = grpo_loss(lp_ours, old, adv, mask, ref_logp=ref, beta=beta, epsilon_low=0.2, epsilon_high=eps_high,
                        max_completion_length=L, loss_type=loss_type)
    loss.backward()
    lp_trl = base.clone().requires_grad_(True)
    trl_loss, trl_m = _trl_loss(loss_type, lp_trl, old, ref, adv, mask, beta, 0.2, eps_high, L, True)
    trl_loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_trl.grad, rtol=1e-6, atol=1e-6)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert m[k].item() == pytest.approx(trl_m[k][0], abs=1e-6)
    if beta:
        assert m["kl"].item() == pytest.approx(trl_m["kl"][0], rel=1e-6)
    if loss_type == "cispo":  # the cap acted: the loss differs from the uncapped weight's
        capped = (torch.exp(base - old) > eps_high) & (mask > 0)
        assert capped.any()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta,delta", [(0.0, None), (0.04, 1.5)])
def test_luspo_matches_trl(level, beta, delta):
    """TRL 1.16's loss_type="luspo" (the clipped surrogate summed per sequence, averaged over sequences) on
    identical inputs, at both importance-sampling levels, with the KL term and the two-sided clip delta."""
    base, old, ref, mask, adv = _loss_inputs(seed=4, B=6, noise=0.3)
    lp_ours = base.clone().requires_grad_(True)
    loss, m = grpo_loss(lp_ours, old, adv, mask, ref_logp=ref, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                        max_completion_length=7, loss_type="luspo", importance_sampling_level=level, delta=delta)
    loss.backward()
    lp_trl = base.clone().requires_grad_(True)
    trl_loss, trl_m = _trl_loss("luspo", lp_trl, old, ref, adv, mask, beta, 0.2, 0.28, 7, True, level, delta=delta)
    trl_loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_trl.grad, rtol=1e-6, atol=1e-6)
    assert m["clip_ratio/region_mean"].item() == pytest.approx(trl_m["clip_ratio/region_mean"][0], abs=1e-6)
    # summed per sequence: a sequence of 5 tokens weighs 5 times one of 1 token (sequence_mean would weigh them alike)
    assert loss.item() != pytest.approx(grpo_loss(base, old, adv, mask, ref_logp=ref, beta=beta, loss_type="grpo",
                                                  importance_sampling_level=level, delta=delta)[0].item(), rel=1e-3)


@pytest.mark.parametrize("with_vllm", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_vespo_matches_trl(with_vllm, beta):
    """TRL 1.16's loss_type="vespo" (GRPOTrainer.get_gamma_weights: the gamma weight phi(w) of the sequence's
    importance weight, detached, times A logp) on identical inputs, non-default k/lambda, with TRL's vLLM ratios
    folded into w (token_mask: some weights 0) rather than multiplied onto the loss. No padding in the
    completions: TRL's ratio there is 1, ours 0 (the mask drops it)."""
    g = torch.Generator().manual_seed(5)
    B, N = 6, 5
    base = -torch.rand(B, N, generator=g) * 2
    old = base + 0.15 * torch.randn(B, N, generator=g)
    ref = base + 0.2 * torch.randn(B, N, generator=g)
    mask, adv = torch.ones(B, N), torch.randn(B, generator=g)
    is_ratio = torch.exp(0.3 * torch.randn(B, N, generator=g)) if with_vllm else None
    if with_vllm:
        is_ratio[0, 1] = 0.0  # token_mask dropped this token
    kw = dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)
    lp_ours = base.clone().requires_grad_(True)
    loss, m = grpo_loss(lp_ours, old, adv, mask, ref_logp=ref, beta=beta, max_completion_length=7, loss_type="vespo",
                        token_weights=is_ratio, **kw)
    loss.backward()
    lp_trl = base.clone().requires_grad_(True)
    trl_loss, trl_m = _trl_loss("vespo", lp_trl, old, ref, adv, mask, beta, 0.2, 0.2, 7, True, is_ratio=is_ratio, **kw)
    trl_loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_trl.grad, rtol=1e-6, atol=1e-6)
    if beta:
        assert m["kl"].item() == pytest.approx(trl_m["kl"][0], rel=1e-6)
    # the weights matter: with k = 0 and lambda -> 0, phi -> 1 and VESPO is the plain policy gradient -A logp
    flat = grpo_loss(base, old, adv, mask, loss_type="vespo", vespo_k_pos=0.0, vespo_k_neg=0.0,
                     vespo_lambda_pos=1e-4, vespo_lambda_neg=1e-4)[0]
    assert flat.item() == pytest.approx(-(adv[:, None] * base).mean().item(), rel=1e-3)
    assert loss.item() != pytest.approx(flat.item(), rel=1e-2)


def test_loss_type_config_resolves_aggregation_and_the_former_policy_loss():
    """loss_aggregation null takes the loss type's own (TRL's meaning); an explicit one wins; the former
    policy_loss=cispo is loss_type=cispo_clip, policy_loss=clip keeps the clipped surrogate; unknown names
    are one-line errors naming the key."""
    base = dict(model_name="tiny:llama", per_device_train_batch_size=4, num_generations=2)
    assert build(GRPOConfig, base).loss_type == "dapo"  # TRL's default
    assert build(GRPOConfig, base).loss_aggregation == "token_mean"  # today's default, unchanged
    for name, agg in (("grpo", "sequence_mean"), ("dr_grpo", "constant"), ("bnpo", "token_mean"), ("cispo", "token_mean")):
        assert build(GRPOConfig, {**base, "loss_type": name}).loss_aggregation == agg
    assert build(GRPOConfig, {**base, "loss_type": "grpo", "loss_aggregation": "token_mean"}).loss_aggregation == "token_mean"
    cfg = build(GRPOConfig, {**base, "policy_loss": "cispo"})
    assert (cfg.loss_type, cfg.policy_loss) == ("cispo_clip", None)
    assert build(GRPOConfig, {**base, "policy_loss": "clip", "loss_type": "grpo"}).loss_type == "grpo"
    with pytest.raises(ConfigError, match="key 'loss_type' has unknown value 'gpro' .did you mean grpo or gspo..; choose one "
                                          "of: ppo, dapo"):
        build(GRPOConfig, {**base, "loss_type": "gpro"})
    with pytest.raises(ConfigError, match="key 'policy_loss' is replaced by loss_type"):
        build(GRPOConfig, {**base, "policy_loss": "nope"})


# ------------------------------------------------------------------------------- rewards, config

def test_reward_signatures_and_errors():
    def trl_style(prompts, completions, answer, **kw):
        return [1.0 if c == a else None for c, a in zip(completions, answer)]

    def ours(prompts, responses, metadata=None):
        return [float(len(r)) for r in responses]

    per, _ = WeightedSum([FunctionReward(trl_style, "a"), FunctionReward(ours, "b")]).score_each(
        ["p", "p"], ["7", "8"], {"answer": ["7", "7"]})
    assert per[0, 0] == 1.0 and math.isnan(per[1, 0]) and per[:, 1].tolist() == [1.0, 1.0]
    with pytest.raises(RewardError, match="'bad' returned 1 values for 2"):
        FunctionReward(lambda prompts, completions, **kw: [1.0], "bad")(["p", "p"], ["a", "b"], {})


def test_config_errors(tiny_llama):
    base = {"model_name": tiny_llama}
    with pytest.raises(ConfigError, match="multiple of num_generations=3"):
        build(GRPOConfig, {**base, "per_device_train_batch_size": 4, "num_generations": 3})
    with pytest.raises(ConfigError, match="at least 2"):
        build(GRPOConfig, {**base, "num_generations": 1})
    with pytest.raises(ConfigError, match="loss_aggregation"):
        build(GRPOConfig, {**base, "loss_aggregation": "sum"})
    with pytest.raises(ConfigError, match="'overlong_buffer' must be between 0 and max_completion_length=64, got 65"):
        build(GRPOConfig, {**base, "overlong_buffer": 65})
    with pytest.raises(ConfigError, match="'max_sampling_rounds' must be at least 1"):
        build(GRPOConfig, {**base, "dynamic_sampling": True, "max_sampling_rounds": 0})
    with pytest.raises(ConfigError, match="importance_sampling_level"):
        build(GRPOConfig, {**base, "importance_sampling_level": "seq"})
    with pytest.raises(ConfigError, match="reward_weights has 1 entries but there are 2 reward sources"):
        GRPOTrainer(build(GRPOConfig, {**base, "env_type": "math", "reward_funcs": ["correctness"],
                                       "reward_weights": [1.0], "report_to": ["none"]}))
    with pytest.raises(ConfigError, match="unknown reward function 'nope'"):
        GRPOTrainer(build(GRPOConfig, {**base, "env_type": "math", "reward_funcs": ["nope"], "report_to": ["none"]}))
    cfg = build(GRPOConfig, {**base, "rl_env_type": "math", "kl_coef": 0.1})  # the reference's key names
    assert cfg.env_type == "math" and cfg.beta == 0.1
    with pytest.raises(ConfigError, match="no reward source"):
        GRPOTrainer(build(GRPOConfig, {**base, "report_to": ["none"]}), train_prompts=[{"prompt": "1+1="}])


# ------------------------------------------------------------------------------- training

def test_beta_zero_loads_no_reference_and_learns(tiny_llama, tmp_path):
    """A rewarded first character becomes the common one within a few steps; beta = 0 -> no reference.
    It learns: the mean reward of the last 3 steps exceeds that of the first 3 by 0.2. The reward is a
    digit first (10 of the tiny vocabulary's tokens, ~3% of first tokens at the start), not one digit
    (~0.3%: a group of 8 then rarely holds a rewarded sample, and one seed of 4 learned nothing in 16
    steps). Spread (bench/learning_spread.py -k beta_zero, 1 thread, seeds 0-3): gain 0.917 to 0.943, so
    the 0.2 bar has a margin of 0.7."""

    def starts_with_seven(prompts, completions, **kw):
        return [1.0 if c[:1].isdigit() else 0.0 for c in completions]

    cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path), learning_rate=1e-2,
                                 lr_scheduler_type="constant", per_device_train_batch_size=32, gradient_accumulation_steps=2,
                                 num_generations=8, max_completion_length=3, max_length=12, max_steps=16,
                                 report_to=["jsonl"], seed=LEARN_SEED))
    rows = [{"prompt": f"{a}+{b}="} for a in range(10) for b in range(10)]
    t = GRPOTrainer(cfg, reward_funcs=[starts_with_seven], train_prompts=rows)
    assert t.reference.mode == "none"
    h = t.train()
    assert t.reference.model is None
    assert len(h) == 16 and {"reward", "reward_std", "frac_reward_zero_std", "num_zero_std_groups",
                             "completions/mean_length", "clip_ratio/region_mean", "loss"} <= set(h[0])
    first, last = sum(r["reward"] for r in h[:3]) / 3, sum(r["reward"] for r in h[-3:]) / 3
    assert learned("grpo_reward_gain", last - first) > 0.2, (first, last)
    assert (tmp_path / "metrics.png").exists()


def test_environment_reward_source_with_reference(tiny_llama, tmp_path):
    """env_type=math supplies prompts and rewards (components logged); beta > 0 builds a reference and
    reports kl; the evaluation runs greedy decoding on the held-out split."""
    cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path), learning_rate=1e-3,
                                 per_device_train_batch_size=8, num_generations=4, max_completion_length=3, max_length=16,
                                 max_steps=2, beta=0.05, num_iterations=2, env_type="math",
                                 env_config={"difficulty": "tiny", "split": "train"},
                                 eval_env_config={"split": "test"}, eval_num_prompts=8,
                                 advantage_estimator="rloo", loss_aggregation="constant", report_to=["none"],
                                 reward_weights=[1.0, 0.1]))

    def content(prompts, completions, answer, **kw):  # TRL signature; 'answer' is an environment column
        # A value that differs between distinct completions, so every group has reward spread and the
        # first update moves the policy (a length reward is constant when all 3-token samples run to the
        # limit, and then kl stays exactly 0 at step 2: seen as a risk across CPUs).
        assert len(answer) == len(completions)
        return [float(sum(c.encode("utf-8", "replace")) % 101) for c in completions]

    t = GRPOTrainer(cfg, reward_funcs=[content])
    h = t.train()
    assert t.reference.mode == "copy" and t.reference.model is not None
    rows = [r for r in h if "reward" in r]
    assert len(rows) == 2 and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl"] > 0
    assert "rewards/correctness/mean" in rows[0] and "rewards/formatting/mean" in rows[0]
    assert "rewards/content/mean" in rows[0] and "rewards/env/mean" in rows[0]
    assert h[0]["eval/num_prompts"] == 8 and 0.0 <= h[-1]["eval/accuracy"] <= 1.0


def test_chunked_scoring_changes_nothing(tiny_llama, tmp_path, monkeypatch):
    """logprob_chunk_size on the old-policy and reference forwards (beta > 0, num_iterations = 2) and on
    the training forward: the same metrics as the full (B, T, V) logits, so it is a pure memory saving.
    Off-policy with a KL term, each generation runs two scoring forwards (old policy, reference); the
    skips at num_iterations = 1 and beta = 0 are in tests/unit/trainers/test_skips.py."""
    from rl.trainers import grpo
    from tests.unit.trainers.test_skips import _count_scoring

    calls = _count_scoring(monkeypatch, grpo)

    def run(chunk, out):
        cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8,
                                     num_generations=4, max_completion_length=4, max_length=16, max_steps=2,
                                     num_iterations=2, beta=0.1, report_to=["none"], seed=0,
                                     logprob_chunk_size=chunk))
        rows = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)]
        return GRPOTrainer(cfg, reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
                           train_prompts=rows).train()

    full, chunked = run(None, tmp_path / "full"), run(3, tmp_path / "chunked")
    assert len(full) == len(chunked) == 2
    assert len(calls) == 2 * 2  # 2 runs x (old policy + reference) x 1 generation (2 steps of num_iterations=2)
    for a, b in zip(full, chunked):
        for k in ("loss", "kl", "clip_ratio/region_mean"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), k


def test_dry_run_sizes_count_prompts_not_completions():
    """--dry-run's plan in GRPO's units: 8 completions per micro-batch x 2 accumulation x 2 processes = 32
    completions = 8 prompts (groups of 4) per step, so 64 data rows are 8 steps (not 64 // 32 = 2)."""
    from rl.trainers.grpo_config import grpo_sizes

    cfg = build(GRPOConfig, {"model_name": "m", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                             "num_generations": 4})
    s = grpo_sizes(cfg, world=2, n_prompts=64)
    assert (s["per_device_batch"], s["global_batch"], s["prompts_per_step"], s["steps_per_epoch"]) == (8, 32, 8, 8)
    assert grpo_sizes(cfg, world=2)["steps_per_epoch"] is None  # an environment: no epochs


# ------------------------------------------------------------------------------- DAPO

def _rollout(prompts, completions, logp0, reasons):
    """A Rollout as `generate` returns it: left-padded prompts, right-padded completions."""
    from rl.engine.generation import Rollout
    from rl.engine.packing import left_pad

    N = max(len(c) for c in completions)
    tokens = torch.tensor([c + [0] * (N - len(c)) for c in completions])
    mask = torch.tensor([[1] * len(c) + [0] * (N - len(c)) for c in completions])
    ids, pmask = left_pad(prompts, 0)
    return Rollout(tokens=tokens, logprobs=(logp0 + torch.arange(N).float()) * mask, mask=mask, prompts=prompts,
                   prompt_ids=ids, prompt_mask=pmask, pad_token_id=0, finish_reasons=reasons)


def test_dynamic_sampling_batch_assembly_hand_computed():
    """Two processes x 2 groups per step over two rounds: each process takes its own kept groups in
    sampling order, then dropped ones to fill; the picked rows of gathered tensors and rollouts."""
    from rl.trainers.grpo_batch import (
        pick_groups,
        picked_rows,
        select_rollout,
        take_global,
    )

    keep = [torch.tensor([[True, False], [False, False]]), torch.tensor([[True, True], [False, True]])]
    picks, filled = pick_groups(keep, 2)
    # process 0 kept (round 0, 0), (1, 0), (1, 1) -> groups 0, 2; process 1 kept only 3, then dropped 0
    assert picks.tolist() == [[0, 2], [3, 0]] and filled == 1
    rows = picked_rows(picks, 2)  # G = 2
    assert rows.tolist() == [[0, 1, 4, 5], [6, 7, 0, 1]]
    # gathered tensors are process-major per round: value = 100 * round + 10 * process + completion;
    # process 0: group 0 (round 0, completions 0-1), group 2 (round 1, 0-1); process 1: group 3 (round 1,
    # completions 2-3), group 0 (round 0, 0-1)
    per_round = [torch.tensor([100 * r + 10 * p + c for p in range(2) for c in range(4)]) for r in range(2)]
    assert take_global(per_round, rows).tolist() == [0, 1, 100, 101, 112, 113, 10, 11]
    # rollouts of different widths are re-padded: row 1 of round 0 and row 0 of round 1
    a = _rollout([[5], [5]], [[7, 8, 9], [7]], 0.0, ["length", "stop"])
    b = _rollout([[6, 6, 6]], [[3, 4]], 10.0, ["stop"])
    ro = select_rollout([a, b], [1, 2])
    assert ro.prompt_ids.tolist() == [[0, 0, 5], [6, 6, 6]] and ro.prompt_mask.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert ro.tokens.tolist() == [[7, 0], [3, 4]] and ro.mask.tolist() == [[1, 0], [1, 1]]
    assert ro.logprobs.tolist() == [[0.0, 0.0], [10.0, 11.0]] and ro.finish_reasons == ["stop", "stop"]
    assert select_rollout([a], [0, 1]) is a  # the plain step: untouched


def test_dynamic_sampling_drops_flat_groups_and_samples_more(tiny_llama, tmp_path, monkeypatch):
    """Half the prompts get one reward for all completions (no spread, advantage 0), the others a
    distinct reward per completion (always spread), so what dynamic sampling must do depends only on
    the seeded prompt draws, not on what the model samples: the expected rounds, dropped and filled
    groups are counted from those draws. Also runs GSPO (importance_sampling_level=sequence)."""
    from rl.trainers import grpo

    def flat_or_spread(prompts, completions, flat, **kw):
        return [1.0 if f else float(i) for i, f in enumerate(flat)]

    seen = []

    def recording_metrics(rewards, *args):
        seen.append(rewards.clone())
        return real_metrics(rewards, *args)

    real_metrics = grpo.reward_metrics
    monkeypatch.setattr(grpo, "reward_metrics", recording_metrics)
    rows = [{"prompt": f"{a}+{b}=", "flat": (a + b) % 2 == 0} for a in range(4) for b in range(4)]
    cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path), learning_rate=1e-3, per_device_train_batch_size=8,
                                 num_generations=2, max_completion_length=3, max_length=12, max_steps=2, seed=0,
                                 dynamic_sampling=True, max_sampling_rounds=2, importance_sampling_level="sequence",
                                 epsilon=3e-4, epsilon_high=4e-4, report_to=["none"]))
    h = GRPOTrainer(cfg, reward_funcs=[flat_or_spread], train_prompts=rows).train()
    assert len(h) == 2
    k = 4  # prompts per step
    for step, row in enumerate(h):
        kept = rounds = dropped = 0
        for r in range(cfg.max_sampling_rounds):
            n_flat = sum(p["flat"] for p in grpo.step_prompts(None, rows, cfg.seed, step, k, r))
            rounds, dropped, kept = rounds + 1, dropped + n_flat, kept + k - n_flat
            if kept >= k:
                break
        filled = max(0, k - kept)
        assert (row["dapo/sampling_rounds"], row["dapo/dropped_groups"], row["dapo/filled_groups"]) == \
            (rounds, dropped, filled), step
        assert row["num_zero_std_groups"] == filled and row["frac_reward_zero_std"] == filled / k
        # the trained batch: kept groups (rewards 0..7 by position) first, filled flat ones (1.0) after
        assert seen[step].view(k, 2).std(1).gt(0).sum() == k - filled
        assert "clip_ratio/region_mean" in row and math.isfinite(row["loss"])
    # these draws exercise both paths: an extra round that fills the batch, and a batch still short (filled)
    assert sum(r["dapo/sampling_rounds"] for r in h) > len(h) and sum(r["dapo/filled_groups"] for r in h) > 0


def test_dapo_recipe_trains(tmp_path, monkeypatch):
    """recipes/tiny/dapo.yaml for 2 steps: the trained batch's rewards are the environment's plus DAPO's
    overlong penalty of each completion's length, and its zero-spread groups are exactly the filled ones."""
    from rl.algos.dapo import groups_with_spread, overlong_penalty
    from rl.config.parse import parse_config
    from rl.trainers import grpo

    seen = []

    def recording_metrics(rewards, per_func, names, components, lengths, *args):
        seen.append((rewards.clone(), per_func.clone(), lengths.clone()))
        return real_metrics(rewards, per_func, names, components, lengths, *args)

    real_metrics = grpo.reward_metrics
    monkeypatch.setattr(grpo, "reward_metrics", recording_metrics)
    cfg = parse_config(GRPOConfig, ["--config", "recipes/tiny/dapo.yaml", f"output_dir={tmp_path}", "max_steps=2",
                                    "per_device_train_batch_size=16", "eval_num_prompts=4", "report_to=[none]"])
    assert (cfg.dynamic_sampling, cfg.epsilon_high, cfg.loss_aggregation, cfg.overlong_buffer) == \
        (True, 0.28, "token_mean", 3)
    t = GRPOTrainer(cfg)
    h = [r for r in t.train() if "reward" in r]
    assert len(h) == 2 and len(seen) == 2
    for row, (rewards, per_func, lengths) in zip(h, seen):
        penalty = overlong_penalty(lengths, cfg.max_completion_length, cfg.overlong_buffer, cfg.overlong_penalty)
        torch.testing.assert_close(rewards, combine_rewards(per_func, t.reward.weights) + penalty)
        assert row["dapo/overlong_penalty"] == pytest.approx(float(penalty.mean()))
        assert int((~groups_with_spread(rewards, cfg.num_generations)).sum()) == row["dapo/filled_groups"]
        assert 1 <= row["dapo/sampling_rounds"] <= cfg.max_sampling_rounds
        if row["dapo/sampling_rounds"] < cfg.max_sampling_rounds:
            assert row["dapo/filled_groups"] == 0
