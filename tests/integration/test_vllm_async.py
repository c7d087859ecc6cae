"""The vllm tier, asynchronous rollouts: 1 training process + 1 `rl vllm-serve` server (vLLM's CPU build) with
`use_vllm=true vllm_mode=server max_staleness=1` (rl.rollout.ahead.ServerAhead).

What is checked: the request for the batch of step t + 1 goes to the server before step t's optimizer step (the
server samples while the trainer trains), and is sampled by the weights of version t (pushed first); every step
logs sampling/* and async/* metrics, the stale steps carry the server's log-probs as the behaviour policy (their
logp difference is the policy's drift, above the engine's own mismatch); the checkpoint holds the batch sampled
ahead and its rollout position, and the resumed run trains on it exactly (same loss as the uninterrupted run).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

if os.environ.get("RL_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (the vllm tier runs in .ci/run's vLLM venv)")

from tests.integration.test_vllm import MAX_LENGTH, server  # noqa: E402, F401 - `rl vllm-serve` on the tiny model
from tests.integration.vllm_rewards import spread  # noqa: E402

pytestmark = pytest.mark.vllm


def _grpo(out, port, group, **over):
    from rl.config.parse import build
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig

    cfg = build(GRPOConfig, {**dict(model_name="tiny:llama-hd64", output_dir=str(out), learning_rate=1e-2,
                                    lr_scheduler_type="constant", per_device_train_batch_size=16, num_generations=4,
                                    max_completion_length=4, max_length=MAX_LENGTH, report_to=["jsonl"], seed=0,
                                    use_vllm=True, vllm_mode="server", vllm_server_port=port, vllm_group_port=group,
                                    vllm_server_timeout=300.0, max_staleness=1, save_steps=2), **over})
    rows = [{"prompt": f"{a}+{b}="} for a in range(10) for b in range(10)]
    return GRPOTrainer(cfg, reward_funcs=[spread], train_prompts=rows)


def test_server_samples_ahead_logs_every_step_saves_and_resumes_at_its_rollout_position(tmp_path, server,
                                                                                          monkeypatch):
    from rl.engine.pipeline import ForwardBackwardPipeline
    from rl.rollout.vllm_engine import VLLMRollout
    from rl.trainers.grpo import GRPOTrainer

    _, port, group, _ = server
    events: list[tuple[str, int]] = []
    request, optim_step, sync = GRPOTrainer._server_request, ForwardBackwardPipeline.optim_step, VLLMRollout.sync

    def record_request(self, index):
        events.append(("request", index))
        return request(self, index)

    def record_optim(self, *a, **k):
        out = optim_step(self, *a, **k)
        events.append(("optim", self.step))
        return out

    def record_sync(self, model, version):
        if version != self.version:
            events.append(("push", version))
        return sync(self, model, version)

    monkeypatch.setattr(GRPOTrainer, "_server_request", record_request)
    monkeypatch.setattr(ForwardBackwardPipeline, "optim_step", record_optim)
    monkeypatch.setattr(VLLMRollout, "sync", record_sync)
    full = _grpo(tmp_path / "full", port, group, max_steps=4).train()
    print("events:", events)
    # step 0 waits for its own batch (nothing sampled yet); from then on the batch of step t + 1 is requested,
    # after the weights of version t were pushed, before step t's optimizer step: it is sampled while t trains
    assert events[:3] == [("push", 0), ("request", 0), ("request", 1)]
    for t in (1, 2):
        assert events.index(("push", t)) < events.index(("request", t + 1)) < events.index(("optim", t + 1))
    rows = [r for r in full if "loss" in r]
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1, 2]
    assert [r["async/staleness"] for r in rows] == [0, 1, 1, 1]
    for r in rows:  # every step: the mismatch metrics (TRL's names) and the async ones
        assert {"sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/mean",
                "async/dropped_samples", "time/waiting_trainer", "time/weight_sync"} <= set(r), sorted(r)
    # staleness 0: the engine held the weights that train (its mismatch only); staleness 1: the policy moved
    # since the server sampled, and the loss saw it through the carried vLLM log-probs
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert rows[1]["sampling/sampling_logp_difference/max"] > 1e-3
    logged = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "async/staleness" in r] == [1, 2, 3, 4]
    assert ("request", 4) not in events and ("push", 3) not in events  # nothing sampled past the run's end

    ckpt = tmp_path / "full" / "checkpoints" / "checkpoint-2"
    import torch

    extra = torch.load(ckpt / "per_process_0.pt", weights_only=False)
    assert [(i["step"], i["version"]) for i in extra["async_items"]] == [(2, 1)]
    (tmp_path / "cut" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, tmp_path / "cut" / "checkpoints" / "checkpoint-2")
    # the resumed run joins the same server (its weight group replaces the first run's)
    cut = [r for r in _grpo(tmp_path / "cut", port, group, max_steps=4, resume="auto").train() if "loss" in r]
    assert [r["step"] for r in cut] == [3, 4] and [r["async/policy_version"] for r in cut] == [1, 2]
    assert cut[0]["loss"] == rows[2]["loss"]  # the stored batch, the restored weights: the same step


@pytest.mark.slow
def test_two_training_processes_and_one_server(tmp_path, server):
    """2 training processes (DDP, gloo) + 1 server, max_staleness=1: the main process makes one request for both
    processes' prompts and each gets its share (a broadcast; each process checks the samples are of its own
    prompts); every step logs both shares (2 x 16 samples at staleness 1 after the first) and the engine's
    mismatch; the run saves."""
    from tests.conftest import accelerate_cmd, run_cmd

    _, port, group, _ = server
    out = tmp_path / "m2"
    run_cmd(accelerate_cmd("launch/grpo.py", "--config", "recipes/tiny/grpo.yaml", f"output_dir={out}",
                           "model_name=tiny:llama-hd64", "use_vllm=true", "vllm_mode=server", f"vllm_server_port={port}",
                           f"vllm_group_port={group}", "vllm_server_timeout=300", "max_staleness=1", "max_steps=3",
                           "per_device_train_batch_size=16", f"max_length={MAX_LENGTH}", "eval_steps=0",
                           "eval_num_prompts=4", "learning_rate=1e-2",
                           "reward_funcs=[tests.integration.vllm_rewards:spread]"),
            timeout=900, env={"RL_NO_PROGRESS": "1"})
    rows = [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    print("2 processes + server:", [(r["async/policy_version"], r["sampling/sampling_logp_difference/max"]) for r in rows])
    assert [r["async/policy_version"] for r in rows] == [0, 0, 1]
    assert [r["async/staleness/1"] for r in rows] == [0, 32, 32]
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-4  # each process trained on its own samples
    assert (out / "model.safetensors").exists()
