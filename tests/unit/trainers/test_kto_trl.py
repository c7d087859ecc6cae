"""Cross-check of KTO against TRL 1.16's KTOTrainer: same tiny model, same unpaired rows, same optimizer
(fp32, bf16=False, CPU).

One batch of all 8 rows per step, in file order on both sides (TRL's sequential sampler; ours
shuffle=false), so the mismatched rows of the KL term are the same: prompt i with completion i-1. Step 1
is before any update (policy = reference: kl 0); steps 2-3 compare the trajectory, where kl > 0 enters
the loss; the parameters after 3 AdamW steps must agree to float precision.
"""

from __future__ import annotations

import copy
import random

import pytest

KEYS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def _rows():
    rng = random.Random(0)
    P = [f"q{i}: " + "x" * rng.randint(1, 12) for i in range(8)]
    C = [("good" if i % 3 else "bad") * rng.randint(1, 3) for i in range(8)]
    L = [bool(i % 3) for i in range(8)]
    return P, C, L


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.5)])
def test_kto_matches_trl(weights, tiny_llama, tiny_tokenizer, tmp_path):
    from datasets import Dataset
    from trl import KTOConfig as TRLKTOConfig
    from trl import KTOTrainer as TRLKTOTrainer

    from rl.config.fields import build
    from rl.data.kto import UnpairedDataset
    from rl.models.loading import load_causal_lm
    from rl.trainers.kto import KTOConfig, KTOTrainer

    tok = tiny_tokenizer
    P, C, L = _rows()
    base = load_causal_lm(tiny_llama, dtype="float32")
    init = {k: v.clone() for k, v in base.state_dict().items()}
    lr, beta, steps = 1e-2, 0.5, 3  # large enough that kl > 0 after the first update
    dw, uw = weights

    args = TRLKTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=steps,
                        learning_rate=lr, lr_scheduler_type="constant", beta=beta, desirable_weight=dw,
                        undesirable_weight=uw, bf16=False, activation_checkpointing=False, logging_steps=1,
                        report_to="none", save_strategy="no", use_cpu=True, max_length=128, max_grad_norm=1.0,
                        seed=0, disable_tqdm=True)
    theirs = TRLKTOTrainer(model=copy.deepcopy(base), ref_model=copy.deepcopy(base), args=args,
                           processing_class=tok,
                           train_dataset=Dataset.from_dict({"prompt": P, "completion": C, "label": L}))
    theirs.train()
    trl_logs = [row for row in theirs.state.log_history if "rewards/chosen" in row]

    cfg = build(KTOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / "ours"), report_to=["none"],
                                per_device_train_batch_size=8, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", beta=beta,
                                desirable_weight=dw, undesirable_weight=uw, max_length=128, max_prompt_length=64,
                                dtype="float32", max_grad_norm=1.0, shuffle=False))
    ours = KTOTrainer(cfg, tokenizer=tok, model=copy.deepcopy(base))
    history = ours.train(UnpairedDataset(P, C, L, tok, 128, 64))

    assert len(trl_logs) == len(history) == steps
    assert history[0]["kl"] == 0.0 and history[-1]["kl"] > 0  # the reference point really enters
    worst = {k: max(abs(h[k] - t[k]) for h, t in zip(history, trl_logs)) for k in KEYS}
    a = dict(theirs.model.named_parameters())
    param_diff, param_rel = 0.0, 0.0
    for name, p in ours.pipeline.unwrapped_model.named_parameters():
        moved = (a[name].detach() - init[name]).abs().max().item()
        diff = (a[name].detach() - p.detach()).abs().max().item()
        assert moved > 1e-4, name
        param_diff, param_rel = max(param_diff, diff), max(param_rel, diff / moved)
    print(f"\nkto vs TRL KTOTrainer (weights {weights}): max |metric diff| {max(worst.values()):.2e} "
          f"({max(worst, key=worst.get)}), max |param diff| {param_diff:.2e} ({param_rel:.2e} of the move)")
    for k, d in worst.items():
        assert d < 1e-4 * max(1.0, abs(trl_logs[-1][k])), (k, d)
    assert param_rel < 0.01, param_rel
