"""Does GRPO improve a real pretrained model? Ours vs TRL 1.16's GRPOTrainer on SmolLM2-135M-Instruct.

The task: chat-format sums ("What is 26 + 28?" as a user turn, data/smollm2/math_*.jsonl), reward 1 when
the last number of the answer is the sum, else 0. Both sides get the same model (the packaged
SmolLM2-135M-Instruct, converted by rl.models.gguf), the same LoRA (rank 8, alpha 16, all linear layers), the
same prompts in the same chat template, the same reward function, group size, completions per step,
completion length, learning rate, temperature and number of optimizer steps, fp32, no reference model
(beta 0), token-level loss. Each side trains in its own child process (so each one's wall time and
memory are its own) and saves a merged model; the parent then scores the base model and both trained
models with one neutral evaluator (transformers' greedy `generate` on the held-out problems, the same
exact check), so neither side's evaluation code is trusted.

    python bench/bench_real_grpo.py                     # 2-core CPU default: 24 steps x 16 completions
    python bench/bench_real_grpo.py --steps 4 --eval-n 8 --sides ours   # a quick check of the script

Writes bench/results/real_grpo_<device>.json and prints the table of the README's "Real model" section.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RL_NO_PROGRESS", "1")

DATA = ROOT / "data" / "smollm2"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_reward(prompts, completions, answer, **kw) -> list[float]:
    """1.0 when the completion's last number equals the answer (TRL's reward-function signature)."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[-1]["content"]  # TRL passes messages for chat prompts
        nums = NUMBER.findall(text)
        out.append(1.0 if nums and float(nums[-1]) == float(a) else 0.0)
    return out


def problems(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"question": f"What is {r['problem']}?", "answer": r["answer"]} for r in rows]


# ------------------------------------------------------------------------------------------ the sides
def run_ours(model_dir: str, a, out: str) -> dict:
    from rl.config.fields import build
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig

    cfg = build(GRPOConfig, dict(
        model_name=model_dir, output_dir=out, seed=a.seed, learning_rate=a.lr, lr_scheduler="constant",
        max_steps=a.steps, batch_size=a.prompts * a.generations, num_generations=a.generations,
        max_completion_length=a.completion, max_length=a.completion + 64, temperature=1.0,
        advantage_estimator="grpo", loss_aggregation="token_mean", beta=0.0, chat_template=True,
        dtype="float32", report_to=["none"], log_every=1, eval_every=0,
        lora={"enabled": True, "rank": 8, "alpha": 16, "dropout": 0.0}))
    rows = [{"prompt": p["question"], "answer": p["answer"]} for p in problems(DATA / "math_train.jsonl")]
    trainer = GRPOTrainer(cfg, reward_funcs=[last_number_reward], train_prompts=rows)
    t0 = time.time()
    history = trainer.train()
    train_s = time.time() - t0
    trainer.save(str(Path(out) / "final"))
    rewards = [r["reward"] for r in history if "reward" in r]
    return {"train_s": train_s, "reward_first": rewards[0], "reward_last": rewards[-1],
            "reward_mean": sum(rewards) / len(rewards), "model": str(Path(out) / "final")}


def run_trl(model_dir: str, a, out: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rewards = []

    class Rewards(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GRPOConfig(output_dir=out, seed=a.seed, bf16=False, use_cpu=True, learning_rate=a.lr,
                      lr_scheduler_type="constant", warmup_steps=0, max_steps=a.steps,
                      per_device_train_batch_size=a.prompts * a.generations, num_generations=a.generations,
                      max_completion_length=a.completion, temperature=1.0, beta=0.0, loss_type="dapo",
                      logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p["question"]}], "answer": p["answer"]}
                              for p in problems(DATA / "math_train.jsonl")])
    peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[last_number_reward], args=args, processing_class=tok,
                          train_dataset=data, peft_config=peft, callbacks=[Rewards()])
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    final = Path(out) / "final"
    trainer.model.merge_and_unload().save_pretrained(final, safe_serialization=True)
    tok.save_pretrained(final)
    return {"train_s": train_s, "reward_first": rewards[0], "reward_last": rewards[-1],
            "reward_mean": sum(rewards) / len(rewards), "model": str(final)}


# ------------------------------------------------------------------------------------- the evaluator
def evaluate(model_dir: str, n: int, max_new_tokens: int) -> float:
    """Held-out accuracy with greedy decoding (transformers' generate, left padding, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tests = problems(DATA / "math_test.jsonl")[:n]
    texts = [tok.apply_chat_template([{"role": "user", "content": p["question"]}], tokenize=False,
                                     add_generation_prompt=True) for p in tests]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    completions = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = last_number_reward(texts, completions, [p["answer"] for p in tests])
    return sum(scores) / len(scores)


def child(side: str, model_dir: str, a, out: str) -> dict:
    """One side in a fresh process: its wall time (load + train + save) and its own numbers."""
    cmd = [sys.executable, __file__, "--child", side, "--model-dir", model_dir, "--out", out,
           *[f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
             if k in ("steps", "prompts", "generations", "completion", "lr", "seed")]]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": wall}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per side")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (group size)")
    p.add_argument("--completion", type=int, default=24, help="max completion tokens")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (LoRA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-n", type=int, default=32, help="held-out problems scored (of 32)")
    p.add_argument("--sides", default="ours,trl", help="comma-separated: ours, trl")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench-real-grpo"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        result = (run_ours if a.child == "ours" else run_trl)(a.model_dir, a, a.out)
        print(json.dumps(result))
        return
    import torch

    from rl.models.gguf import prepare_packaged

    model_dir = str(prepare_packaged("smollm2-135m-instruct"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(a.workdir)
    result = {"device": device, "threads": torch.get_num_threads(), "config": vars(a),
              "base_accuracy": evaluate(model_dir, a.eval_n, a.completion)}
    for side in a.sides.split(","):
        r = child(side, model_dir, a, str(work / side))
        r["accuracy"] = evaluate(r["model"], a.eval_n, a.completion)
        r["gain_points"] = 100 * (r["accuracy"] - result["base_accuracy"])
        result[side] = r
    if "ours" in result and "trl" in result:
        result["ratio_wall"] = result["ours"]["wall_s"] / result["trl"]["wall_s"]
        result["ratio_train_time"] = result["ours"]["train_s"] / result["trl"]["train_s"]
    out = ROOT / "bench" / "results" / f"real_grpo_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"held-out accuracy of the base model: {100 * result['base_accuracy']:.1f}% ({a.eval_n} problems)")
    print("| side | steps | accuracy after | gain | train reward first -> last | train time | wall time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for side in a.sides.split(","):
        r = result[side]
        print(f"| {side} | {a.steps} | {100 * r['accuracy']:.1f}% | {r['gain_points']:+.1f} points | "
              f"{r['reward_first']:.2f} -> {r['reward_last']:.2f} | {r['train_s']:.0f} s | {r['wall_s']:.0f} s |")
    if "ratio_wall" in result:
        print(f"ours / TRL: wall time {result['ratio_wall']:.2f}x, train time {result['ratio_train_time']:.2f}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
