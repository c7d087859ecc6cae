"""Asynchronous rollouts (issue 41) on a real model: GRPO on SmolLM2-135M-Instruct (LoRA, 4 prompts x 4
generations, 64 new tokens), the task and the neutral held-out evaluator of bench/bench_real_grpo.py.

Speed: the synchronous run (1 process, max_staleness=0, 2 intra-op threads) against 1 rollout + 1 training
process (`accelerate launch --num_processes 2`, rollout_processes=1 max_staleness=1, 1 thread each) on the same 2
cores. Reported: steps/s of each and their ratio; per step of the 2-process run the rollout process's generation
time, the trainer's training time, each side's waiting, and the overlap efficiency
max(generation, training) / step time (1.0: perfect overlap); the first step is left out (start-up).
Learning: max_staleness k = 0, 1, 2 in one process (the same schedule as rollout processes, so the same learning),
over seeds; held-out gain = accuracy after - before, mean and sample std per k.

    python bench/bench_async.py                                    # both parts, 3 seeds, ~1 h on 2 idle cores
    python bench/bench_async.py --steps 2 --seeds 0 --eval-n 8 --parts speed,learning   # a quick check

Writes bench/results/async_grpo.json. On 2 shared cores the timings are only as clean as the machine is idle
(the load average before and after each run is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RL_NO_PROGRESS", "1")

import bench_real_grpo as real  # noqa: E402 - the task, its reward and the evaluator


def run_child(a) -> None:
    """One run (inside a child process, under accelerate launch for rollout_processes): metrics rows out."""
    import torch

    from rl.config.fields import build
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig

    torch.set_num_threads(a.threads)
    cfg = build(GRPOConfig, dict(
        model_name=a.model_dir, output_dir=a.out, seed=a.seed, learning_rate=a.lr, lr_scheduler="constant",
        warmup_ratio=0.0, weight_decay=0.0, max_grad_norm=1.0, max_steps=a.steps,
        per_device_train_batch_size=a.prompts * a.generations, gradient_accumulation_steps=1, num_generations=a.generations,
        max_completion_length=a.completion, max_length=a.completion + 64, temperature=1.0, beta=0.0,
        epsilon=0.2, epsilon_high=0.2, chat_template=True, dtype="float32", report_to=["none"], logging_steps=1,
        eval_steps=0, save_merged=True, overwrite=True, max_staleness=a.k, rollout_processes=a.rollout_processes,
        lora={"enabled": True, "rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}))
    rows = [{"prompt": p["question"], "answer": p["answer"]} for p in real.problems(real.DATA / "math_train.jsonl")]
    trainer = GRPOTrainer(cfg, reward_funcs=[real.last_number_reward], train_prompts=rows)
    t0 = time.time()
    history = trainer.train()
    train_s = time.time() - t0
    if a.save:
        trainer.save(str(Path(a.out) / "final"))
    if trainer.accelerator.is_main_process:
        keep = ("step", "reward", "step_time", "time/generation", "time/training", "time/train", "time/waiting_trainer",
                "time/waiting_rollout", "async/staleness")
        print(json.dumps({"train_s": train_s, "model": str(Path(a.out) / "final" / "merged"),
                          "rows": [{k: r[k] for k in keep if k in r} for r in history if "reward" in r]}))


def child(a, out: str, seed: int, k: int, procs: int, threads: int, save: bool) -> dict:
    args = [str(Path(__file__)), "--child", "--model-dir", a.model_dir, "--out", out, f"--seed={seed}", f"--k={k}",
            f"--rollout-processes={procs}", f"--threads={threads}", f"--steps={a.steps}", f"--lr={a.lr}",
            f"--prompts={a.prompts}", f"--generations={a.generations}", f"--completion={a.completion}"]
    args += ["--save"] if save else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    if procs:
        cmd = ["env", "ACCELERATE_USE_CPU=true", sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", str(procs + 1), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", str(29_400 + seed), *args]
    else:
        cmd = [sys.executable, *args]
    load, t0 = os.getloadavg()[0], time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"run k={k} procs={procs} seed={seed} failed:\n{proc.stderr[-4000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith('{"train_s"')][-1]
    return {**json.loads(line), "wall_s": time.time() - t0, "load_before": load, "load_after": os.getloadavg()[0]}


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows[1:] if key in r]  # the first step pays start-up
    return statistics.mean(vals) if vals else 0.0


def speed(a) -> dict:
    sync = child(a, str(Path(a.workdir) / "sync"), 0, 0, 0, 2, False)
    procs = child(a, str(Path(a.workdir) / "procs"), 0, 1, 1, 1, False)
    s_step, p_step = mean(sync["rows"], "step_time"), mean(procs["rows"], "step_time")
    gen, train = mean(procs["rows"], "time/generation"), mean(procs["rows"], "time/training")
    return {"sync": {"step_s": s_step, "generation_s": mean(sync["rows"], "time/generation"),
                     "training_s": mean(sync["rows"], "time/train"), "load": [sync["load_before"], sync["load_after"]]},
            "procs": {"step_s": p_step, "generation_s": gen, "training_s": train,
                      "waiting_trainer_s": mean(procs["rows"], "time/waiting_trainer"),
                      "waiting_rollout_s": mean(procs["rows"], "time/waiting_rollout"),
                      "load": [procs["load_before"], procs["load_after"]]},
            "steps_per_s_procs_over_sync": s_step / p_step if p_step else 0.0,
            "overlap_efficiency": max(gen, train) / p_step if p_step else 0.0}


def learning(a) -> dict:
    base = real.evaluate(a.model_dir, a.eval_n, a.completion)
    out = {"base": base, "n_eval": a.eval_n}
    for k in (0, 1, 2):
        runs = []
        for seed in [int(s) for s in a.seeds.split(",")]:
            r = child(a, str(Path(a.workdir) / f"k{k}-s{seed}"), seed, k, 0, 2, True)
            after = real.evaluate(r["model"], a.eval_n, a.completion)
            runs.append({"seed": seed, "after": after, "gain": after - base, "train_s": r["train_s"]})
            print(f"k={k} seed {seed}: {100 * base:.1f}% -> {100 * after:.1f}%", flush=True)
        gains = [r["gain"] for r in runs]
        out[f"k{k}"] = {"runs": runs, "gain_mean": statistics.mean(gains),
                        "gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--eval-n", type=int, default=128)
    p.add_argument("--parts", default="speed,learning")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench-async"))
    p.add_argument("--out-json", default=str(ROOT / "bench" / "results" / "async_grpo.json"))
    for hidden in ("--model-dir", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden, kind in (("--seed", int), ("--k", int), ("--rollout-processes", int), ("--threads", int)):
        p.add_argument(hidden, type=kind, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return run_child(a)
    from rl.models.gguf import prepare_packaged

    a.model_dir = str(prepare_packaged("smollm2-135m-instruct"))
    t0, parts = time.time(), a.parts.split(",")
    result = {"config": {k: v for k, v in vars(a).items() if k not in ("child", "save")}}
    if "speed" in parts:
        result["speed"] = speed(a)
        print(json.dumps(result["speed"], indent=2), flush=True)
    if "learning" in parts:
        result["learning"] = learning(a)
    result["total_s"] = time.time() - t0
    out = Path(a.out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} (total {result['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
