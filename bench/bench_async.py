"""Asynchronous rollouts on a real model, where synchronous GRPO learns: SmolLM2-135M-Instruct, LoRA r8, the chat
sums of data/smollm2/, 4 prompts x 4 generations, 48 new tokens, 12 steps, lr 2e-4 (bench/bench_real_grpo.py's
setting: synchronous GRPO gained +12.6 +- 8.0 points there over 6 seeds), its neutral held-out evaluator (greedy,
48 new tokens, 128 problems).

Learning (`--parts learning,vllm`): held-out gain = accuracy after - before, per seed, for max_staleness k in
`--ks` with our sampler (in the training process: the same schedule as rollout processes, so the same learning)
and k in `--vllm-ks` with a vLLM server (`rl vllm-serve` in the vLLM venv, `use_vllm=true vllm_mode=server`; one
server per run); mean and sample std per row. Phase times per run (steps after the first): G = time/generation,
T = the trainer's time per step besides generating and waiting (step_time - time/generation for k = 0), and the
bound (G + T) / max(G, T) a step could shrink by when the two overlap on separate devices.
Speed (`--parts speed`): the synchronous run against 1 rollout + 1 training process (`accelerate launch
--num_processes 2`, rollout_processes=1 max_staleness=1) on the same cores.

    python bench/bench_async.py --parts learning,vllm --seeds 0,1,2     # ~1.5 h on 2 idle cores
    python bench/bench_async.py --parts learning --ks 0 --seeds 0 --steps 2 --eval-n 8   # a quick check

Every finished run is written at once to `--out-json` (default bench/results/async_grpo_learning.json) and a run
already there (same part, k and seed) is not run again, so an interrupted invocation continues where it stopped.
On shared cores the timings are only as clean as the machine is idle (the load average around each run is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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

KEEP = ("step", "reward", "step_time", "time/generation", "time/training", "time/train", "time/waiting_trainer",
        "time/waiting_rollout", "time/weight_sync", "async/staleness", "sampling/sampling_logp_difference/mean")


def run_child(a) -> None:
    """One training run (a child process; under accelerate launch for rollout_processes): its rows out."""
    import torch

    from rl.config.fields import build
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig

    torch.set_num_threads(a.threads)
    server = dict(use_vllm=True, vllm_mode="server", vllm_server_port=a.port, vllm_group_port=a.group_port,
                  vllm_server_timeout=900.0) if a.port else {}
    # bench_real_grpo.run_ours's configuration, plus the asynchronous keys
    cfg = build(GRPOConfig, dict(
        model_name=a.model_dir, output_dir=a.out, seed=a.seed, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_ratio=0.0, optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=1.0, max_steps=a.steps,
        per_device_train_batch_size=a.prompts * a.generations, gradient_accumulation_steps=1,
        num_generations=a.generations, max_completion_length=a.completion, max_length=a.completion + 64,
        temperature=1.0, top_k=0, top_p=1.0, advantage_estimator="grpo", loss_aggregation="token_mean",
        epsilon_low=0.2, epsilon_high=0.2, num_iterations=1, beta=0.0, chat_template=True, dtype="float32",
        gradient_checkpointing=False, report_to=["none"], logging_steps=1, eval_steps=0, save_merged=True,
        overwrite=True, max_staleness=a.k, rollout_processes=a.rollout_processes, rollout_dtype=a.rollout_dtype,
        lora={"enabled": True, "rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}, **server))
    rows = [{"prompt": p["question"], "answer": p["answer"]} for p in real.problems(real.DATA / "math_train.jsonl")]
    trainer = GRPOTrainer(cfg, reward_funcs=[real.last_number_reward], train_prompts=rows)
    t0 = time.time()
    history = trainer.train()
    train_s = time.time() - t0
    if a.save:
        trainer.save(str(Path(a.out) / "final"))
    if trainer.accelerator.is_main_process:
        print(json.dumps({"train_s": train_s, "model": str(Path(a.out) / "final" / "merged"),
                          "rows": [{k: r[k] for k in KEEP if k in r} for r in history if "reward" in r]}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(a, seed: int, log: Path) -> tuple[subprocess.Popen, int, int]:
    """`rl vllm-serve` on the model, in the vLLM venv, with this checkout's `rl`."""
    port, group = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(a.threads)}
    proc = subprocess.Popen([a.vllm_python, "-m", "rl.rollout.vllm_server", "--model", a.model_dir, "--host",
                             "127.0.0.1", "--port", str(port), "--group-port", str(group), "--max-model-len",
                             str(a.completion + 64), f"--seed={seed}"], cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    return proc, port, group


def child(a, out: str, seed: int, k: int, procs: int = 0, vllm: bool = False, save: bool = True) -> dict:
    args = [str(Path(__file__)), "--child", "--model-dir", a.model_dir, "--out", out, f"--seed={seed}", f"--k={k}",
            f"--rollout-processes={procs}", f"--threads={a.threads if not procs else 1}", f"--steps={a.steps}",
            f"--lr={a.lr}", f"--prompts={a.prompts}", f"--generations={a.generations}", f"--completion={a.completion}",
            f"--rollout-dtype={a.rollout_dtype}"]
    args += ["--save"] if save else []
    server = None
    if vllm:
        Path(out).mkdir(parents=True, exist_ok=True)
        server, port, group = start_server(a, seed, Path(out) / "server.log")
        args += [f"--port={port}", f"--group-port={group}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(a.threads if not procs else 1)}
    if procs:
        cmd = ["env", "ACCELERATE_USE_CPU=true", sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", str(procs + 1), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", str(29_400 + seed), *args]
    else:
        cmd = [sys.executable, *args]
    load, t0 = os.getloadavg()[0], time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        if server is not None:
            server.kill()
            server.wait(60)
    if proc.returncode != 0:
        raise SystemExit(f"run k={k} procs={procs} vllm={vllm} seed={seed} failed:\n{proc.stderr[-4000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith('{"train_s"')][-1]
    return {**json.loads(line), "wall_s": time.time() - t0, "load_before": load, "load_after": os.getloadavg()[0]}


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows[1:] if key in r]  # the first step pays start-up
    return statistics.mean(vals) if vals else 0.0


def phases(rows: list[dict], k: int) -> dict:
    """Mean seconds per step after the first: generation (in this process, or the server's), step, waiting, the
    training phase, the weight push. For k = 0 (nothing overlaps) also G, T (the trainer's own work per step:
    step time minus generating; k = 0 is the synchronous loop, whichever engine samples) and the bound
    (G + T) / max(G, T) on how much a step could shrink with the two on separate devices."""
    g, step, wait = mean(rows, "time/generation"), mean(rows, "step_time"), mean(rows, "time/waiting_trainer")
    out = {"generation_s": g, "step_s": step, "waiting_s": wait,
           "training_s": mean(rows, "time/training") or mean(rows, "time/train"),
           "weight_sync_s": mean(rows, "time/weight_sync")}
    if k == 0:
        t = step - g
        out.update(G_s=g, T_s=t, bound=(g + t) / max(g, t, 1e-9))
    return out


def speed(a) -> dict:
    sync = child(a, str(Path(a.workdir) / "sync"), 0, 0, save=False)
    procs = child(a, str(Path(a.workdir) / "procs"), 0, 1, procs=1, save=False)
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


def summarize(runs: list[dict]) -> dict:
    gains = [r["gain"] for r in runs]
    return {"n": len(runs), "gain_mean": statistics.mean(gains),
            "gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0,
            **{f"{key}_mean": statistics.mean(r["phases"][key] for r in runs) for key in runs[0]["phases"]}}


def learning(a, result: dict, out: Path) -> None:
    """Every (sampler, k, seed) not in `result` yet: train, evaluate, write `out` at once (seed by seed)."""
    if "base" not in result:
        result["base"] = real.evaluate(a.model_dir, a.eval_n, a.completion)
        out.write_text(json.dumps(result, indent=2))
    rows = result.setdefault("rows", {})
    for name, row in rows.items():  # the k = 0 phases again from their stored times (an earlier T was step - wait)
        for run in row["runs"]:
            ph = run["phases"]
            if "G_s" in ph:
                ph.update(T_s=ph["step_s"] - ph["generation_s"])
                ph["bound"] = (ph["G_s"] + ph["T_s"]) / max(ph["G_s"], ph["T_s"], 1e-9)
        row.update(summarize(row["runs"]))
    plan = [("ours", k) for k in a.ks.split(",") if "learning" in a.parts] + \
           [("vllm", k) for k in a.vllm_ks.split(",") if "vllm" in a.parts]
    for seed in [int(s) for s in a.seeds.split(",")]:  # seed by seed: an interrupted grid has whole seeds
        for sampler, k in plan:
            runs = rows.setdefault(f"{sampler} k={k}", {"runs": []})["runs"]
            if any(r["seed"] == seed for r in runs):
                continue
            r = child(a, str(Path(a.workdir) / f"{sampler}-k{k}-s{seed}"), seed, int(k), vllm=sampler == "vllm")
            after = real.evaluate(r["model"], a.eval_n, a.completion)
            shutil.rmtree(Path(a.workdir) / f"{sampler}-k{k}-s{seed}", ignore_errors=True)  # ~0.6 GB a model
            runs.append({"seed": seed, "after": after, "gain": after - result["base"], "train_s": r["train_s"],
                         "phases": phases(r["rows"], int(k)), "load": [r["load_before"], r["load_after"]],
                         "rewards": [row["reward"] for row in r["rows"]]})
            rows[f"{sampler} k={k}"].update(summarize(runs))
            print(f"{sampler} k={k} seed {seed}: {100 * result['base']:.1f}% -> {100 * after:.1f}% "
                  f"({json.dumps({x: round(v, 2) for x, v in runs[-1]['phases'].items()})})", flush=True)
            out.write_text(json.dumps(result, indent=2))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--completion", type=int, default=48)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--ks", default="0,1,2", help="max_staleness values with our sampler")
    p.add_argument("--vllm-ks", default="0,1", help="max_staleness values with the vLLM server")
    p.add_argument("--eval-n", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rollout-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="our sampler's linears (GRPO's rollout_dtype); bfloat16 needs a CPU with bf16 instructions")
    p.add_argument("--parts", default="learning,vllm", help="learning, vllm, speed (comma-separated)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                   help="the python of the venv that has vLLM (the server runs there)")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench-async"))
    p.add_argument("--out-json", default=str(ROOT / "bench" / "results" / "async_grpo_learning.json"))
    for hidden in ("--model-dir", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--seed", "--k", "--rollout-processes", "--port", "--group-port"):
        p.add_argument(hidden, type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return run_child(a)
    from rl.models.gguf import prepare_packaged

    a.model_dir = str(prepare_packaged("smollm2-135m-instruct"))
    out = Path(a.out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if out.exists() else {}
    config = {k: getattr(a, k) for k in ("steps", "prompts", "generations", "completion", "lr", "eval_n", "threads")}
    if a.rollout_dtype != "float32":  # (float32 runs stored before the key existed stay comparable)
        config["rollout_dtype"] = a.rollout_dtype
    if result.get("config", config) != config:
        raise SystemExit(f"{out} holds runs of another configuration; pass another --out-json")
    result["config"] = config
    t0 = time.time()
    if "speed" in a.parts:
        result["speed"] = speed(a)
        print(json.dumps(result["speed"], indent=2), flush=True)
    if "learning" in a.parts or "vllm" in a.parts:
        learning(a, result, out)
    result["last_invocation_s"] = time.time() - t0
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} ({result['last_invocation_s']:.0f} s)")


if __name__ == "__main__":
    main()
