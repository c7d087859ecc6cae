"""PPO: hand-computed GAE / KL controller / rewards, loss pieces, log-prob alignment, config and errors."""

from __future__ import annotations

import sys

import pytest
import torch

from rl.algos.advantages import gae, whiten
from rl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_penalized_rewards,
    per_token_kl,
)
from rl.models.value import PPOModel, ValueHead
from rl.trainers.ppo_config import PPOConfig, check_reward_source
from rl.trainers.ppo_math import explained_variance, policy_loss, response_logprobs
from tests.conftest import ROOT

# ------------------------------------------------------------------------------------------- GAE

def naive_gae(rewards, values, mask, gamma, lam):
    """The textbook loop, skipping masked positions (next value / advantage carried over them)."""
    B, N = rewards.shape
    adv = torch.zeros(B, N, dtype=torch.float64)
    for b in range(B):
        last_gae, next_v = 0.0, 0.0
        for t in reversed(range(N)):
            if mask[b, t] == 0:
                continue
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            last_gae = delta + gamma * lam * last_gae
            adv[b, t] = last_gae
            next_v = values[b, t]
    return adv, (adv + values.double()) * mask


def test_gae_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 1.0, 0.2], [0.5, 0.2, 9.0]])  # row 1: the 9.0 is padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: A2 = 2 - .2 = 1.8; A1 = (0 + .9*.2 - 1) + .72*1.8 = .476; A0 = (1 + .9 - .5) + .72*.476
    # row 1: A1 = 2 - .2 = 1.8 (episode ends); A0 = (1 + .9*.2 - .5) + .72*1.8 = 1.976; padding 0
    expected = torch.tensor([[1.4 + 0.72 * 0.476, 0.476, 1.8], [1.976, 1.8, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, (expected + values) * mask, atol=1e-6, rtol=0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)])
def test_gae_matches_naive_loop_with_masks(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, N = 6, 17
    rewards = torch.randn(B, N, generator=g)
    values = torch.randn(B, N, generator=g)
    lengths = torch.tensor([17, 1, 5, 12, 0, 9])
    mask = (torch.arange(N)[None] < lengths[:, None]).long()
    mask[3, 4] = 0  # a hole (e.g. an environment's tokens inside the response)
    mask[0, [2, 3, 10]] = 0
    adv, ret = gae(rewards.double(), values.double(), mask, gamma, lam)
    n_adv, n_ret = naive_gae(rewards.double(), values.double(), mask, gamma, lam)
    torch.testing.assert_close(adv, n_adv, atol=1e-10, rtol=0)
    torch.testing.assert_close(ret, n_ret, atol=1e-10, rtol=0)
    assert adv[4].abs().sum() == 0  # an empty row gets nothing


# ------------------------------------------------------------------------------------ KL and rewards

def test_adaptive_kl_controller_follows_ziegler_formula():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    expected = 0.1
    for kl, n in [(9.0, 256), (3.0, 64), (6.6, 512), (6.0, 128), (100.0, 10000)]:
        err = min(max(kl / 6.0 - 1.0, -0.2), 0.2)
        expected *= 1 + err * n / 10000
        assert ctl.update(kl, n) == pytest.approx(expected, rel=1e-12)
    assert ctl.value == pytest.approx(expected)
    # the n_steps factor matters: 100 iterations of 256 samples at 2x the target raise the coefficient
    # by (1 + .2 * 256/1e4)^100 = 1.67x; without it (the reference's bug) by only (1 + .2/1e4)^100 = 1.002x
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    for _ in range(100):
        ctl.update(12.0, 256)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) ** 100)
    assert ctl.value > 0.16
    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 256) == 0.05 and fixed.value == 0.05


def test_kl_estimators():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    torch.testing.assert_close(per_token_kl(logp, ref, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))
    lr = logp - ref
    torch.testing.assert_close(per_token_kl(logp, ref, "k3"), torch.exp(-lr) - 1 + lr)
    assert (per_token_kl(logp, ref, "k3") >= 0).all()
    # both are unbiased estimators of KL(p || q) when tokens are sampled from p
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=g), 0)
    q = torch.softmax(torch.randn(8, generator=g), 0)
    true_kl = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[x][None], q.log()[x][None]
    for est in ("k1", "k3"):
        assert float(per_token_kl(lp, lq, est).mean()) == pytest.approx(true_kl, abs=0.01)
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'; choose one of: k1, k2, k3"):
        per_token_kl(logp, ref, "k4")


def test_score_only_at_last_response_token():
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    rewards, non_score = kl_penalized_rewards(torch.tensor([1.0, -2.0]), kl, mask, kl_coef=0.1)
    torch.testing.assert_close(non_score, torch.tensor([[-0.01, -0.02, -0.03, -0.04], [-0.05, -0.05, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.01, -0.02, -0.03, 0.96], [-0.05, -2.05, 0.0, 0.0]]))
    # a tool-use episode's mask has a gap (tool tokens) in the middle, and an empty row gets nothing:
    # the score goes to the last policy token (index 4 here, not mask.sum() - 1 = 2)
    kl = torch.zeros(2, 6)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]])
    rewards, _ = kl_penalized_rewards(torch.tensor([3.0, 5.0]), kl, mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 0.0, 0.0, 3.0, 0.0], [0.0] * 6]))


def test_whiten_and_explained_variance():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]])
    w = whiten(x, mask)
    vals = w[mask.bool()]
    assert float(vals.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(vals.std()) == pytest.approx(1.0, abs=1e-4)  # unbiased, as TRL
    assert float(w[0, 3]) == 0.0 and float(w[1, 2]) == 0.0
    ret = torch.tensor([[1.0, 2.0, 3.0]])
    m = torch.ones(1, 3)
    assert explained_variance(ret, ret, m) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 3), 2.0), ret, m) == pytest.approx(0.0)
    assert explained_variance(-ret, ret, m) < 0


# ------------------------------------------------------------------------------------ loss pieces

def test_policy_value_entropy_loss_pieces():
    from rl.algos.policy_losses import compute_policy_loss, ppo_value_loss
    from rl.algos.reduce import masked_mean

    g = torch.Generator().manual_seed(0)
    B, P, N, V = 3, 4, 5, 11
    logits = torch.randn(B, P + N, V, generator=g)
    values_full = torch.randn(B, P + N, generator=g)
    tokens = torch.randint(0, V, (B, N), generator=g)
    mask = torch.ones(B, N)
    mask[1, 3:] = 0
    old_logp = response_logprobs(logits, tokens, P, 0.7) + 0.1 * torch.randn(B, N, generator=g)
    adv, old_v, ret = (torch.randn(B, N, generator=g) for _ in range(3))

    class Out:
        pass

    out = Out()
    out.logits, out.value = logits, values_full
    kw = dict(P=P, tokens=tokens, mask=mask, old_logprobs=old_logp, advantages=adv, old_values=old_v,
              returns=ret, epsilon=0.2, value_clip=0.3, value_coef=0.5, entropy_coef=0.01, temperature=0.7)
    loss, metrics = policy_loss(None, None, out, **kw)
    # independently: log-probs of the response tokens from the logits one position earlier
    lg = logits[:, P - 1:P - 1 + N] / 0.7
    logp = torch.log_softmax(lg, -1).gather(-1, tokens[..., None]).squeeze(-1)
    ent = -(torch.softmax(lg, -1) * torch.log_softmax(lg, -1)).sum(-1)
    pl, _ = compute_policy_loss(logp, old_logp, adv, mask, loss_type="ppo", epsilon=0.2, epsilon_high=0.2)
    vl, _ = ppo_value_loss(values_full[:, P - 1:P - 1 + N], old_v, ret, mask, 0.3)
    expected = pl + 0.5 * vl - 0.01 * masked_mean(ent, mask)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    assert float(metrics["policy/entropy"]) == pytest.approx(float(masked_mean(ent, mask)), abs=1e-6)
    # prompt positions and masked response positions do not enter the loss (entropy included)
    logits2 = logits.clone()
    logits2[:, :P - 1] = torch.randn(B, P - 1, V, generator=g) * 10
    logits2[1, P - 1 + 3:] = 50.0
    values2 = values_full.clone()
    values2[:, :P - 1] = 123.0
    out.logits, out.value = logits2, values2
    loss2, _ = policy_loss(None, None, out, **kw)
    torch.testing.assert_close(loss2, loss, atol=1e-6, rtol=0)


def test_policy_loss_selects_the_registered_loss_type():
    """ppo_math.policy_loss with loss_type=cispo is the registered cispo term (TRL's: weight capped at
    epsilon_high) around the same log-probs: on-policy (r = 1) with cap 0.2 the per-token term is -0.2 A logp,
    so the policy loss is the token mean of that, and not the default's -A (= the mean of -A here)."""
    from rl.algos.reduce import masked_mean

    g = torch.Generator().manual_seed(1)
    B, P, N, V = 2, 3, 4, 9
    logits = torch.randn(B, P + N, V, generator=g)
    tokens = torch.randint(0, V, (B, N), generator=g)
    mask = torch.ones(B, N)
    adv = torch.randn(B, N, generator=g)
    logp = response_logprobs(logits, tokens, P)

    class Out:
        value = None

    out = Out()
    out.logits = logits
    kw = dict(P=P, tokens=tokens, mask=mask, old_logprobs=logp, advantages=adv, epsilon=0.2)
    default, _ = policy_loss(None, None, out, **kw)
    cispo, m = policy_loss(None, None, out, loss_type="cispo", **kw)
    assert default.item() == pytest.approx(masked_mean(-adv, mask).item(), abs=1e-6)
    assert cispo.item() == pytest.approx(masked_mean(-0.2 * adv * logp, mask).item(), abs=1e-6)
    assert set(m) >= {"loss/policy", "policy/clipfrac", "policy/entropy", "loss/total"}


def test_ppo_trainer_with_loss_type_cispo_trains_and_differs_from_the_default(tmp_path, tiny_llama, monkeypatch):
    """One PPO iteration (one optimizer step) per loss_type from the same seed: the same rollout and
    scores, so only the loss differs. The default's first policy loss is -mean(A) over whitened advantages
    (about 0); cispo's, -mean(0.2 A logp), is not, and the updated weights differ."""
    from rl.trainers.ppo import PPOTrainer

    monkeypatch.setattr("rl.engine.tracking.plot_history", lambda *a, **k: None)
    runs, weights = {}, {}
    for loss_type in ("ppo", "cispo"):
        cfg = PPOConfig(model_name=tiny_llama, output_dir=str(tmp_path / loss_type), seed=0, learning_rate=1e-2,
                        per_device_train_batch_size=4, mini_batch_size=4, num_ppo_epochs=1, max_completion_length=5,
                        max_length=24, max_steps=1, dtype="float32", device="cpu", report_to=["none"], loss_type=loss_type)
        trainer = PPOTrainer(cfg, reward_fn=lambda p, r, m=None: [len(x) / 5 for x in r])
        runs[loss_type] = trainer.train(["1+1=", "2+2=", "3+3=", "4+4="])
        weights[loss_type] = {n: p.detach().clone() for n, p in trainer.pipeline.unwrapped_model.named_parameters()}
    ppo, cispo = runs["ppo"][0], runs["cispo"][0]
    assert ppo["objective/scores"] == pytest.approx(cispo["objective/scores"], abs=1e-6)  # the same rollout
    assert abs(ppo["loss/policy"]) < 1e-4  # -mean of whitened advantages, on-policy
    assert abs(cispo["loss/policy"] - ppo["loss/policy"]) > 1e-3
    assert any(not torch.equal(weights["ppo"][n], w) for n, w in weights["cispo"].items())


# ------------------------------------------------------------------------------------ alignment

def test_response_logprobs_align_with_sampled_tokens(tiny_llama, tiny_tokenizer):
    """The recomputed log-probs of the sampled tokens equal the sampler's; the unshifted logits do not;
    left padding changes nothing; the value head gives one value per token."""
    from rl.engine.generation import generate
    from rl.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = PPOModel(load_causal_lm(tiny_llama, dtype="float32")).eval()
    torch.nn.init.normal_(model.value_head.out.weight, std=0.5)
    tok = tiny_tokenizer
    prompts = [tok("a much longer prompt here: ")["input_ids"], tok("hi: ")["input_ids"]]  # BOS first
    ro = generate(model, tok, prompts, max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0, seed=3)
    P = ro.prompt_ids.shape[1]
    ids = torch.cat([ro.prompt_ids, ro.tokens], 1)
    attn = torch.cat([ro.prompt_mask, ro.mask], 1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn)
    logp = response_logprobs(out.logits, ro.tokens, P)
    m = ro.mask.bool()
    torch.testing.assert_close(logp[m], ro.logprobs[m], atol=1e-4, rtol=0)
    unshifted = torch.log_softmax(out.logits[:, P:], -1).gather(-1, ro.tokens[:, :ids.shape[1] - P, None]).squeeze(-1)
    assert (unshifted[m] - ro.logprobs[m]).abs().max() > 0.1
    # per-token values, (B, T), not one per sequence
    assert out.value.shape == ids.shape
    assert out.value[0, P - 1:].std() > 0
    # the short prompt alone (no left padding) gives the same log-probs and values
    n1 = int(ro.mask[1].sum())
    alone = torch.tensor([prompts[1] + ro.tokens[1, :n1].tolist()])
    with torch.no_grad():
        out1 = model(input_ids=alone, attention_mask=torch.ones_like(alone))
    p1 = len(prompts[1])
    torch.testing.assert_close(response_logprobs(out1.logits, ro.tokens[1:, :n1], p1)[0], logp[1, :n1],
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(out1.value[0, p1 - 1:p1 - 1 + n1], out.value[1, P - 1:P - 1 + n1], atol=1e-4, rtol=0)


def test_value_head_shape_and_zero_init():
    head = ValueHead(8)
    h = torch.randn(2, 5, 8)
    assert head(h).shape == (2, 5) and head(h).abs().sum() == 0


# ------------------------------------------------------------------------------------ config

def test_reference_cli_names_are_aliases_with_reference_defaults():
    from rl.config.parse import parse_config

    cfg = parse_config(PPOConfig, ["model_name=tiny:llama", "--rl-gamma", "0.9", "--rl-gae-lambda", "0.8",
                                   "--rl-kl-coef", "0.05", "--rl-value-loss-coef", "0.7", "--rl-clip-range", "0.1",
                                   "--rl-value-clip-range", "0.3", "--rl-num-ppo-epochs", "2",
                                   "--rl-mini-batch-size", "4", "--rl-max-new-tokens", "32", "--rl-top-k", "7",
                                   "--rl-top-p", "0.9", "--rl-temperature", "0.7", "--rl-reward-fn", "default",
                                   "--model-ref", "tiny:qwen2", "--rl-reward-weights", '{"correctness": 1.0}'])
    assert (cfg.gamma, cfg.lam, cfg.beta, cfg.vf_coef, cfg.epsilon, cfg.value_clip) == \
        (0.9, 0.8, 0.05, 0.7, 0.1, 0.3)
    assert (cfg.num_ppo_epochs, cfg.mini_batch_size, cfg.max_completion_length, cfg.top_k, cfg.top_p, cfg.temperature) == \
        (2, 4, 32, 7, 0.9, 0.7)
    assert cfg.reward_fn == "default" and cfg.ref_model == "tiny:qwen2" and cfg.reward_weights == {"correctness": 1.0}
    d = PPOConfig(model_name="m", reward_fn="default")
    # the reference CLI table's defaults
    assert (d.gamma, d.lam, d.beta, d.vf_coef, d.epsilon, d.value_clip, d.num_ppo_epochs,
            d.mini_batch_size, d.max_completion_length, d.top_k, d.top_p, d.temperature) == \
        (0.99, 0.95, 0.1, 1.0, 0.2, 0.2, 4, 8, 128, 50, 1.0, 1.0)
    assert d.reward_model_path is None and d.multi_objective is False and d.env_type is None
    assert (d.logprob_chunk_size, d.optimize_device_cache) == (128, True)  # rl_chunk_size, rl_optimize_device_cache


@pytest.mark.parametrize("kw,needle", [
    (dict(per_device_train_batch_size=12, mini_batch_size=8), "not a multiple of mini_batch_size"),
    (dict(mini_batch_size=8, gradient_accumulation_steps=3), "gradient_accumulation_steps"),
    (dict(max_completion_length=600, max_length=512), "max_length"),
    (dict(reward_fn="default", reward_model_path="x"), "exactly one reward source"),
    (dict(temperature=0.0), "temperature"),
    (dict(loss_type="cipso"), "key 'loss_type' has unknown value 'cipso' .did you mean cispo..; choose one of: ppo, "
                              "dapo"),
])
def test_config_errors(kw, needle):
    from rl.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        PPOConfig(model_name="m", **kw)


def test_no_reward_source_is_one_clear_error(tmp_path):
    from rl.errors import ConfigError

    with pytest.raises(ConfigError, match="no reward source"):
        check_reward_source(PPOConfig(model_name="m"))
    import subprocess

    r = subprocess.run([sys.executable, "launch/ppo.py", "--config", "recipes/tiny/ppo.yaml", "reward_fn=null",
                        f"output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error: no reward source") and "Traceback" not in r.stderr


def test_reward_sources(tiny_tokenizer):
    """Named functions, module:function, a two-argument callable, the multi-objective environment."""
    from rl.errors import ConfigError
    from rl.trainers.ppo_rewards import build_reward_source
    from rl.trainers.rewards import RewardError

    prompts, responses = ["a: ", "b: "], ["one two three", "Answer: 4"]
    src = build_reward_source(PPOConfig(model_name="m", reward_fn="default"), tiny_tokenizer)
    torch.testing.assert_close(src(prompts, responses, {})[0], torch.tensor([0.03, 0.02]))
    src = build_reward_source(PPOConfig(model_name="m", reward_fn="custom", custom_reward="rl.rewards.functions:char_fraction_reward"),
                              tiny_tokenizer)
    torch.testing.assert_close(src(["p"], ["aab"], {})[0], torch.tensor([2 / 3]))
    src = build_reward_source(PPOConfig(model_name="m"), tiny_tokenizer, reward_fn=lambda p, r: [len(x) for x in r])
    torch.testing.assert_close(src(prompts, responses, {})[0], torch.tensor([13.0, 9.0]))
    cfg = PPOConfig(model_name="m", multi_objective=True, reward_weights={"length": 1.0, "formatting": 0.1})
    cfg.data.path = "data/tiny/ppo_prompts.jsonl"
    scores, metrics = build_reward_source(cfg, tiny_tokenizer)(prompts, responses, {})
    assert scores[1] > scores[0] and "formatting" in metrics  # the environment's components are kept
    bad = build_reward_source(PPOConfig(model_name="m"), tiny_tokenizer, reward_fn=lambda p, r, m=None: [float("nan")] * 2)
    with pytest.raises(RewardError, match="'<lambda>' returned nan for completion 0"):
        bad(prompts, responses, {})
    with pytest.raises(ConfigError, match="unknown reward function"):
        build_reward_source(PPOConfig(model_name="m", reward_fn="nope"), tiny_tokenizer)
