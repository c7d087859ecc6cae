"""Peak memory and time of one training forward + backward of token log-probs: full logits vs the
chunked LM head (rl.engine.chunked), over sequence lengths, at a real vocabulary.

Each (mode, T) runs in its own child process; its peak RSS growth (`ru_maxrss` after minus before the
step; the model and inputs are built before) is the step's own memory. The full path holds the
(B, T, V) logits, their fp32 log-softmax pieces and their gradient; the chunked path one (B, chunk, V)
block at a time, so its growth should be linear in T with a slope of activations only.

    python bench/bench_chunked.py                              # V = 152,064, B = 2, T = 256, 512, 1024
    python bench/bench_chunked.py --vocab 49152 --lengths 512,2048 --chunk 128
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(mode: str, T: int, vocab: int, batch: int, chunk: int, hidden: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rl.engine.chunked import capture_head
    from rl.engine.losses import token_logprobs
    from rl.models.tiny import build_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config("llama", vocab, hidden=hidden, layers=1, heads=4))
    ids = torch.randint(3, vocab, (batch, T))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    with capture_head(model, chunk) if mode == "chunked" else torch.enable_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    logp, _ = token_logprobs(logits, ids)
    logp.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "T": T, "growth_mib": peak - before, "seconds": seconds,
            "checksum": float(logp.detach().double().sum())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=152_064)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--lengths", default="256,512,1024")
    p.add_argument("--_child", default=None)
    a = p.parse_args(argv)
    if a._child:
        mode, T = a._child.split(":")
        print("RESULT " + json.dumps(child(mode, int(T), a.vocab, a.batch, a.chunk, a.hidden)), flush=True)
        return
    rows = []
    for T in [int(x) for x in a.lengths.split(",")]:
        for mode in ("full", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--_child", f"{mode}:{T}", "--vocab", str(a.vocab),
                                  "--batch", str(a.batch), "--chunk", str(a.chunk), "--hidden", str(a.hidden)],
                                 capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise SystemExit(f"{mode} T={T} failed:\n{out.stderr[-2000:]}")
            r = json.loads(line[0][7:])
            rows.append(r)
            print(f"{mode:<8} T={T:<6} peak RSS growth {r['growth_mib']:8.0f} MiB  {r['seconds']:6.2f} s  "
                  f"checksum {r['checksum']:.4f}", flush=True)
    logits_mib = {T: a.batch * T * a.vocab * 4 / 2**20 for T in {r["T"] for r in rows}}
    print("(B, T, V) fp32 logits: " + ", ".join(f"T={T}: {m:.0f} MiB" for T, m in sorted(logits_mib.items())))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"chunked-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": vars(a), "rows": rows, "load_avg_1m": os.getloadavg()[0]},
                               indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
