"""Does GRPO improve a real pretrained model? Ours vs TRL 1.16's GRPOTrainer on SmolLM2-135M-Instruct, over seeds.

The task: chat-format sums ("What is 26 + 28?" as a user turn, data/smollm2/math_*.jsonl), reward 1 when
the last number of the answer is the sum, else 0. Both sides get the same model (the packaged
SmolLM2-135M-Instruct, converted by rl.models.gguf), the same LoRA (rank 8, alpha 16, dropout 0, peft's
"all-linear": every linear layer but the tied LM head), the same prompt token ids (the model's ChatML
template with its default system prompt and the assistant header, checked equal), the same reward function,
group size (4), completions per step (16, one micro-batch), completion length, sampling (temperature 1, no
top-k/top-p), learning rate with a constant schedule and no warmup, AdamW (betas 0.9/0.999, eps 1e-8, no
weight decay; fused, TRL's default `optim`), gradient clipping at 1.0, fp32, no gradient checkpointing
(TRL 1.16 defaults to it: recomputing activations would cost TRL time the other side does not spend), no
reference model (beta 0), one policy update per batch (num_iterations 1, so the clipped ratio is 1), group
mean/std advantages (TRL scale_rewards="group", std + 1e-4), token-mean loss over the step (TRL "dapo"),
completions masked after their first <|im_end|> (kept in the loss), truncated completions not masked.
What differs is only what each library does with its seed (prompt order, sampling noise).

Each (side, seed) trains in its own child process, interleaved (ours s0, trl s0, ours s1, ...), so each
one's wall time, CPU time and memory are its own and a drifting machine load hits both sides alike; each
saves a merged model. The parent scores the base model once and every merged model with one neutral
evaluator (`evaluate`: transformers' greedy `generate`, batched with left padding, on the first --eval-n
held-out problems of data/smollm2/math_test.jsonl, the same exact check), so neither side's evaluation code
is trusted. Accuracies are fractions of n_eval; gain = after - before.

    python bench/bench_real_grpo.py --steps 12 --lr 2e-4      # the README's runs: 3 seeds x 2 sides, 128 problems
    python bench/bench_real_grpo.py --steps 2 --eval-n 8 --seeds 0   # a quick check of the script
    python bench/bench_real_grpo.py --steps 12 --lr 2e-4 --sides ours,ours_vllm --out-json bench/results/real_grpo_vllm.json

Writes bench/results/real_grpo.json ({n_eval, ours: [runs], trl: [runs], ...}, each run {seed, before,
after, gain, seconds, ...}) and prints the markdown table of the README's "Real model" section.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
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
# rows per greedy generate call: the 128 held-out problems took 35 CPU s (1 thread) in one batch of 128, 37 s in
# 2 x 64 and ~34 s in 4 x 32 (measured 2026-12-02): batching past 32 rows buys nothing, 64 bounds the memory
EVAL_BATCH = 64


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
    return [{"question": f"What is {r['problem']}?", "answer": r["answer"], "a": int(r["problem"].split("+")[0]),
             "b": int(r["problem"].split("+")[1])} for r in rows]


def held_out(n: int) -> list[dict]:
    tests = problems(DATA / "math_test.jsonl")
    if n > len(tests):
        raise SystemExit(f"--eval-n {n}: data/smollm2/math_test.jsonl holds {len(tests)} problems")
    return tests[:n]


# ------------------------------------------------------------------------------------------ the sides
def run_ours(model_dir: str, a, out: str) -> dict:
    from rl.config.fields import build
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig

    cfg = build(GRPOConfig, dict(
        model_name=model_dir, output_dir=out, seed=a.seed, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_ratio=0.0, optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=a.steps, per_device_train_batch_size=a.prompts * a.generations, gradient_accumulation_steps=1,
        num_generations=a.generations, max_completion_length=a.completion, max_length=a.completion + 64,
        temperature=1.0, top_k=0, top_p=1.0, advantage_estimator="grpo", loss_aggregation="token_mean",
        epsilon_low=0.2, epsilon_high=0.2, num_iterations=1, beta=0.0, chat_template=True, dtype="float32",
        gradient_checkpointing=False, report_to=["none"], logging_steps=1, eval_steps=0, save_merged=True,
        lora={"enabled": True, "rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
        use_vllm=a.child == "ours_vllm"))  # side ours_vllm: the same run, rollouts from vLLM (needs vLLM)
    rows = [{"prompt": p["question"], "answer": p["answer"]} for p in problems(DATA / "math_train.jsonl")]
    trainer = GRPOTrainer(cfg, reward_funcs=[last_number_reward], train_prompts=rows)
    t0, c0 = time.time(), time.process_time()
    history = trainer.train()
    train_s, train_cpu = time.time() - t0, time.process_time() - c0
    trainer.save(str(Path(out) / "final"))
    rewards = [r["reward"] for r in history if "reward" in r]
    return {"train_s": train_s, "train_cpu_s": train_cpu, "reward_first": rewards[0], "reward_last": rewards[-1],
            "reward_mean": sum(rewards) / len(rewards), "model": str(Path(out) / "final" / "merged")}


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
                      lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", weight_decay=0.0,
                      adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                      gradient_checkpointing=False, max_steps=a.steps,
                      per_device_train_batch_size=a.prompts * a.generations, gradient_accumulation_steps=1,
                      num_generations=a.generations, max_completion_length=a.completion, temperature=1.0,
                      top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2,
                      num_iterations=1, mask_truncated_completions=False,
                      logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p["question"]}], "answer": p["answer"]}
                              for p in problems(DATA / "math_train.jsonl")])
    peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[last_number_reward], args=args, processing_class=tok,
                          train_dataset=data, peft_config=peft, callbacks=[Rewards()])
    t0, c0 = time.time(), time.process_time()
    trainer.train()
    train_s, train_cpu = time.time() - t0, time.process_time() - c0
    final = Path(out) / "final"
    trainer.model.merge_and_unload().save_pretrained(final, safe_serialization=True)
    tok.save_pretrained(final)
    return {"train_s": train_s, "train_cpu_s": train_cpu, "reward_first": rewards[0], "reward_last": rewards[-1],
            "reward_mean": sum(rewards) / len(rewards), "model": str(final)}


# ------------------------------------------------------------------------------------- the evaluator
def load_for_eval(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    return tok, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def chat_prompt(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def greedy_accuracy(tok, model, tests: list[dict], max_new_tokens: int, batch: int = EVAL_BATCH) -> float:
    """Held-out accuracy with greedy decoding (transformers' generate, left padding, chat template), in
    fixed chunks of `batch` problems so a model's score never depends on anything but the problems."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    scores = []
    for i in range(0, len(tests), batch):
        chunk = tests[i:i + batch]
        texts = [chat_prompt(tok, p["question"]) for p in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        completions = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        scores += last_number_reward(texts, completions, [p["answer"] for p in chunk])
    return sum(scores) / len(scores)


def evaluate(model_dir: str, n: int, max_new_tokens: int) -> float:
    tok, model = load_for_eval(model_dir)
    return greedy_accuracy(tok, model, held_out(n), max_new_tokens)


# ------------------------------------------------------------------------------------------ plumbing
def child(script: str, side: str, model_dir: str, a, seed: int, out: str, keys: tuple[str, ...]) -> dict:
    """One side and seed in a fresh process: its wall time (load + train + save), CPU time, peak memory (the
    child's own, `report_child`)."""
    cmd = [sys.executable, script, "--child", side, "--model-dir", model_dir, "--out", out, f"--seed={seed}",
           *[f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keys]]
    load = os.getloadavg()[0]
    t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall, r1 = time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{side} seed {seed} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": wall, "process_cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
            "load_before": load, "load_after": os.getloadavg()[0]}


def report_child(result: dict) -> None:
    """A child's last stdout line: its result and its own peak memory (RUSAGE_CHILDREN in the parent is the
    maximum over every child waited for so far, so it cannot tell one run's peak from an earlier one's)."""
    print(json.dumps({**result, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def summarize(result: dict, sides: list[str]) -> dict:
    """Mean and sample std (n - 1) of gain, mean training seconds per side; ours/TRL ratios of the means."""
    out = {}
    for side in sides:
        gains, secs = [r["gain"] for r in result[side]], [r["seconds"] for r in result[side]]
        cpu = [r["cpu_seconds"] for r in result[side]]
        out[side] = {"gain_mean": statistics.mean(gains),
                     "gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0,
                     "seconds_mean": statistics.mean(secs), "cpu_seconds_mean": statistics.mean(cpu)}
    if "ours" in out and "trl" in out:
        out["time_ratio"] = out["ours"]["seconds_mean"] / out["trl"]["seconds_mean"]
        out["cpu_time_ratio"] = out["ours"]["cpu_seconds_mean"] / out["trl"]["cpu_seconds_mean"]
    return out


def table(result: dict, sides: list[str], label: str, extra: dict | None = None) -> str:
    """The markdown table: mean +- std of gain (points), mean train seconds, ratio ours/TRL."""
    s, n = result["summary"], result["n_eval"]
    extra = extra or {}
    head = "| side | runs | held-out accuracy after (mean) | gain (mean +- std) |" + "".join(
        f" {k} |" for k in extra) + " train time (mean) | train CPU time (mean) |"
    lines = [f"base model: {100 * result['base']:.1f}% held-out accuracy on {n} problems ({label})", head,
             "|" + " --- |" * (head.count("|") - 1)]
    for side in sides:
        runs, m = result[side], s[side]
        after = statistics.mean(r["after"] for r in runs)
        cells = "".join(f" {fn(runs)} |" for fn in extra.values())
        lines.append(f"| {side} | {len(runs)} | {100 * after:.1f}% | {100 * m['gain_mean']:+.1f} +- "
                     f"{100 * m['gain_std']:.1f} points |{cells} {m['seconds_mean']:.0f} s | "
                     f"{m['cpu_seconds_mean']:.0f} s |")
    if "time_ratio" in s:
        lines.append(f"ours / TRL: train time {s['time_ratio']:.2f}x, train CPU time {s['cpu_time_ratio']:.2f}x")
    return "\n".join(lines)


def versions() -> dict:
    import peft
    import torch
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "peft": peft.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per side")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (group size)")
    # 48: at 24 most answers were cut before their number and 1-3% of completions were rewarded (2026-12-02)
    p.add_argument("--completion", type=int, default=48, help="max completion tokens (also the evaluator's)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (LoRA)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; each side runs once per seed")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # a child's seed
    p.add_argument("--eval-n", type=int, default=128, help="held-out problems scored (of 256)")
    p.add_argument("--sides", default="ours,trl", help="comma-separated: ours, trl, ours_vllm (ours with "
                   "use_vllm=true: the vLLM rollout engine, colocated)")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench-real-grpo"))
    p.add_argument("--keep-models", action="store_true", help="keep each run's merged model (517 MB each)")
    p.add_argument("--out-json", default=str(ROOT / "bench" / "results" / "real_grpo.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        report_child((run_ours if a.child in ("ours", "ours_vllm") else run_trl)(a.model_dir, a, a.out))
        return
    from rl.models.gguf import prepare_packaged

    sides, seeds = a.sides.split(","), [int(s) for s in a.seeds.split(",")]
    model_dir = str(prepare_packaged("smollm2-135m-instruct"))
    work = Path(a.workdir)
    t0 = time.time()
    base = evaluate(model_dir, a.eval_n, a.completion)
    result = {"n_eval": a.eval_n, "base": base, "base_eval_s": time.time() - t0, "config": vars(a),
              "versions": versions(), "load_start": os.getloadavg()[0], **{side: [] for side in sides}}
    for seed in seeds:
        for side in sides:
            run_dir = work / f"{side}-s{seed}"
            r = child(__file__, side, model_dir, a, seed, str(run_dir),
                      ("steps", "prompts", "generations", "completion", "lr"))
            t_eval = time.time()
            after = evaluate(r["model"], a.eval_n, a.completion)
            if not a.keep_models:
                shutil.rmtree(run_dir, ignore_errors=True)
            result[side].append({"seed": seed, "before": base, "after": after, "gain": after - base,
                                 "seconds": r.pop("train_s"), "cpu_seconds": r.pop("train_cpu_s"),
                                 "eval_s": time.time() - t_eval, **r})
            print(f"{side} seed {seed}: {100 * base:.1f}% -> {100 * after:.1f}% in {result[side][-1]['seconds']:.0f} s "
                  f"(load {r['load_before']:.1f})", flush=True)
    result["summary"] = summarize(result, sides)
    result["total_s"] = time.time() - t0
    out = Path(a.out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    label = f"{a.steps} steps x {a.prompts * a.generations} completions, lr {a.lr}, seeds {a.seeds}"
    print(table(result, sides, label, {"train reward first -> last (mean)": lambda runs: (
        f"{statistics.mean(r['reward_first'] for r in runs):.2f} -> "
        f"{statistics.mean(r['reward_last'] for r in runs):.2f}")}))
    print(f"wrote {out} (total {result['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
