"""Cross-check against TRL 1.16's DPOTrainer: same tiny model, same pairs, same optimizer (fp32, bf16=False).

Each optimizer step uses all 8 pairs (batch 8), so the sampler's order cannot matter. The first step's
metrics are computed before any update (initial loss and logps); later steps compare the training
trajectory, and the parameters after 3 AdamW steps must agree to float precision.
"""

from __future__ import annotations

import copy
import random

import pytest

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "logps/chosen", "logps/rejected")


def _pairs():
    rng = random.Random(0)
    P = [f"q{i}: " + "x" * rng.randint(1, 12) for i in range(8)]
    C = ["good" * rng.randint(1, 3) for _ in P]
    R = ["bad" * rng.randint(1, 4) for _ in P]
    return P, C, R


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_matches_trl_dpo(loss_type, tiny_llama, tiny_tokenizer, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig as TRLDPOConfig
    from trl import DPOTrainer as TRLDPOTrainer

    from rl.config.fields import build
    from rl.data.preference import PreferenceDataset
    from rl.models.loading import load_causal_lm
    from rl.trainers.dpo import DPOConfig, DPOTrainer

    tok = tiny_tokenizer
    P, C, R = _pairs()
    base = load_causal_lm(tiny_llama, dtype="float32")
    init = {k: v.clone() for k, v in base.state_dict().items()}
    lr, beta, steps = 1e-3, 0.1, 3

    args = TRLDPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=steps,
                        learning_rate=lr, lr_scheduler_type="constant", beta=beta, loss_type=[loss_type],
                        bf16=False, activation_checkpointing=False, logging_steps=1, report_to="none",
                        save_strategy="no", use_cpu=True, max_length=128, max_grad_norm=1.0, seed=0,
                        disable_tqdm=True)
    theirs = TRLDPOTrainer(model=copy.deepcopy(base), args=args, processing_class=tok,
                           train_dataset=Dataset.from_dict({"prompt": P, "chosen": C, "rejected": R}))
    theirs.train()
    trl_logs = [row for row in theirs.state.log_history if "rewards/chosen" in row]

    cfg = build(DPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / "ours"), report_to=["none"],
                                per_device_train_batch_size=8, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
                                beta=beta, loss_type=loss_type, max_length=128, max_prompt_length=64,
                                dtype="float32", max_grad_norm=1.0))
    ours = DPOTrainer(cfg, tokenizer=tok, model=copy.deepcopy(base))
    history = ours.train(PreferenceDataset(P, C, R, tok, 128, 64))

    assert len(trl_logs) == len(history) == steps
    for k in KEYS:  # initial metrics (before any update)
        assert history[0][k] == pytest.approx(trl_logs[0][k], abs=1e-4), k
    assert history[-1]["rewards/margins"] != 0.0  # the later steps really compare something
    for k in KEYS:  # after two identical updates
        assert history[-1][k] == pytest.approx(trl_logs[-1][k], abs=1e-3), k
    a = dict(theirs.model.named_parameters())
    for name, p in ours.pipeline.unwrapped_model.named_parameters():
        moved = (a[name].detach() - init[name]).abs().max().item()
        diff = (a[name].detach() - p.detach()).abs().max().item()
        assert moved > 1e-4, name  # every parameter was updated ...
        # ... the same way in both trainers: to 1% of the move (Adam divides by sqrt(v), so a gradient entry
        # near zero turns float summation-order noise between CPUs into ~1e-5 of the update)
        assert diff < 0.01 * moved, (name, diff, moved)
