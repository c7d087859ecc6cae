"""rollout_dtype=bfloat16 (issue 50): our sampler computes its linears in bf16; GRPO treats its log-probs as a
rollout engine's (vLLM's): the mismatch with the fp32 policy is measured (TRL's sampling/* metrics) and
corrected by the truncated importance weights; float32 (the default) has no mismatch to measure."""

from __future__ import annotations

import pytest
import torch

from rl.config.fields import build
from rl.engine.packing import position_ids_from_mask
from rl.errors import ConfigError
from rl.trainers.grpo import GRPOTrainer
from rl.trainers.grpo_config import GRPOConfig

bf16_cpu = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                              reason="rollout_dtype=bfloat16 needs a CPU with bf16 instructions")


def _ranked(prompts, completions, **k):
    return [float(i % 4) for i in range(len(completions))]


def _train(out, model, **kw) -> tuple[list[dict], dict]:
    """One GRPO step on one micro-batch; (metric rows, what the step's batch looked like to the fp32 policy)."""
    cfg = build(GRPOConfig, dict(model_name=model, output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8,
                                 num_generations=4, max_completion_length=6, max_length=20, max_steps=1,
                                 report_to=["none"], seed=0, **kw))
    trainer = GRPOTrainer(cfg, train_prompts=[{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)],
                          reward_funcs=[_ranked])
    seen, batch_of = {}, GRPOTrainer._generation_batch

    def spy(self, index, rollout=None):
        gb = batch_of(self, index, rollout)
        b = gb["batch"]
        with torch.no_grad():  # the policy that takes the step, before it: the loss's old log-probs
            logits = self.pipeline.unwrapped_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                                   position_ids=position_ids_from_mask(b["attention_mask"])).logits
        labels = b["labels"][:, 1:]
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        mask = labels.ne(-100)
        seen["diff"] = (logp - b["old_logprobs"])[mask].abs()
        seen["behaviour"] = "behaviour" in b
        return gb

    trainer._generation_batch = spy.__get__(trainer)
    return trainer.train(), seen


@bf16_cpu
def test_bf16_rollouts_measure_the_mismatch_with_the_fp32_policy(tmp_path, tiny_llama):
    rows, seen = _train(tmp_path / "bf16", tiny_llama, rollout_dtype="bfloat16")
    (row,) = [r for r in rows if "loss" in r]
    assert seen["behaviour"] and seen["diff"].max() > 1e-5  # the bf16 sampler is not the fp32 policy
    assert row["sampling/sampling_logp_difference/max"] == pytest.approx(float(seen["diff"].max()), abs=1e-5)
    assert row["sampling/sampling_logp_difference/mean"] == pytest.approx(float(seen["diff"].mean()), abs=1e-5)
    assert 0 < row["sampling/importance_sampling_ratio/mean"] and torch.isfinite(torch.tensor(row["loss"]))


def test_float32_rollouts_carry_no_behaviour_log_probs(tmp_path, tiny_llama):
    rows, seen = _train(tmp_path / "fp32", tiny_llama)
    (row,) = [r for r in rows if "loss" in r]
    assert not seen["behaviour"] and not any(k.startswith("sampling/") for k in row)
    assert seen["diff"].max() < 1e-4  # the fp32 sampler's log-probs are the policy's


def test_rollout_dtype_is_refused_with_vllm(tiny_llama):
    with pytest.raises(ConfigError, match="rollout_dtype sets our sampler's precision"):
        build(GRPOConfig, dict(model_name=tiny_llama, per_device_train_batch_size=8, num_generations=4,
                               max_completion_length=4, max_length=16, use_vllm=True, rollout_dtype="bfloat16"))
