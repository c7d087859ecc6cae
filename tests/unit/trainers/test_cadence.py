"""One optimizer step is one step of `Trainer.fit`: logging, checkpoints, `max_steps` and the scheduler
count optimizer steps also where a trainer reuses one batch for several of them (GRPO's num_iterations,
PPO's epochs and minibatches), and a checkpoint taken between those steps resumes exactly."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from rl.config.fields import build
from rl.trainers.base import CallbackTracker, Trainer
from rl.trainers.grpo import GRPOTrainer
from rl.trainers.grpo_config import GRPOConfig
from rl.trainers.ppo import PPOTrainer
from rl.trainers.ppo_config import PPOConfig
from tests.conftest import run_main


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_grpo_cadence_counts_optimizer_steps(tmp_path, tiny_llama, capfd, monkeypatch):
    """The issue's command (launch/grpo.py, num_iterations=2 max_steps=5 save_steps=3): exactly 5 optimizer
    steps, the linear schedule ends at 0 on the 5th, checkpoint-3 is the only checkpoint (it falls inside the
    second generation batch) and the final model is written. Before the fix the run took 6 steps and wrote
    checkpoint-6 only."""
    out = tmp_path / "run"
    code, stdout, stderr = run_main("grpo", [
        "--config", "recipes/tiny/grpo.yaml", f"model_name={tiny_llama}", "num_iterations=2", "max_steps=5",
        "save_steps=3", f"output_dir={out}", "lr_scheduler_type=linear", "learning_rate=1e-3", "eval_num_prompts=4",
        "per_device_train_batch_size=8", "num_generations=4", "logging_steps=1"], capfd, monkeypatch)
    assert code == 0, stdout + stderr
    train = [r for r in _rows(out) if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    # the scheduler stepped once per optimizer step: 1e-3 * (1 - k/5) after step k, its last value 0
    assert [r["learning_rate"] for r in train] == pytest.approx([8e-4, 6e-4, 4e-4, 2e-4, 0.0], abs=1e-12)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-3"]
    assert torch.load(out / "checkpoints" / "checkpoint-3" / "scheduler.pt", weights_only=True)["last_epoch"] == 3
    assert (out / "model.safetensors").exists() and "grpo done: 5 steps" in stdout
    # the two steps of one generation batch share its rollout; the third step samples a new one
    assert train[0]["reward"] == train[1]["reward"] and train[2]["reward"] == train[3]["reward"]


def _grpo(out, **kw) -> GRPOTrainer:
    cfg = build(GRPOConfig, dict(model_name=kw.pop("model"), output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8,
                                 gradient_accumulation_steps=2, num_generations=4, max_completion_length=4,
                                 max_length=16, num_iterations=2, beta=0.05, report_to=["jsonl"], seed=0, **kw))
    rows = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)]
    return GRPOTrainer(cfg, train_prompts=rows,
                       reward_funcs=[lambda prompts, completions, **k: [float(sum(map(ord, c)) % 7) for c in completions]])


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.pipeline.unwrapped_model.parameters()]


def _resume_from(ckpt, out):
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, out / "checkpoints" / ckpt.name)


def test_grpo_resume_between_the_updates_of_a_generation_batch_is_exact(tmp_path, tiny_llama):
    """checkpoint-3 of num_iterations=2 holds generation batch 1 after its first update; the resumed
    step 4 trains on that same batch: its metrics and the final weights equal the uninterrupted run's.
    Without the stored batch (the file removed) step 4 would sample it again with the updated policy and
    differ, so the comparison can fail."""
    full_t = _grpo(tmp_path / "full", model=tiny_llama, max_steps=4, save_steps=3)
    full = full_t.train()
    ckpt = tmp_path / "full" / "checkpoints" / "checkpoint-3"
    assert (ckpt / "per_process_0.pt").exists()
    _resume_from(ckpt, tmp_path / "cut")
    cut_t = _grpo(tmp_path / "cut", model=tiny_llama, max_steps=4, resume="auto")
    cut = cut_t.train()
    assert [r["step"] for r in cut] == [4]
    for key in ("loss", "grad_norm", "reward", "kl", "clip_ratio/region_mean"):
        assert cut[0][key] == full[3][key], key
    assert all(torch.equal(a, b) for a, b in zip(_weights(full_t), _weights(cut_t)))

    (tmp_path / "cut" / "checkpoints" / "checkpoint-3" / "per_process_0.pt").unlink()
    (tmp_path / "cut" / "metrics.jsonl").unlink()
    again = _grpo(tmp_path / "cut", model=tiny_llama, max_steps=4, resume="auto").train()
    assert again[0]["loss"] != full[3]["loss"]


def _ppo(out, **kw) -> PPOTrainer:
    cfg = PPOConfig(**{**dict(model_name=kw.pop("model"), output_dir=str(out), seed=0, learning_rate=3e-3,
                              lr_scheduler_type="linear", per_device_train_batch_size=8, mini_batch_size=4, gradient_accumulation_steps=1,
                              num_ppo_epochs=2, max_completion_length=4, max_length=32, top_k=0, beta=0.02,
                              adaptive_kl=True, kl_target=1e-4, kl_horizon=100, dtype="float32", device="cpu",
                              report_to=["none"], max_steps=8), **kw})
    return PPOTrainer(cfg, reward_fn=lambda prompts, responses, metadata=None: [
        (sum(r.encode("utf-8", "replace")) % 13) / 13 for r in responses])


PROMPTS = [f"{w} {v}: " for w in ("tell", "why") for v in ("sea", "cat", "sky", "poem")]


def test_ppo_steps_are_optimizer_steps_and_resume_mid_iteration_is_exact(tmp_path, tiny_llama):
    """PPO with 2 epochs x 2 minibatches per iteration: 8 rows for 2 iterations, one per optimizer step, each
    with its iteration; save_steps counts optimizer steps (checkpoint-6 is iteration 2 after 2 of its 4
    steps); resuming there continues on the stored rollout exactly."""
    full_t = _ppo(tmp_path / "full", model=tiny_llama, save_steps=3)
    full = full_t.train(PROMPTS)
    assert [r["step"] for r in full] == list(range(1, 9)) and [r["iteration"] for r in full] == [1] * 4 + [2] * 4
    assert full_t.pipeline.scheduler.last_epoch == 8 and full[-1]["learning_rate"] == 0.0
    # one rollout per iteration: its metrics are the same on each of its steps
    assert len({r["objective/kl"] for r in full[:4]}) == 1 and full[0]["kl_coef"] == full[3]["kl_coef"]
    ckpts = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir())
    assert ckpts == ["checkpoint-3", "checkpoint-6"]
    _resume_from(tmp_path / "full" / "checkpoints" / "checkpoint-6", tmp_path / "cut")
    cut_t = _ppo(tmp_path / "cut", model=tiny_llama, resume="auto")
    cut = cut_t.train(PROMPTS)
    assert [r["step"] for r in cut] == [7, 8]
    for a, b in zip(cut, full[6:]):
        for key in ("loss/policy", "loss/value", "grad_norm", "objective/kl", "kl_coef"):
            assert a[key] == b[key], key
    assert cut_t.kl_ctl.value == full_t.kl_ctl.value
    assert all(torch.equal(a, b) for a, b in zip(_weights(full_t), _weights(cut_t)))


def test_fit_refuses_a_train_step_of_several_optimizer_steps():
    """The cadence is only right if each call is one step: a trainer taking two per call is an error."""

    class Two(Trainer):
        cfg = types.SimpleNamespace(resume=None, eval_steps=0, logging_steps=1, save_steps=0)
        accelerator = types.SimpleNamespace(num_processes=1)
        pipeline = types.SimpleNamespace(step=0)

        def train_step(self):
            self.pipeline.step += 2
            return {"step": self.pipeline.step, "loss": 0.0}

    with pytest.raises(RuntimeError, match="went from step 0 to 2"):
        Two().fit(4, CallbackTracker())
