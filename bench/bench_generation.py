"""New tokens/s of our batched rollout (`rl.engine.generation.generate`) against plain `transformers`
`model.generate`, same model, batch, prompt length and number of new tokens, in one run.

    python bench/bench_generation.py                          # tiny Llama on CPU
    python bench/bench_generation.py --shape qwen2.5-0.5b --batch 64 --new-tokens 256 --cache static --compile
    python bench/bench_generation.py --logprob-memory         # peak RSS of full vs chunked log-probs

Both sides sample (temperature 1, no top-k/top-p) and never stop early (no EOS), so they produce
exactly batch x new_tokens tokens. Each side runs once to warm up, then `--repeats` timed runs;
the best run counts. Results are printed and written to bench/results/generation-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320),
    "small-50k": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50304),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1e6),
}


def build_model(shape: str, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return Qwen2ForCausalLM(cfg).to(dtype).to(device).eval()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_best(fn, device, repeats):
    fn()  # warm-up (and compilation)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_speed(args) -> dict:
    from rl.engine.generation import generate

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(args.shape, device, dtype)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, V, (args.batch, args.prompt_len), generator=g)
    new = args.batch * args.new_tokens

    def ours():
        out = generate(model, 0, prompts.tolist(), max_new_tokens=args.new_tokens, temperature=1.0, seed=0,
                       eos_token_id=None, cache=args.cache, compile=args.compile)
        assert int(out.mask.sum()) == new

    ids = prompts.to(device)
    hf_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True,
                     temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    if args.cache == "static":
        hf_kwargs["cache_implementation"] = "static"

    def hf():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **hf_kwargs)
        assert out.shape == (args.batch, args.prompt_len + args.new_tokens)

    t_hf = time_best(hf, device, args.repeats)
    t_ours = time_best(ours, device, args.repeats)
    res = {
        "shape": args.shape, "device": device, "dtype": str(dtype).replace("torch.", ""),
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "cache": args.cache,
        "compile": args.compile, "threads": torch.get_num_threads(),
        "hf_generate_new_tokens_per_s": round(new / t_hf, 1),
        "ours_new_tokens_per_s": round(new / t_ours, 1),
        "ratio_ours_over_hf": round(t_hf / t_ours, 3),
        "torch": torch.__version__,
    }
    import transformers

    res["transformers"] = transformers.__version__
    return res


# ------------------------------------------------------------------ chunked log-prob memory

def _memory_child(mode: str, shape: str, batch: int, seq: int, chunk: int) -> None:
    """Runs in a subprocess: peak RSS growth of one no-grad scoring pass (ru_maxrss is a process
    high-water mark, so each mode needs a fresh process)."""
    from rl.engine.scoring import sequence_logprobs

    model = build_model(shape, "cpu", torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # warm the body once on a short input so lazy allocations are not counted
        model.model(input_ids=ids[:, :8])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    logp, _ = sequence_logprobs(model, ids, chunk_size=None if mode == "full" else chunk)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": mode, "peak_growth_mib": round((after - before) / 1024, 1), "seconds": round(dt, 2),
                      "checksum": float(logp.sum())}))


def bench_memory(args) -> dict:
    out = {"shape": args.shape, "vocab": SHAPES[args.shape]["vocab_size"], "batch": args.batch,
           "seq": args.seq, "chunk": args.chunk,
           "full_logits_fp32_mib": round(args.batch * args.seq * SHAPES[args.shape]["vocab_size"] * 4 / 2 ** 20, 1)}
    for mode in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--_memory-child", mode, "--shape", args.shape, "--batch", str(args.batch),
               "--seq", str(args.seq), "--chunk", str(args.chunk)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    out["checksums_match"] = abs(out["full"]["checksum"] - out["chunked"]["checksum"]) < 1e-2 * abs(out["full"]["checksum"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    ap.add_argument("--compile", action="store_true", help="CUDA only: compiled static-cache decode step")
    ap.add_argument("--logprob-memory", action="store_true", help="measure full vs chunked log-prob peak memory")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        _memory_child(args.memory_child, args.shape, args.batch, args.seq, args.chunk)
        return
    if args.logprob_memory:
        args.shape = args.shape or "small-50k"
        args.batch = args.batch or 4
        res = {"benchmark": "chunked_logprob_memory", **bench_memory(args)}
        print(f"peak RSS growth, {args.batch}x{args.seq} tokens, vocab {res['vocab']}: "
              f"full {res['full']['peak_growth_mib']} MiB, chunked({args.chunk}) {res['chunked']['peak_growth_mib']} MiB")
    else:
        args.shape = args.shape or "tiny"
        args.batch = args.batch or 16
        if args.compile and args.device != "cuda":
            ap.error("--compile needs CUDA")
        res = {"benchmark": "generation", **bench_speed(args)}
        print(f"{args.shape} on {args.device}, batch {args.batch} x {args.new_tokens} new tokens ({args.cache} cache): "
              f"ours {res['ours_new_tokens_per_s']} tok/s, HF generate {res['hf_generate_new_tokens_per_s']} tok/s, "
              f"ratio {res['ratio_ours_over_hf']}x")
    print(json.dumps(res, indent=1))
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    name = f"{res['benchmark']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    (results / name).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
