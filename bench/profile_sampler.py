"""Where a decode token's time goes in our sampler (`rl.engine.generation.generate`) on the real model.

    python bench/profile_sampler.py                       # SmolLM2-135M-Instruct, fp32, 2 threads, 64 and 256 rows
    python bench/profile_sampler.py --rows 64 256 --new-tokens 64 --repeats 2

The rollout of bench/bench_vllm_rollout.py: chat prompts, 4 samples per prompt, `--new-tokens` new tokens per
row, EOS ignored (the pad id is passed instead of the tokenizer), temperature 1. The time of every decode step
(one token for each row; the prefill is timed apart) is split by wall clock, measured around the calls (the CPU
runs them synchronously) with hooks installed by this script only:

    linears      every nn.Linear of the decoder layers (q/k/v/o, MLP): ~2 x params FLOP per token
    lm_head      the output head (logits of the one kept position)
    attention    the attention function (SDPA over the KV cache)
    kv_cache     the cache layers' update (HF's DynamicLayer concatenates; ours writes in place)
    sampling     rl.engine.scoring.sample_tokens (temperature, softmax, inverse-CDF draw over the vocabulary)
    other        the rest of the step (norms, rotary, residuals, masks, the loop's bookkeeping)

FLOP per token: 2 x (the linear weights' elements, the head included) + attention's 4 x layers x heads x
head_dim x (mean cache length); the fraction of peak divides that rate by the machine's measured fp32 matmul
rate (a 2048^3 product, `--threads` threads). `--cache hf` runs HF's concatenating DynamicCache instead of
ours; `--malloc default` leaves glibc's malloc untuned (`--cache hf --malloc default` is the sampler before
issue 50). `--dtype bfloat16` samples with bf16 linears (`rollout_dtype: bfloat16`) and measures the peak as a
bf16 2048^3 product. Results: printed, and written to `--out-json` (default
bench/results/profile_sampler.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP = 4


class Clock:
    def __init__(self):
        self.t = defaultdict(float)
        self.phase = "prefill"

    def wrap(self, name, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[(self.phase, name)] += time.perf_counter() - t
        return timed


def matmul_peak(threads: int, dtype) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 2048 ** 3 / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="timed calls per setting after one warm-up (the best counts)")
    p.add_argument("--cache", choices=["ours", "hf"], default="ours")
    p.add_argument("--malloc", choices=["kept", "default"], default="kept",
                   help="default: glibc's malloc untuned (without rl.engine.host_memory)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the linears' compute dtype while sampling (generate's dtype=, GRPO's rollout_dtype)")
    p.add_argument("--attention", choices=["sdpa", "segments"], default="segments",
                   help="sdpa: transformers' SDPA; segments: rl_segments, what a trainer's policy samples with "
                        "(decode steps of grouped-query models as two batched matmuls)")
    p.add_argument("--out-json", default=str(ROOT / "bench/results/profile_sampler.json"))
    args = p.parse_args()

    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.cache_utils import DynamicLayer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    import rl.engine.generation as gen
    from rl.engine import fast_decode
    from rl.models.loading import load_tokenizer
    from rl.models.sources import resolve_model_path

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    peak = matmul_peak(args.threads, dtype)
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = model.config
    clock = Clock()

    # the hooks: every piece timed where it is called
    head = model.get_output_embeddings()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            name = "lm_head" if m is head else "linears"
            m.register_forward_pre_hook(lambda mod, inp, name=name: mod.__dict__.__setitem__("_t0", time.perf_counter()))
            m.register_forward_hook(lambda mod, inp, out, name=name: clock.t.__setitem__(
                (clock.phase, name), clock.t[(clock.phase, name)] + time.perf_counter() - mod._t0))
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rl.engine import segments

    # --attention segments: rl.engine.segments' function (a trainer's policy; its grouped decode attention)
    attention = segments._segment_attention if args.attention == "segments" else sdpa_attention_forward
    AttentionInterface.register("timed_sdpa", clock.wrap("attention", attention))
    AttentionMaskInterface.register("timed_sdpa", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and getattr(c, "_attn_implementation", None) == "sdpa":
            c._attn_implementation = "timed_sdpa"
    gen.sample_tokens = clock.wrap("sampling", gen.sample_tokens)
    if args.malloc == "default":
        gen.keep_freed_memory = lambda: False
    if args.cache == "hf":
        from transformers import DynamicCache

        gen.preallocated_dynamic_cache = lambda config, capacity: DynamicCache(config=config)
    layer_cls = DynamicLayer if args.cache == "hf" else fast_decode._growing_layer_class()
    if args.cache == "ours":
        fast_decode._GROWING = layer_cls
    layer_cls.update = clock.wrap("kv_cache", layer_cls.update)

    def phase_hook(mod, a, kw):
        ids = kw.get("input_ids")
        clock.phase = "prefill" if ids is not None and ids.shape[1] > 1 else "decode"
    model.register_forward_pre_hook(phase_hook, with_kwargs=True)

    def prompts_for(n):
        from rl.rollout.prompts import encode_prompt

        return [encode_prompt(tok, f"What is {a} + {7 * a % 13}? Answer briefly.", 128, True) for a in range(n)]

    params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    heads, hd = cfg.num_attention_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model, "threads": args.threads, "cache": args.cache,
           "malloc": args.malloc, "dtype": args.dtype, "attention": args.attention,
           "matmul_peak_gflops": round(peak / 1e9, 1), "linear_params": params, "runs": []}
    for rows in args.rows:
        prompts = prompts_for(rows // GROUP)
        P = max(len(x) for x in prompts)
        # a short untimed call at this batch size first (oneDNN's kernels for its shapes, the allocator)
        gen.generate(model, tok.pad_token_id, prompts, max_new_tokens=min(8, args.new_tokens), temperature=1.0,
                     num_samples=GROUP, seed=0, dtype=dtype)
        best = None
        for r in range(1, args.repeats + 1):
            clock.t.clear()
            load = os.getloadavg()[0]
            t = time.perf_counter()
            gen.generate(model, tok.pad_token_id, prompts, max_new_tokens=args.new_tokens, temperature=1.0,
                         num_samples=GROUP, seed=0, dtype=dtype)
            wall = time.perf_counter() - t
            if r and (best is None or wall < best["wall_s"]):
                best = {"wall_s": wall, "t": dict(clock.t), "load": load}
        t = best["t"]
        prefill = sum(v for (ph, _), v in t.items() if ph == "prefill")
        steps = args.new_tokens - 1  # the first token comes from the prefill's logits
        decode = best["wall_s"] - prefill  # everything after the prefill (the loop's own time included)
        parts = {k: t.get(("decode", k), 0.0) for k in ("linears", "lm_head", "attention", "kv_cache", "sampling")}
        parts["other"] = decode - sum(parts.values())
        per_tok_us = {k: round(v / (steps * rows) * 1e6, 2) for k, v in parts.items()}
        mean_len = P + args.new_tokens / 2
        flop_tok = 2 * params + 4 * cfg.num_hidden_layers * heads * hd * mean_len
        rate = rows * steps / decode
        run = {"rows": rows, "new_tokens": args.new_tokens, "prompt_len_max": P, "wall_s": round(best["wall_s"], 3),
               "tokens_per_s": round(rows * args.new_tokens / best["wall_s"], 1), "prefill_s": round(prefill, 3),
               "decode_s": round(decode, 3), "decode_tokens_per_s": round(rate, 1),
               "decode_ms_per_step": round(decode / steps * 1e3, 2), "us_per_token": per_tok_us,
               "share": {k: round(v / decode, 3) for k, v in parts.items()},
               "gflop_per_token": round(flop_tok / 1e9, 3), "decode_gflops": round(rate * flop_tok / 1e9, 1),
               "fraction_of_matmul_peak": round(rate * flop_tok / peak, 3), "load_before": round(best["load"], 2)}
        out["runs"].append(run)
        print(f"{rows} rows x {args.new_tokens}: {run['tokens_per_s']} tok/s overall, decode "
              f"{run['decode_ms_per_step']} ms/step ({run['decode_tokens_per_s']} tok/s); per token (us): {per_tok_us}; "
              f"{run['decode_gflops']} GFLOP/s = {run['fraction_of_matmul_peak']:.1%} of the measured matmul peak "
              f"{out['matmul_peak_gflops']} GFLOP/s; load {run['load_before']}", flush=True)
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
