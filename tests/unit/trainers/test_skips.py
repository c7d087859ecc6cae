"""Work that cannot change the result is skipped: GRPO's old-policy forward when the update is on-policy
(num_iterations = 1), GRPO's reference forward at beta = 0, PPO's reference at beta = 0.
Each skip is counted (scoring forwards) and shown to give the same numbers as the work it skips."""

from __future__ import annotations

import pytest
import torch

from rl.config.fields import build
from rl.engine.scoring import sequence_logprobs
from rl.models.reference import ReferencePolicy
from rl.trainers import grpo, ppo_math
from rl.trainers.grpo import GRPOTrainer, grpo_loss_fn
from rl.trainers.grpo_config import GRPOConfig
from rl.trainers.ppo import PPOTrainer
from rl.trainers.ppo_config import PPOConfig


def _count_scoring(monkeypatch, module) -> list:
    """Every no-grad scoring forward (`sequence_logprobs`) the trainer module runs."""
    calls = []
    real = module.sequence_logprobs

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(module, "sequence_logprobs", counted)
    return calls


def _grpo(tiny_llama, out, **kw):
    cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8,
                                 num_generations=4, max_completion_length=4, max_length=16, report_to=["none"],
                                 seed=0, **kw))
    rows = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)]
    return GRPOTrainer(cfg, reward_funcs=[lambda prompts, completions, **k: [float(len(c)) for c in completions]],
                       train_prompts=rows)


def test_grpo_on_policy_without_kl_runs_no_scoring_forward(tiny_llama, tmp_path, monkeypatch):
    calls = _count_scoring(monkeypatch, grpo)
    trainer = _grpo(tiny_llama, tmp_path / "skip", max_steps=1, num_iterations=1, beta=0.0)
    assert not trainer.reference.exists  # no reference model loaded at all
    rows = trainer.train()
    assert len(rows) == 1 and rows[0]["loss"] == rows[0]["loss"]
    assert calls == []  # neither an old-policy nor a reference forward
    # (that the same counter counts 2 per generation at num_iterations = 2, beta > 0:
    # tests/unit/trainers/test_grpo.py::test_chunked_scoring_changes_nothing)


def test_grpo_on_policy_old_logprobs_are_the_detached_current_ones(tiny_llama):
    """What num_iterations = 1 skips: old log-probs from a separate no-grad forward give the same loss
    and gradients as the detached current log-probs the loss uses instead (ratio 1)."""
    from rl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_llama, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0  # left-padded prompts
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :6] = -100  # loss on the completion only
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    adv = torch.tensor([1.0, -0.5, 0.25, 0.5])
    kw = dict(advantages=adv, temperature=0.7, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
              loss_aggregation="token_mean", max_completion_length=6, num_items=None, use_bias_correction_kl=False)
    old = sequence_logprobs(model, ids, mask, labels, position_ids=pos, temperature=0.7)[0]
    out = {}
    for name, old_lp in (("skipped", None), ("separate", old)):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        loss, metrics = grpo_loss_fn(logits, labels, mask, old_logprobs=old_lp, **kw)
        loss.backward()
        out[name] = (float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert out["skipped"][0] == pytest.approx(out["separate"][0], abs=1e-6) and out["skipped"][0] != 0
    for n, grad in out["skipped"][1].items():
        torch.testing.assert_close(out["separate"][1][n], grad, atol=1e-6, rtol=1e-5, msg=n)


def _ppo(tmp_path, **kw) -> PPOTrainer:
    cfg = PPOConfig(model_name="tiny:llama", output_dir=str(tmp_path), seed=0, learning_rate=3e-3, per_device_train_batch_size=4,
                    mini_batch_size=4, num_ppo_epochs=1, max_completion_length=4, max_length=32, top_k=0, adaptive_kl=True,
                    dtype="float32", device="cpu", report_to=["none"], max_steps=1, **kw)
    return PPOTrainer(cfg, reward_fn=lambda prompts, responses, metadata=None: [len(r) / 4 for r in responses])


def test_ppo_without_kl_penalty_runs_no_reference(tmp_path, tiny_cache, monkeypatch):
    """beta = 0 (adaptive or not, it stays 0): no reference model and no reference forward,
    and the same iteration as with a reference whose KL term is multiplied by 0."""
    prompts = ["tell sea: ", "why cat: ", "how sky: ", "write poem: "]
    calls = _count_scoring(monkeypatch, ppo_math)
    skip = _ppo(tmp_path / "skip", beta=0.0)
    assert not skip.reference.exists and skip.reference.model is None
    h_skip = skip.train(prompts)
    assert calls == []
    # the same run with the reference forced on (what the code did before): one reference forward
    real_build = ReferencePolicy.build
    monkeypatch.setattr(ReferencePolicy, "build", lambda *a, needed=True, **k: real_build(*a, needed=True, **k))
    with_ref = _ppo(tmp_path / "ref", beta=0.0)
    assert with_ref.reference.exists
    h_ref = with_ref.train(prompts)
    assert len(calls) == 1
    compared = [k for k in h_ref[0] if k.startswith(("loss/", "policy/", "objective/scores", "val/"))]
    assert "loss/policy" in compared and "objective/scores" in compared
    for k in compared:
        assert h_skip[0][k] == pytest.approx(h_ref[0][k], abs=1e-6), k
    assert h_ref[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as the reference
    assert h_skip[0]["objective/kl"] == 0.0
