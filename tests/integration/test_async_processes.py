"""rollout_processes=1 under `accelerate launch` with 2 CPU processes (gloo): process 1 only samples, process 0
trains; the batches, their policy versions and so the losses equal the in-process max_staleness run's (the same
schedule, rl.rollout.staleness); the run saves and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rl.engine.state import complete_checkpoints
from tests.conftest import ROOT, accelerate_cmd, run_cmd


def ranked(prompts, completions, **kw):
    """Rewards that differ inside every group whatever tokens were sampled (the losses are then not 0)."""
    return [float(i % 4) for i in range(len(completions))]


def _train_rows(out) -> list[dict]:
    return [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


ARGS = ["--config", "recipes/tiny/grpo.yaml", "max_staleness=1", "eval_steps=0", "eval_num_prompts=4",
        "per_device_train_batch_size=8", "num_generations=4", "save_steps=2", "learning_rate=3e-2",
        "reward_funcs=[tests.integration.test_async_processes:ranked]", "env_config.answer_format=plain"]


@pytest.mark.slow
def test_one_rollout_process_trains_like_the_in_process_run_saves_and_resumes(tmp_path):
    env = {"RL_NO_PROGRESS": "1", "RL_DIST_TIMEOUT": "300"}
    procs = tmp_path / "procs"
    run_cmd(accelerate_cmd("launch/grpo.py", *ARGS, "rollout_processes=1", "max_steps=3", f"output_dir={procs}"),
            timeout=600, env=env)
    inproc = tmp_path / "inproc"
    run_cmd([sys.executable, "launch/grpo.py", *ARGS, "max_steps=3", f"output_dir={inproc}"], timeout=600, env=env)
    a, b = _train_rows(procs), _train_rows(inproc)
    assert [r["step"] for r in a] == [1, 2, 3] and [r["async/policy_version"] for r in a] == [0, 0, 1]
    assert any(r["loss"] != 0 for r in a)
    for ra, rb in zip(a, b):
        for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), key
    assert (procs / "model.safetensors").exists() and (procs / "checkpoints" / "checkpoint-2").exists()
    # resume: the rollout process starts at the checkpoint's rollout position (step 3), nothing repeated
    proc = run_cmd(accelerate_cmd("launch/grpo.py", *ARGS, "rollout_processes=1", "max_steps=4", "resume=auto",
                                  f"output_dir={procs}"), timeout=600, env=env)
    assert "resumed from" in proc.stdout + proc.stderr
    rows = _train_rows(procs)
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]  # steps 3 and 4 again after checkpoint-2
    # resumed at version 2: the weights of versions 0 and 1 are gone, so step 3 is sampled by version 2
    # (staleness 0), step 4 by max(2, 4 - 1 - 1) = 2 as the schedule says
    assert [r["async/policy_version"] for r in rows[-2:]] == [2, 2] and rows[-2]["async/staleness"] == 0


_calls = 0


def dies_at_fifth(prompts, completions, **kw):
    """`ranked`, except that the process scoring its fifth batch (the rollout process: step 5's) dies there."""
    global _calls
    _calls += 1
    if _calls == 5:
        os._exit(3)
    return ranked(prompts, completions)


@pytest.mark.slow
def test_a_rollout_process_that_dies_stops_the_run_in_bounded_time_with_the_checkpoint_intact(tmp_path):
    """The rollout process exits while it samples step 5's batch (after checkpoint-2 was written, since that
    batch needs the weights of step 3): the launch ends (no hang, within the test's timeout), non-zero, and
    checkpoint-2 is complete and resumes."""
    out = tmp_path / "dies"
    args = [a for a in ARGS if not a.startswith("reward_funcs")] + [
        "reward_funcs=[tests.integration.test_async_processes:dies_at_fifth]", "rollout_processes=1", "max_steps=8"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RL_NO_PROGRESS": "1",
           "RL_DIST_TIMEOUT": "60"}
    proc = subprocess.run(accelerate_cmd("launch/grpo.py", *args, f"output_dir={out}"), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode != 0
    # checkpoint-4 too when the trainer finished step 4 before the launcher stopped it (a race, either is right)
    assert "checkpoint-2" in [p.name for p in complete_checkpoints(out)]
    run_cmd(accelerate_cmd("launch/grpo.py", *ARGS, "rollout_processes=1", "max_steps=6", "resume=auto",
                           f"output_dir={out}"), timeout=600, env={"RL_NO_PROGRESS": "1", "RL_DIST_TIMEOUT": "300"})
    assert _train_rows(out)[-1]["step"] == 6


@pytest.mark.slow
def test_two_training_processes_and_one_rollout_process(tmp_path):
    """3 processes: 0 and 1 train (DDP among themselves only), 2 samples each one's share of every step; the
    staleness histogram counts both shares (2 x 8 samples), the run saves."""
    out = tmp_path / "m2"
    run_cmd(accelerate_cmd("launch/grpo.py", *ARGS, "rollout_processes=1", "max_steps=3", f"output_dir={out}",
                           num_processes=3), timeout=600, env={"RL_NO_PROGRESS": "1", "RL_DIST_TIMEOUT": "300"})
    rows = _train_rows(out)
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1]
    assert [r["async/staleness/1"] for r in rows] == [0, 16, 16] and any(r["loss"] != 0 for r in rows)
    assert (out / "model.safetensors").exists()
