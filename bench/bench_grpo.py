"""Completion tokens/s of one GRPO step: ours (rl.grpo.GRPOTrainer) vs TRL 1.16's GRPOTrainer.

Same tiny model (built locally), group size, prompt and completion lengths, fp32 (bf16=False), one
process; completions are forced to full length (no EOS: the reward ignores it and min_new_tokens is
not needed because the random model rarely emits EOS; lengths are reported). Each side runs warmup + N
steps; tokens/s = generated completion tokens / wall time of the steps.

    python bench/bench_grpo.py                       # CPU defaults: 8 prompts x 8 generations x 32 tokens
    python bench/bench_grpo.py --prompts 8 --generations 8 --completion 128 --steps 3 --hidden 256 --layers 4

Writes bench/results/grpo_<device>.json and prints the ratio ours / TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RL_NO_PROGRESS", "1")


def reward_len(prompts, completions, **kw):
    return [float(len(c) % 7) for c in completions]  # varied rewards so no group is degenerate


def run_ours(model_dir, prompts, a, out):
    from rl.config import build
    from rl.grpo import GRPOConfig, GRPOTrainer

    n = a.prompts * a.generations
    cfg = build(GRPOConfig, dict(model_name=model_dir, output_dir=out, learning_rate=1e-5, batch_size=n,
                                 num_generations=a.generations, max_completion_length=a.completion,
                                 max_length=a.completion + 64, max_steps=a.steps + 1, dtype="float32",
                                 report_to=["none"], lr_scheduler="constant"))
    t = GRPOTrainer(cfg, reward_funcs=[reward_len], train_prompts=[{"prompt": p} for p in prompts])
    h = t.train()
    timed = h[1:]
    tokens = sum(r["completions/mean_length"] * n for r in timed)
    secs = sum(r["step_time"] for r in timed)
    return {"tokens_per_s": tokens / secs, "s_per_step": secs / len(timed),
            "mean_length": sum(r["completions/mean_length"] for r in timed) / len(timed)}


def run_trl(model_dir, prompts, a, out):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    n = a.prompts * a.generations
    times, lengths = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.time()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.time() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = GRPOConfig(output_dir=out, bf16=False, per_device_train_batch_size=n, num_generations=a.generations,
                      max_completion_length=a.completion, max_steps=a.steps + 1, learning_rate=1e-5,
                      logging_steps=1, report_to=[], save_strategy="no", beta=0.0, use_cpu=True,
                      disable_tqdm=True, temperature=1.0)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_len], args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), callbacks=[Timer()])
    trainer.train()
    timed = times[1:]
    mean_len = sum(lengths[1:]) / max(len(lengths[1:]), 1) if len(lengths) > 1 else a.completion
    secs = sum(timed)
    return {"tokens_per_s": mean_len * n * len(timed) / secs, "s_per_step": secs / len(timed), "mean_length": mean_len}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args()
    import torch

    from rl.tiny import write_tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "model", hidden=a.hidden, layers=a.layers))
        prompts = [f"{i}+{j}=" for i in range(10) for j in range(10)][: a.prompts * (a.steps + 1)]
        ours = run_ours(model_dir, prompts, a, str(Path(tmp) / "ours"))
        trl = run_trl(model_dir, prompts, a, str(Path(tmp) / "trl"))
    result = {"device": device, "config": vars(a), "ours": ours, "trl": trl,
              "ratio_tokens_per_s": ours["tokens_per_s"] / trl["tokens_per_s"]}
    out = Path(__file__).resolve().parent / "results" / f"grpo_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"GRPO step, {a.prompts} prompts x {a.generations} generations x {a.completion} tokens, {device}: "
          f"ours {ours['tokens_per_s']:.0f} tok/s ({ours['s_per_step']:.2f} s/step), "
          f"TRL {trl['tokens_per_s']:.0f} tok/s ({trl['s_per_step']:.2f} s/step): ratio {result['ratio_tokens_per_s']:.2f}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
