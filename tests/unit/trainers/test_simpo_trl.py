"""Cross-check of SimPO against TRL 1.16's CPOTrainer(loss_type="simpo", cpo_alpha=0): same tiny model,
same pairs, same optimizer (fp32, bf16=False, CPU).

Each optimizer step uses all 8 pairs (batch 8), so the sampler's order cannot matter. The first step's
metrics come before any update; the last step's after two identical updates; the parameters after 3
AdamW steps must agree. TRL's `logps/*` for SimPO are per-token means (ours stay the sums, as for every
loss type), so only the loss and the rewards/* metrics (beta * mean logp in both) are compared.
"""

from __future__ import annotations

import copy
import random

import pytest

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def _pairs():
    rng = random.Random(0)
    P = [f"q{i}: " + "x" * rng.randint(1, 12) for i in range(8)]
    C = ["good" * rng.randint(1, 3) for _ in P]
    R = ["bad" * rng.randint(1, 4) for _ in P]
    return P, C, R


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_matches_trl_cpo(label_smoothing, tiny_llama, tiny_tokenizer, tmp_path):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from rl.config.fields import build
    from rl.data.preference import PreferenceDataset
    from rl.models.loading import load_causal_lm
    from rl.trainers.dpo import DPOConfig, DPOTrainer

    tok = tiny_tokenizer
    P, C, R = _pairs()
    base = load_causal_lm(tiny_llama, dtype="float32")
    init = {k: v.clone() for k, v in base.state_dict().items()}
    lr, beta, gamma, steps = 1e-3, 2.0, 0.7, 3

    args = CPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=steps,
                     learning_rate=lr, lr_scheduler_type="constant", beta=beta, loss_type="simpo", cpo_alpha=0.0,
                     simpo_gamma=gamma, label_smoothing=label_smoothing, bf16=False, activation_checkpointing=False,
                     logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, max_length=128,
                     max_grad_norm=1.0, seed=0, disable_tqdm=True)
    theirs = CPOTrainer(model=copy.deepcopy(base), args=args, processing_class=tok,
                        train_dataset=Dataset.from_dict({"prompt": P, "chosen": C, "rejected": R}))
    theirs.train()
    trl_logs = [row for row in theirs.state.log_history if "rewards/chosen" in row]

    cfg = build(DPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / "ours"), report_to=["none"],
                                per_device_train_batch_size=8, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
                                beta=beta, loss_type="simpo", simpo_gamma=gamma, label_smoothing=label_smoothing,
                                max_length=128, max_prompt_length=64, dtype="float32", max_grad_norm=1.0))
    ours = DPOTrainer(cfg, tokenizer=tok, model=copy.deepcopy(base))
    assert ours.reference is None or not ours.reference.exists  # reference-free: nothing built
    history = ours.train(PreferenceDataset(P, C, R, tok, 128, 64))

    assert len(trl_logs) == len(history) == steps
    worst = {}
    for i in (0, -1):  # before any update; after two identical updates
        for k in KEYS:
            worst[k] = max(worst.get(k, 0.0), abs(history[i][k] - trl_logs[i][k]))
    a = dict(theirs.model.named_parameters())
    param_diff, param_rel = 0.0, 0.0
    for name, p in ours.pipeline.unwrapped_model.named_parameters():
        moved = (a[name].detach() - init[name]).abs().max().item()
        diff = (a[name].detach() - p.detach()).abs().max().item()
        assert moved > 1e-4, name  # every parameter was updated ...
        param_diff, param_rel = max(param_diff, diff), max(param_rel, diff / moved)
    print(f"\nsimpo vs TRL CPOTrainer (label_smoothing={label_smoothing}): max |metric diff| "
          f"{max(worst.values()):.2e} ({max(worst, key=worst.get)}), max |param diff| {param_diff:.2e} "
          f"({param_rel:.2e} of the move)")
    assert history[-1]["rewards/margins"] != history[0]["rewards/margins"]  # the later steps compare something
    for k, d in worst.items():
        assert d < 1e-4, (k, d)
    # ... the same way in both trainers: to 1% of the move (see test_dpo_trl.py on Adam and float noise)
    assert param_rel < 0.01, param_rel
