"""GAE cost against the response length N: rl.algos.advantages.gae (one reverse scan over t, O(B*N))
next to the former (B, N, N) form (tests/unit/algos/test_algos.py `quadratic_gae`), B=16 rows with random lengths.

    python bench/bench_gae.py                  # N = 512 ... 8192, 1 thread
    python bench/bench_gae.py --n 1024 4096 --threads 2

Each configuration runs in a fresh process, so the peak resident memory it adds is its own. The former
form is run only up to --quadratic-max (its (B, N, N) weights need ~27 GB at N=8192).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(impl: str, B: int, N: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    from tests.test_algos import quadratic_gae

    from rl.algos.advantages import gae

    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(B, N, generator=g), torch.randn(B, N, generator=g)
    lengths = torch.randint(1, N + 1, (B,), generator=g)
    mask = (torch.arange(N)[None, :] < lengths[:, None]).float()
    fn = gae if impl == "scan" else quadratic_gae
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn(rewards, values, mask, 1.0, 0.95)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    return {"impl": impl, "B": B, "N": N, "seconds": sorted(times)[1], "extra_peak_mb": peak / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quadratic-max", type=int, default=2048)
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.batch, int(a.one[1]), a.threads)))
        return
    rows = []
    for n in a.n:
        for impl in ("scan", "quadratic"):
            if impl == "quadratic" and n > a.quadratic_max:
                continue
            out = subprocess.run([sys.executable, __file__, "--one", impl, str(n), "--batch", str(a.batch),
                                  "--threads", str(a.threads)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"GAE, B={a.batch}, {a.threads} thread(s): median of 3 calls, extra peak RSS")
    print(f"{'N':>6} {'scan s':>9} {'scan MB':>8} {'(B,N,N) s':>10} {'(B,N,N) MB':>11} {'speedup':>8}")
    for n in a.n:
        s = next(r for r in rows if r["N"] == n and r["impl"] == "scan")
        q = next((r for r in rows if r["N"] == n and r["impl"] == "quadratic"), None)
        qs = f"{q['seconds']:10.3f} {q['extra_peak_mb']:11.1f} {q['seconds'] / s['seconds']:7.1f}x" if q else \
            f"{'-':>10} {'-':>11} {'-':>8}"
        print(f"{n:6d} {s['seconds']:9.3f} {s['extra_peak_mb']:8.1f} {qs}")
    out = ROOT / "bench" / "results" / "gae.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
