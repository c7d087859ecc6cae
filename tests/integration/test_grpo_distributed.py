"""GRPO under `accelerate launch` with 2 CPU processes and DeepSpeed ZeRO-3 (gloo): groups generated on
each rank with gathered parameters, rewards gathered for the advantages, a frozen reference as its own
ZeRO-3 engine (beta > 0), and the final model saved gathered. DAPO's dynamic sampling and overlong shaping
ride along: every rank must take the same number of sampling rounds (decided from gathered rewards) or
the ZeRO-3 generation would hang. The LM head runs in chunks (logprob_chunk_size, automatic with a real
vocabulary): every rank must call the partitioned head as often, forward and in backward's recomputation,
whatever its batch's length, or the gathers mismatch (gloo aborted before rl.engine.chunked equalised them)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import accelerate_cmd, run_cmd


@pytest.mark.slow
def test_grpo_two_process_zero3(tmp_path):
    out = tmp_path / "grpo-z3"
    run_cmd(accelerate_cmd("launch/grpo.py", "--config", "recipes/tiny/grpo.yaml", f"output_dir={out}",
                           "max_steps=2", "per_device_train_batch_size=16", "gradient_accumulation_steps=2", "beta=0.04",
                           "eval_num_prompts=8", "eval_steps=0", "dynamic_sampling=true", "max_sampling_rounds=2",
                           "overlong_buffer=2", "logprob_chunk_size=3", zero3=True),
            timeout=600, env={"RL_NO_PROGRESS": "1"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train] == [1, 2]
    # 2 processes x 16 x 2 accumulation = 64 completions = 8 prompts x 8 generations per step
    assert all(0.0 <= r["frac_reward_zero_std"] <= 1.0 and r["kl"] >= 0.0 for r in train)
    assert train[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    # each rank trains on its own kept groups; zero-spread groups left in the batch are exactly the filled ones
    assert all(1 <= r["dapo/sampling_rounds"] <= 2 and r["num_zero_std_groups"] == r["dapo/filled_groups"]
               and -1.0 <= r["dapo/overlong_penalty"] <= 0.0 for r in train)
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    assert (out / "model.safetensors").exists() and (out / "config.yaml").exists()
