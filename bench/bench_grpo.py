"""Completion tokens/s of a GRPO step: ours (rl.trainers.grpo.GRPOTrainer) vs TRL 1.16's GRPOTrainer, side by side.

Same tiny model (built locally), prompts, group size, micro-batches and maximum completion length, fp32
(TRL gets bf16=False), beta 0, one process, temperature 1, no top-k/top-p on either side. Each side runs
in its own child process (`bench/harness.py`), the sides alternate for `--rounds` rounds so that a busy
machine slows them alike; in each run the first `--warmup` steps are not timed. A step is the interval
between consecutive optimizer-step ends (rollout, rewards, training forwards and backwards, optimizer),
timed the same way on both sides, as wall time and as process CPU time (all threads; on a shared
machine the steadier figure). Round r uses seed r on both sides, so every round adds new completions.
tokens/s = completion tokens generated in the timed steps (EOS included, as both trainers count them) /
their summed time. Both sides run with --threads torch threads (default 1, see --help).

Two settings (`--lengths`):

    fixed   (default) every completion runs to --completion tokens: the random model almost never
            emits EOS, so both sides generate exactly prompts x generations x completion tokens.
    uneven  completions of widely varying length, 1 .. --completion tokens, geometric (long-tailed):
            the model is edited so that its per-token probability of EOS is a constant --stop-prob
            whatever the context (`stop_bias_model`), so both sides draw their lengths from the same
            distribution by construction, not by luck. The lengths each side actually produced are
            reported (mean, quantiles, per-step max); their means differ only by sampling noise (a few
            % with a few hundred completions per side), and the script says so when they do not.

    real    the real model SmolLM2-135M-Instruct (`--model`, default smollm2-135m-instruct): the chat sums
            of data/smollm2/math_train.jsonl as user turns in the chat template on both sides, reward 1
            when the answer's last number is the sum (bench/bench_real_grpo.py's), LoRA rank `--lora`
            (default 8, alpha 2r, all linear layers) on both sides, token-level loss on both (ours
            token_mean, TRL loss_type="dapo"), `--beta` (0: no reference; > 0: the adapter-free model
            is the reference on both sides). Lengths are the model's own (it stops at <|im_end|>).

    python bench/bench_grpo.py                                        # fixed: 8 prompts x 8 generations x 32
    python bench/bench_grpo.py --lengths real --prompts 4 --generations 4 --completion 64 --threads 2 \
        --rounds 3 --beta 0.04                                        # the real model, issue 27's setting
    python bench/bench_grpo.py --lengths uneven                       # uneven: 1..256 tokens, mean ~48, 4 micro-batches
    python bench/bench_grpo.py --lengths uneven --rounds 3 --steps 6  # more completions per side, steadier means

Writes bench/results/grpo_<setting>-<time>.json (gitignored) and prints the ratio ours / TRL.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RL_NO_PROGRESS", "1")

from bench import harness  # noqa: E402

STOP_DIM_VALUE = 4.0  # the constant residual coordinate of `stop_bias_model` (see there)


def reward_len(prompts, completions, **kw):
    return [float(len(c) % 7) for c in completions]  # varied rewards so no group is degenerate


# ------------------------------------------------------------------------------ the uneven-lengths model

def stop_bias_model(src: str, dst: str, stop_prob: float, value: float = STOP_DIM_VALUE) -> str:
    """Copy the tiny Llama at `src` to `dst`, edited so that P(EOS | any context) ~= stop_prob.

    An LM head has no bias, so the edit makes one: residual coordinate 0 is set to the constant
    `value` for every input token (column 0 of the tied embedding) and no layer writes to it (row 0 of
    every o_proj and down_proj is zeroed), so x_0 = value at every position. The final RMSNorm then
    gives h_0 = g_0 * value * sqrt(D) / ||x|| * ... ~= g_0 * sqrt(D) (x_0 dominates ||x||: the other
    coordinates are ~0.02-scale), and the logit of token v is E[v, 0] * h_0 + E[v, 1:] . h_1: with
    E[v, 0] = value for every token but EOS, and E[eos, 0] = value + b / (g_0 sqrt(D)), EOS gets a
    constant extra logit b = log(p / (1 - p) * (V - 1)) over the (near-uniform) rest. A completion's
    length is then geometric: P(L = k) = p (1 - p)^(k-1), mean ~1/p, truncated at the maximum length.
    EOS as an input only ever ends a completion, so its own embedding change reaches no later token.
    Measured on the default tiny model (value 4, p = 1/48, random contexts): P(EOS) 0.0205-0.0216."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if not model.config.tie_word_embeddings:
        raise ValueError("stop_bias_model expects tied embeddings (the tiny Llama's)")
    eos, V, D = model.config.eos_token_id, model.config.vocab_size, model.config.hidden_size
    with torch.no_grad():
        E = model.model.embed_tokens.weight
        E[:, 0] = value
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        b = math.log(stop_prob / (1 - stop_prob) * (V - 1))
        E[eos, 0] = value + b / (float(model.model.norm.weight[0]) * math.sqrt(D))
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def measured_stop_prob(model_dir: str, rows: int = 16, length: int = 256, seed: int = 0) -> dict:
    """P(EOS) at every position of random byte contexts: min / mean / max (checks the edit)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 259, (rows, length), generator=g)
    ids[:, 0] = model.config.bos_token_id
    with torch.no_grad():
        p = model(input_ids=ids).logits.softmax(-1)[..., model.config.eos_token_id]
    return {"min": float(p.min()), "mean": float(p.mean()), "max": float(p.max())}


# ------------------------------------------------------------------------------ the sides (child processes)

def _threads(spec) -> None:
    import torch

    torch.set_num_threads(spec["threads"])


def _prompts(spec) -> list[str]:
    n = spec["prompts"] * (spec["steps"] + spec["warmup"])
    return [f"{i}+{j}=" for i in range(100) for j in range(100)][:n]


def _real_rows(spec) -> list[dict]:
    """The real setting's prompts: the chat sums (question, answer), as many as the run needs."""
    from bench.bench_real_grpo import DATA, problems

    rows = problems(DATA / "math_train.jsonl")
    n = spec["prompts"] * (spec["steps"] + spec["warmup"])
    return [rows[i % len(rows)] for i in range(n)]


def side_ours(spec) -> dict:
    """Our trainer; the rollout's per-completion lengths are recorded by wrapping the sampler."""
    import rl.trainers.grpo as grpo
    from rl.config.fields import build

    _threads(spec)
    n, micro = spec["prompts"] * spec["generations"], spec["micro"]
    lengths: list[list[int]] = []
    sampler = grpo.generate

    def recording_generate(*args, **kw):
        rollout = sampler(*args, **kw)
        lengths.append(rollout.lengths.tolist())
        return rollout

    grpo.generate = recording_generate
    real = spec["lengths"] == "real"
    extra = dict(chat_template=True, loss_aggregation="token_mean",
                 lora={"enabled": True, "rank": spec["lora"], "alpha": 2 * spec["lora"], "dropout": 0.0}
                 if spec["lora"] else {"enabled": False}) if real else {}
    cfg = build(grpo.GRPOConfig, dict(
        model_name=spec["model_dir"], output_dir=spec["out"] + "/ours", learning_rate=1e-5, per_device_train_batch_size=n // micro,
        gradient_accumulation_steps=micro, num_generations=spec["generations"],
        max_completion_length=spec["completion"], max_length=spec["completion"] + 64,
        max_steps=spec["steps"] + spec["warmup"], dtype="float32", report_to=["none"], lr_scheduler_type="constant",
        beta=spec["beta"], temperature=1.0, seed=spec["seed"], gradient_checkpointing=spec["gc"], **extra))
    if real:
        from bench.bench_real_grpo import last_number_reward

        rows = [{"prompt": r["question"], "answer": r["answer"]} for r in _real_rows(spec)]
        t = grpo.GRPOTrainer(cfg, reward_funcs=[last_number_reward], train_prompts=rows)
    else:
        t = grpo.GRPOTrainer(cfg, reward_funcs=[reward_len], train_prompts=[{"prompt": p} for p in _prompts(spec)])
    ends = [(time.time(), time.process_time())]
    step = t.train_step

    def timed_step():
        rows = step()
        ends.append((time.time(), time.process_time()))
        return rows

    t.train_step = timed_step
    t.train()
    return _side_result(ends, lengths)


def side_trl(spec) -> dict:
    """TRL 1.16's GRPOTrainer; per-completion lengths from the reward function's completion_ids."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    _threads(spec)
    n, micro = spec["prompts"] * spec["generations"], spec["micro"]
    lengths: list[list[int]] = []
    ends = [(time.time(), time.process_time())]

    real = spec["lengths"] == "real"

    def reward(prompts, completions, completion_ids=None, **kw):
        lengths.append([len(c) for c in completion_ids])
        if real:
            from bench.bench_real_grpo import last_number_reward

            return last_number_reward(prompts, completions, kw["answer"])
        return reward_len(prompts, completions)

    class StepEnds(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends[0] = (time.time(), time.process_time())

        def on_step_end(self, args, state, control, **kw):
            ends.append((time.time(), time.process_time()))

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    args = GRPOConfig(output_dir=spec["out"] + "/trl", bf16=False, per_device_train_batch_size=n // micro,
                      gradient_accumulation_steps=micro, num_generations=spec["generations"],
                      max_completion_length=spec["completion"], max_steps=spec["steps"] + spec["warmup"],
                      learning_rate=1e-5, logging_steps=1, report_to=[], save_strategy="no",
                      use_cpu=True, disable_tqdm=True, temperature=1.0, top_k=0, top_p=1.0,
                      lr_scheduler_type="constant", seed=spec["seed"], beta=spec["beta"],
                      gradient_checkpointing=spec["gc"],  # TRL's default is on; the same setting on both sides
                      **({"loss_type": "dapo"} if real else {}))
    peft = None
    if real:
        data = [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in _real_rows(spec)]
        if spec["lora"]:
            from peft import LoraConfig

            peft = LoraConfig(r=spec["lora"], lora_alpha=2 * spec["lora"], lora_dropout=0.0,
                              target_modules="all-linear", task_type="CAUSAL_LM")
    else:
        data = [{"prompt": p} for p in _prompts(spec)]
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_list(data), peft_config=peft, callbacks=[StepEnds()])
    trainer.train()
    return _side_result(ends, lengths)


def _side_result(ends: list[tuple[float, float]], lengths: list[list[int]]) -> dict:
    """Per-step wall / CPU times (consecutive step ends) and completion lengths, for harness.run_side."""
    wall = [b[0] - a[0] for a, b in zip(ends, ends[1:])]
    cpu = [b[1] - a[1] for a, b in zip(ends, ends[1:])]
    return {"step_times": wall, "step_cpu_times": cpu, "step_lengths": lengths}


SIDES = {"ours": side_ours, "trl": side_trl}


# ------------------------------------------------------------------------------ the parent

def summarise(runs: list[dict], warmup: int) -> dict:
    """Pool a side's rounds: tokens/s over all timed steps (wall and CPU), the length distribution."""
    wall = [t for r in runs for t in r["step_times"][warmup:]]
    cpu = [t for r in runs for t in r["step_cpu_times"][warmup:]]
    steps = [s for r in runs for s in r["step_lengths"][warmup:]]
    lens = sorted(x for s in steps for x in s)
    tokens = sum(lens)
    q = statistics.quantiles(lens, n=20, method="inclusive") if len(lens) > 1 else lens * 19
    return {
        "tokens_per_s": tokens / sum(wall), "tokens_per_cpu_s": tokens / sum(cpu),
        "per_round_tokens_per_s": [round(sum(map(sum, r["step_lengths"][warmup:])) / sum(r["step_times"][warmup:]), 1)
                                   for r in runs],
        "s_per_step": statistics.median(wall), "cpu_s_per_step": statistics.median(cpu),
        "timed_steps": len(wall), "completions": len(lens), "completion_tokens": tokens,
        "lengths": {"mean": tokens / len(lens), "min": lens[0], "p10": q[1], "p50": q[9], "p90": q[17],
                    "max": lens[-1], "mean_of_step_max": statistics.fmean(max(s) for s in steps)},
        "peak_memory_mb": max(r["peak_memory_mb"] for r in runs),
    }


def _usage_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    if harness.side_main(SIDES, sys.argv):
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", choices=("fixed", "uneven", "real"), default="fixed")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=None, help="max completion tokens (fixed 32, uneven 256)")
    p.add_argument("--stop-prob", type=float, default=1 / 48, help="uneven: per-token P(EOS)")
    p.add_argument("--micro", type=int, default=None,
                   help="micro-batches per step, both sides' gradient_accumulation_steps (fixed 1, uneven 4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per side and round")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the sides (noise control)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sides", default="ours,trl")
    p.add_argument("--model", default="smollm2-135m-instruct", help="real: the model (a name rl.models knows, a "
                   "directory or a .gguf file)")
    p.add_argument("--lora", type=int, default=8, help="real: LoRA rank on both sides (0: full fine-tune)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient on both sides (0: no reference model)")
    p.add_argument("--gc", action="store_true", help="gradient checkpointing on both sides (default off on both; "
                   "TRL's own default is on, ours off)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per side (1: on a shared 2-core machine a second OpenMP thread made the "
                        "sampler 7x slower, measured 2026-12-01; 0: torch's default)")
    a = p.parse_args()
    uneven = a.lengths == "uneven"
    completion = a.completion or (256 if uneven else 64 if a.lengths == "real" else 32)
    micro = a.micro or (4 if uneven else 1)
    n = a.prompts * a.generations
    if n % micro:
        _usage_error(f"--micro: {micro} must divide prompts x generations = {n}; pick a divisor")
    if uneven and not 0 < a.stop_prob < 1:
        _usage_error(f"--stop-prob: {a.stop_prob} is not a probability; pass e.g. 0.02 (mean length ~50)")
    import torch

    from rl.models.tiny import write_tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = a.threads or torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the children's OpenMP pools, before torch starts there
    sides = a.sides.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if a.lengths == "real":
            from rl.models.sources import resolve_model_path

            model_dir = resolve_model_path(a.model)
        else:
            model_dir = str(write_tiny_model(Path(tmp) / "model", hidden=a.hidden, layers=a.layers))
        stop = None
        if uneven:
            model_dir = stop_bias_model(model_dir, str(Path(tmp) / "stop_model"), a.stop_prob)
            stop = measured_stop_prob(model_dir)
            print(f"per-token P(EOS) on random contexts: {stop['min']:.4f}-{stop['max']:.4f} "
                  f"(mean {stop['mean']:.4f}, target {a.stop_prob:.4f})", flush=True)
        spec = {"model_dir": model_dir, "out": tmp, "prompts": a.prompts, "generations": a.generations,
                "completion": completion, "micro": micro, "steps": a.steps, "warmup": a.warmup,
                "device": device, "pairs": n, "seed": 0, "threads": threads, "lengths": a.lengths,
                "lora": a.lora, "beta": a.beta, "gc": a.gc}
        raw: dict[str, list[dict]] = {s: [] for s in sides}
        for r in range(a.rounds):
            for side in sides:
                # a seed per round: each round draws new completions (and prompt order) on both sides
                res = harness._child(__file__, side, {**spec, "seed": r}, timeout=3600)
                raw[side].append(res)
                timed = res["step_lengths"][a.warmup:]
                tps = sum(map(sum, timed)) / sum(res["step_times"][a.warmup:])
                print(f"round {r + 1}/{a.rounds} {side:<5} {tps:8.0f} tok/s, median step {res['median_step_s']:.2f} s, "
                      f"mean length {statistics.fmean(x for s in timed for x in s):.1f}", flush=True)
    summary = {s: summarise(raw[s], a.warmup) for s in sides}
    result = {"setting": a.lengths, "device": device,
              "config": {**vars(a), "completion": completion, "micro": micro}, "stop_prob_measured": stop,
              "env": harness.environment(), "summary": summary, "raw": raw}
    print()
    for s in sides:
        m, L = summary[s], summary[s]["lengths"]
        print(f"{s:<5} {m['tokens_per_s']:8.0f} tok/s ({m['tokens_per_cpu_s']:.0f} per CPU s), "
              f"{m['s_per_step']:.2f} s/step, {m['completions']} completions: length mean {L['mean']:.1f}, "
              f"p10/p50/p90 {L['p10']:.0f}/{L['p50']:.0f}/{L['p90']:.0f}, max {L['max']}, "
              f"mean step max {L['mean_of_step_max']:.0f}; peak {m['peak_memory_mb']:.0f} MiB")
    if "ours" in summary and "trl" in summary:
        o, t = summary["ours"], summary["trl"]
        result["ratio_tokens_per_s"] = o["tokens_per_s"] / t["tokens_per_s"]
        result["ratio_tokens_per_cpu_s"] = o["tokens_per_cpu_s"] / t["tokens_per_cpu_s"]
        gap = o["lengths"]["mean"] / t["lengths"]["mean"] - 1
        result["mean_length_gap"] = gap
        print(f"ratio ours / TRL: {result['ratio_tokens_per_s']:.2f}x tokens/s (wall), "
              f"{result['ratio_tokens_per_cpu_s']:.2f}x (CPU time); mean lengths differ by {100 * gap:+.1f}%"
              + ("" if abs(gap) <= 0.05 else " -- more than 5%: the comparison is NOT fair; rerun with more "
                 "--rounds/--steps"))
    out = harness.write_results(f"grpo_{a.lengths}_{device}", result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
