"""Asynchronous rollouts with bounded staleness (issue 41): max_staleness=0 through the buffered path is the
synchronous loop bit for bit; with k=1 a step's loss is the clipped surrogate on the behaviour log-probs its
samples carried; a batch k+1 versions old is dropped and counted, never trained on; a resume continues on
the batches sampled ahead (the rollout position) exactly."""

from __future__ import annotations

import shutil

import pytest
import torch

from rl.config.fields import build
from rl.engine.packing import position_ids_from_mask
from rl.errors import ConfigError
from rl.rollout.staleness import StalenessBuffer, Tagged, admit, last_needed_version, sample_version
from rl.trainers.grpo import GRPOTrainer
from rl.trainers.grpo_config import GRPOConfig
from tests.conftest import run_main


def _ranked(prompts, completions, **k):
    """Rewards that differ inside every group whatever tokens were sampled: 0, 1, 2, 3, 0, ..."""
    return [float(i % 4) for i in range(len(completions))]


def _grpo(out, **kw) -> GRPOTrainer:
    cfg = build(GRPOConfig, dict(model_name=kw.pop("model"), output_dir=str(out), learning_rate=3e-2, per_device_train_batch_size=8,
                                 gradient_accumulation_steps=1, num_generations=4, max_completion_length=4,
                                 max_length=16, report_to=["jsonl"], seed=0, lr_scheduler="constant", **kw))
    rows = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)]
    return GRPOTrainer(cfg, train_prompts=rows, reward_funcs=[_ranked])


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.pipeline.unwrapped_model.parameters()]


# ------------------------------------------------------------------ the pure schedule and buffer

def test_schedule_and_buffer_drop_what_is_too_old():
    assert [sample_version(t, 2) for t in range(5)] == [0, 0, 0, 1, 2]
    assert sample_version(3, 2, start=4) == 4  # a resumed run has no older weights
    assert admit(3, 4, 1) and not admit(2, 4, 1) and admit(4, 4, 0)
    buf = StalenessBuffer(k=1)
    for step, version in ((4, 2), (5, 3), (6, 5)):
        buf.put(Tagged(step, version, {"id": step}, samples=8))
    # step 4 is 2 versions old at version 4: dropped; step 5 (version 3) too old for its own step: dropped
    assert buf.take(4, 4) is None and buf.dropped_samples == 16 and buf.dropped_batches == 2
    assert buf.take(6, 6).batch == {"id": 6} and not buf.items
    assert buf.next_step(7) == 7
    assert last_needed_version([3, 5, 7], 2, 0) == 5 and last_needed_version([], 2, 3) == 3


def test_async_keys_refuse_bad_values(tiny_llama):
    base = dict(model_name=tiny_llama, per_device_train_batch_size=8, num_generations=4, max_completion_length=4, max_length=16)
    with pytest.raises(ConfigError, match="max_staleness"):
        build(GRPOConfig, {**base, "max_staleness": -1})
    with pytest.raises(ConfigError, match="num_iterations=1"):
        build(GRPOConfig, {**base, "max_staleness": 1, "num_iterations": 2})
    with pytest.raises(ConfigError, match="rollout_processes"):
        build(GRPOConfig, {**base, "rollout_processes": -2})
    with pytest.raises(ConfigError, match="behav_imp_weight_cap"):
        build(GRPOConfig, {**base, "behav_imp_weight_cap": 1.0})
    with pytest.raises(ConfigError, match="off_policy_correction"):
        build(GRPOConfig, {**base, "off_policy_correction": "tis"})


# ------------------------------------------------------------------ the loss

def test_k0_through_the_buffer_is_the_synchronous_loop_bit_for_bit(tmp_path, tiny_llama, monkeypatch):
    """The buffered path with k=0 (forced by monkeypatching `buffered`) against the plain loop: same losses,
    gradient norms and weights after 3 steps, with a reference model in the loss (beta > 0)."""
    sync_t = _grpo(tmp_path / "sync", model=tiny_llama, max_steps=3, beta=0.05)
    sync = sync_t.train()
    buf_t = _grpo(tmp_path / "buf", model=tiny_llama, max_steps=3, beta=0.05)
    monkeypatch.setattr(GRPOTrainer, "buffered", property(lambda self: True))
    buffered = buf_t.train()
    assert all(r["async/staleness"] == 0 for r in buffered if "loss" in r)
    for a, b in zip(sync, buffered):
        for key in ("loss", "grad_norm", "reward", "kl"):
            if key in a:
                assert a[key] == b[key], key
    assert all(torch.equal(a, b) for a, b in zip(_weights(sync_t), _weights(buf_t)))
    # and k=1 is not the synchronous loop: the comparison above can fail
    k1 = _grpo(tmp_path / "k1", model=tiny_llama, max_steps=3, beta=0.05, max_staleness=1).train()
    assert [r["loss"] for r in k1 if "loss" in r] != [r["loss"] for r in sync if "loss" in r]


def _before_step(monkeypatch, step: int, look) -> dict:
    """Run `look(trainer)` just before the trainer's step `step` (0-based: the optimizer step it takes is step
    + 1) and keep that step's metric row: rows["look"], rows["row"]."""
    seen, train_step = {}, GRPOTrainer.train_step

    def spy(self):
        if self.pipeline.step == step:
            seen["look"] = look(self)
            seen["row"] = train_step(self)
            return seen["row"]
        return train_step(self)

    monkeypatch.setattr(GRPOTrainer, "train_step", spy)
    return seen


@pytest.mark.parametrize("correction", ["behaviour", "decoupled"])
def test_k1_loss_is_the_chosen_correction_on_the_carried_behaviour_logprobs(tmp_path, tiny_llama, correction,
                                                                           monkeypatch):
    """Step 2 of max_staleness=1 trains on the batch sampled by the policy of step 0 (version 0) with the
    policy of version 1. Computed here by hand from a plain forward and the log-probs the sampler recorded:
    behaviour (TRL's AsyncGRPO): token_mean(-min(r A, clip(r, 1-eps, 1+eps) A)), r = exp(logp - behaviour);
    decoupled (AReaL): token_mean(-w A), w = exp(logp - behaviour), 0 where w > behav_imp_weight_cap."""

    def by_hand(t):
        (item,) = t._buffer.items
        assert (item.step, item.version) == (1, 0)
        b = item.batch["batch"]
        model = t.pipeline.unwrapped_model
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           position_ids=position_ids_from_mask(b["attention_mask"])).logits[:, :-1].float()
        labels = b["labels"][:, 1:]
        mask = labels.ne(-100)
        logp = torch.log_softmax(logits / t.cfg.temperature, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        behaviour = b["old_logprobs"]  # what the sampler recorded for its tokens, carried with the batch
        assert (logp - behaviour)[mask].abs().max() > 1e-4  # a step of training separates the two policies
        A = b["advantages"][:, None]
        assert A.abs().sum() > 0
        r = torch.exp(logp - behaviour)
        if correction == "behaviour":
            per_token = -torch.minimum(r * A, r.clamp(0.8, 1.2) * A)
        else:
            per_token = -torch.where(r > 1.02, 0.0, r) * A
        return float(per_token[mask].sum() / mask.sum()), float((logp - behaviour)[mask].abs().max())

    seen = _before_step(monkeypatch, 1, by_hand)
    _grpo(tmp_path / "k1", model=tiny_llama, max_steps=2, max_staleness=1, epsilon=0.2, epsilon_high=0.2,
          off_policy_correction=correction, behav_imp_weight_cap=1.02).train()
    (hand, diff), row = seen["look"], seen["row"]
    assert row["step"] == 2 and row["async/staleness"] == 1 and row["async/policy_version"] == 0
    assert row["loss"] == pytest.approx(hand, abs=1e-5)
    assert row["sampling/sampling_logp_difference/max"] == pytest.approx(diff, abs=1e-5)


def test_a_batch_k_plus_1_versions_old_is_dropped_and_counted_never_trained_on(tmp_path, tiny_llama, monkeypatch):
    """At step 2 of max_staleness=1 the buffered batch is replaced by one tagged version 0 = t - k - 1 whose
    advantages are NaN: trained on, the loss would be NaN. It is dropped (its 8 samples counted) and the
    step trains on a batch the current policy samples."""

    def poison(t):
        (item,) = t._buffer.items
        assert item.step == 2 and item.version == 1
        poisoned = {**item.batch, "batch": {**item.batch["batch"], "advantages":
                                            torch.full_like(item.batch["batch"]["advantages"], float("nan"))}}
        t._buffer.items[0] = Tagged(2, 0, poisoned, samples=8)

    seen = _before_step(monkeypatch, 2, poison)
    _grpo(tmp_path / "drop", model=tiny_llama, max_steps=3, max_staleness=1).train()
    row = seen["row"]
    assert row["async/dropped_samples"] == 8 and row["async/dropped_batches"] == 1
    assert row["async/policy_version"] == 2 and row["async/staleness"] == 0
    assert torch.isfinite(torch.tensor(row["loss"]))


def test_nothing_is_sampled_past_the_runs_last_step(tmp_path, tiny_llama, monkeypatch):
    """max_staleness=2, 3 steps: the batches of steps 0..2 are sampled, never those of steps 3 and 4."""
    sampled, batch = [], GRPOTrainer._generation_batch
    monkeypatch.setattr(GRPOTrainer, "_generation_batch",
                        lambda self, index, rollout=None: sampled.append(index) or batch(self, index, rollout))
    _grpo(tmp_path / "end", model=tiny_llama, max_steps=3, max_staleness=2).train()
    assert sampled == [0, 1, 2]


def test_rollout_processes_with_vllm_are_refused_naming_the_server_path(tiny_llama):
    with pytest.raises(ConfigError, match="rl vllm-serve.*vllm_mode=server max_staleness=1 rollout_processes=0"):
        build(GRPOConfig, dict(model_name=tiny_llama, per_device_train_batch_size=8, num_generations=4,
                               max_completion_length=4, max_length=16, use_vllm=True, rollout_processes=1))


# ------------------------------------------------------------------ resume

def test_resume_with_k1_trains_on_the_batches_sampled_ahead_exactly(tmp_path, tiny_llama):
    """checkpoint-2 of max_staleness=1 holds the batch of step 3, sampled by version 1, and the rollout
    position (step 3): the resumed steps 3 and 4 equal the uninterrupted run's, weights included. Without the
    stored batch (the file removed) step 3 would be sampled by version 2 and differ: the test can fail."""
    full_t = _grpo(tmp_path / "full", model=tiny_llama, max_steps=4, save_steps=2, max_staleness=1)
    full = full_t.train()
    ckpt = tmp_path / "full" / "checkpoints" / "checkpoint-2"
    extra = torch.load(ckpt / "per_process_0.pt", weights_only=False)
    assert [i["step"] for i in extra["async_items"]] == [2] and [i["version"] for i in extra["async_items"]] == [1]

    def resumed(name):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt, tmp_path / name / "checkpoints" / "checkpoint-2")
        return tmp_path / name

    cut_t = _grpo(resumed("cut"), model=tiny_llama, max_steps=4, resume="auto", max_staleness=1)
    cut = cut_t.train()
    assert [r["step"] for r in cut] == [3, 4] and [r["async/policy_version"] for r in cut] == [1, 2]
    for a, b in zip(cut, full[2:]):
        for key in ("loss", "grad_norm", "reward"):
            assert a[key] == b[key], key
    assert all(torch.equal(a, b) for a, b in zip(_weights(full_t), _weights(cut_t)))

    again_dir = resumed("again")
    (again_dir / "checkpoints" / "checkpoint-2" / "per_process_0.pt").unlink()
    again = _grpo(again_dir, model=tiny_llama, max_steps=4, resume="auto", max_staleness=1).train()
    assert again[0]["async/policy_version"] == 2 and again[0]["loss"] != full[2]["loss"]


def test_launch_max_staleness_1_trains_saves_and_resumes(tmp_path, tiny_llama, capfd, monkeypatch):
    """The issue's done-when command, on the tiny recipe: 3 steps with a checkpoint at 2, then resume=auto to 4."""
    out = tmp_path / "run"
    args = ["--config", "recipes/tiny/grpo.yaml", f"model_name={tiny_llama}", "max_staleness=1", f"output_dir={out}",
            "eval_num_prompts=4", "eval_steps=0", "per_device_train_batch_size=8", "num_generations=4", "save_steps=2"]
    code, stdout, stderr = run_main("grpo", args + ["max_steps=3"], capfd, monkeypatch)
    assert code == 0, stdout + stderr
    assert (out / "model.safetensors").exists() and (out / "checkpoints" / "checkpoint-2").exists()
    code, stdout, stderr = run_main("grpo", args + ["max_steps=4", "resume=auto"], capfd, monkeypatch)
    assert code == 0, stdout + stderr
    assert "resumed from" in stdout + stderr and "grpo done: 4 steps" in stdout
