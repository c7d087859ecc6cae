"""What a user reads about a run (issue 49): the banner's process counts with rollout processes, a resumed run's
"before" figure (the evaluation before its first step, kept in every checkpoint), and two PPO faults: a resume
with another number of processes applies its rollout's KL update once, and a critic from another directory is
checked against the policy's tokens and max_length before any model loads."""

from __future__ import annotations

import json
import shutil
import types

import torch

from rl.config.fields import build
from rl.trainers.base import Trainer
from rl.trainers.grpo import GRPOTrainer
from rl.trainers.grpo_config import GRPOConfig
from rl.trainers.registry import grpo_summary
from tests.conftest import ROOT, run_main, swapped_digits_copy
from tests.unit.trainers.test_cadence import PROMPTS, _ppo


def test_the_banner_counts_training_and_rollout_processes():
    def banner(world: int, rollout_processes: int) -> str:
        t = Trainer.__new__(Trainer)
        t.cfg = types.SimpleNamespace(rollout_processes=rollout_processes)
        t.accelerator = types.SimpleNamespace(num_processes=world)  # a rollout process is not in the trainer's world
        return t.processes

    assert banner(1, 0) == "1 process" and banner(2, 0) == "2 processes"
    assert banner(1, 1) == "1 training process + 1 rollout (sampling) process"
    assert banner(2, 3) == "2 training processes + 3 rollout (sampling) processes"


def _grpo(out, model, **kw) -> GRPOTrainer:
    data = ROOT / "data" / "tiny"
    cfg = build(GRPOConfig, dict(model_name=model, output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8,
                                 num_generations=4, max_completion_length=4, max_length=16, beta=0.0, seed=0,
                                 report_to=["jsonl"], env_type="math", max_steps=2, eval_num_prompts=4, eval_steps=1,
                                 env_config={"problems_path": str(data / "math_train.jsonl"), "answer_format": "plain"},
                                 eval_env_config={"problems_path": str(data / "math_test.jsonl")}, **kw))
    return GRPOTrainer(cfg)


def test_a_resumed_run_reports_the_evaluation_before_its_first_step(tmp_path, tiny_llama):
    """The evaluation at step 0 goes into every checkpoint; a resumed run's history starts with it, so its
    summary's "before" is the run's own starting point (it was the first evaluation after the resume)."""
    full = _grpo(tmp_path / "full", tiny_llama, save_steps=1).train()
    assert full[0]["step"] == 0 and "eval/accuracy" in full[0]
    ckpt = tmp_path / "full" / "checkpoints" / "checkpoint-1"
    assert json.loads((ckpt / "state.json").read_text())["extra"]["first_eval"] == full[0]
    (tmp_path / "cut" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, tmp_path / "cut" / "checkpoints" / ckpt.name)
    cut = _grpo(tmp_path / "cut", tiny_llama, resume="auto").train()
    assert cut[0] == full[0]  # step 0, not the evaluation after step 2
    assert [r["step"] for r in cut[1:]] == [2]
    plan = {"total_steps": 2}
    assert grpo_summary(cut, plan, None) == grpo_summary([r for r in full if r["step"] != 1], plan, None)


def test_ppo_resumed_with_another_number_of_processes_applies_the_kl_update_once(tmp_path, tiny_llama):
    """checkpoint-6 falls inside iteration 2, whose rollout already moved the adaptive KL coefficient. Resumed with
    another number of processes that rollout is sampled afresh (its rows were split for the old world); the
    coefficient it starts from is the one before its update, so the update is applied once, not twice."""
    full_t = _ppo(tmp_path / "full", model=tiny_llama, save_steps=6, max_steps=6)  # steps 7-8 run resumed only
    full = full_t.train(PROMPTS)
    ckpt = tmp_path / "full" / "checkpoints" / "checkpoint-6"
    state = json.loads((ckpt / "state.json").read_text())["extra"]
    assert state["kl_coef_before"] == full[4]["kl_coef"] != state["kl_coef"]  # the update moved it: this can fail
    local = torch.load(ckpt / "per_process_0.pt", weights_only=True)
    local["experience"]["world"] = 2  # as if written by 2 processes: not this world's rows
    torch.save(local, ckpt / "per_process_0.pt")
    (tmp_path / "cut" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, tmp_path / "cut" / "checkpoints" / ckpt.name)
    cut = _ppo(tmp_path / "cut", model=tiny_llama, resume="auto").train(PROMPTS)  # max_steps 8
    assert [r["step"] for r in cut] == [7, 8]
    assert cut[0]["kl_coef"] == full[4]["kl_coef"]  # the resampled rollout's rewards use iteration 2's coefficient


def test_a_ppo_critic_is_checked_against_the_policys_tokens_and_length(tmp_path, tiny_llama, capfd, monkeypatch):
    """value_model=critic from another directory reads the policy's token ids: a tokenizer that maps an id to
    another token, or a context below max_length, is one line (exit 2) before any model loads."""
    from rl.models.tiny import write_tiny_model

    swapped = tmp_path / "swapped"
    swapped_digits_copy(tiny_llama, swapped)
    short = write_tiny_model(tmp_path / "short", family="llama")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    base = ["--config", "recipes/tiny/ppo.yaml", f"model_name={tiny_llama}", "value_model=critic",
            f"output_dir={tmp_path / 'out'}"]
    for critic, said in ((swapped, "its tokenizer maps id"), (short, "its context is 64 (its config's")):
        code, _, stderr = run_main("ppo", [*base, f"critic_model_path={critic}", "max_length=128"], capfd, monkeypatch)
        lines = [x for x in stderr.splitlines() if x.startswith("error:")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
        assert lines[0].startswith(f"error: key 'critic_model_path': the critic {critic} reads the policy's token ids"), lines
        assert said in lines[0], lines
        assert not (tmp_path / "out").exists()  # nothing ran


def test_eval_steps_with_nothing_to_evaluate_says_so_once():
    """eval_steps without held-out data or an eval environment would have no effect: one `note:` line at the
    first step it names (the trainers' evaluate_now returns None), by all its names since the reference's
    eval_every may be the one typed, and the run goes on."""
    from rl.config.schema import TrainConfig
    from rl.trainers.base import CallbackTracker

    class One(Trainer):
        cfg = TrainConfig(model_name="tiny:llama", eval_steps=2, logging_steps=1, save_steps=0, quiet=True)
        accelerator = types.SimpleNamespace(num_processes=1)
        pipeline = types.SimpleNamespace(step=0, tokens_seen=0)

        def train_step(self):
            self.pipeline.step += 1
            return {"step": self.pipeline.step, "loss": 0.0}

    notes = []
    tracker = CallbackTracker()
    tracker.write = notes.append
    rows = One().fit(6, tracker)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert notes == ["note: eval_steps/eval_every=2 evaluates nothing: this run has no held-out data "
                     "(data.eval_path, data.eval_fraction) or eval_env_config"]
