"""Side-by-side benchmark harness: our trainer vs TRL's on the same weights, data, batch and optimizer.

A benchmark script defines its sides (functions that build a trainer and run N optimizer steps, returning
per-step wall times) and calls `main_side_by_side`. Each side runs in its OWN child process of the same
script, so peak memory is that side's alone (CPU: peak RSS; GPU: `torch.cuda.max_memory_allocated`), and
the sides alternate over `rounds` so that a noisy machine slows them alike. The result table prints
pairs/s, median step time, peak memory and the ratios against the baseline side, and the JSON goes to
`bench/results/<name>-<time>.json` (gitignored).

    python bench/bench_dpo.py                  # CPU defaults
    python bench/bench_dpo.py --device cuda    # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- inside a side's process

def peak_memory_mb(device: str) -> float:
    """Peak memory of this process so far: CUDA allocator peak on GPU, peak resident set on CPU."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def run_side(fn: Callable[[dict], dict], spec: dict) -> dict:
    """Run one side: `fn(spec)` returns {"step_times": [...], **extras}; adds memory and summary stats.
    The first `spec['warmup']` steps are excluded from the statistics."""
    import torch

    torch.manual_seed(spec.get("seed", 0))
    baseline = peak_memory_mb(spec["device"])
    reset_peak(spec["device"])
    out = fn(spec)
    times = out["step_times"][spec["warmup"]:]
    cpu = out.get("step_cpu_times", [])[spec["warmup"]:]
    if cpu:  # process CPU time (all threads): what the step cost, much less disturbed by other processes
        out["median_step_cpu_s"] = statistics.median(cpu)
    out.update({
        "timed_steps": len(times),
        "median_step_s": statistics.median(times),
        "mean_step_s": statistics.fmean(times),
        "pairs_per_s": spec["pairs"] / statistics.median(times),
        "peak_memory_mb": peak_memory_mb(spec["device"]),
        "memory_before_mb": baseline,
    })
    return out


# ---------------------------------------------------------------------------------- the parent process

def _child(script: str, side: str, spec: dict, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RL_NO_PROGRESS": "1", "TQDM_DISABLE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, script, "--_side", side, "--_spec", json.dumps(spec)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    marker = "BENCH_RESULT "
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"side {side!r} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len(marker):])


def side_main(sides: dict[str, Callable[[dict], dict]], argv: list[str]) -> bool:
    """In a child: run the side named by --_side and print its result line. Returns False in the parent."""
    if "--_side" not in argv:
        return False
    name = argv[argv.index("--_side") + 1]
    spec = json.loads(argv[argv.index("--_spec") + 1])
    print("BENCH_RESULT " + json.dumps(run_side(sides[name], spec)), flush=True)
    return True


def compare(results: dict[str, list[dict]], baseline: str) -> dict:
    """Pool each side's rounds (median of per-round medians) and take ratios against `baseline`."""
    summary = {}
    for name, rounds in results.items():
        summary[name] = {
            "median_step_s": statistics.median(r["median_step_s"] for r in rounds),
            "pairs_per_s": statistics.median(r["pairs_per_s"] for r in rounds),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in rounds),
            "per_round_median_step_s": [round(r["median_step_s"], 4) for r in rounds],
        }
        if all("median_step_cpu_s" in r for r in rounds):
            summary[name]["median_step_cpu_s"] = statistics.median(r["median_step_cpu_s"] for r in rounds)
            summary[name]["per_round_median_step_cpu_s"] = [round(r["median_step_cpu_s"], 4) for r in rounds]
        extras = {k: v for k, v in rounds[-1].items() if k.startswith("x_")}
        summary[name].update(extras)
    base = summary[baseline]
    for name, s in summary.items():
        s["step_time_ratio_vs_" + baseline] = s["median_step_s"] / base["median_step_s"]
        s["pairs_per_s_ratio_vs_" + baseline] = s["pairs_per_s"] / base["pairs_per_s"]
        s["peak_memory_ratio_vs_" + baseline] = s["peak_memory_mb"] / base["peak_memory_mb"]
        if "median_step_cpu_s" in s and "median_step_cpu_s" in base:
            s["step_cpu_ratio_vs_" + baseline] = s["median_step_cpu_s"] / base["median_step_cpu_s"]
    return summary


def print_table(summary: dict, baseline: str) -> None:
    head = (f"{'side':<22}{'step s':>9}{'pairs/s':>10}{'peak MiB':>11}{'time x':>9}{'pairs/s x':>11}{'mem x':>8}"
            f"{'cpu s':>9}{'cpu x':>8}")
    print(head)
    print("-" * len(head))
    for name, s in summary.items():
        cpu = (f"{s['median_step_cpu_s']:>9.3f}{s['step_cpu_ratio_vs_' + baseline]:>8.3f}"
               if "step_cpu_ratio_vs_" + baseline in s else "")
        print(f"{name:<22}{s['median_step_s']:>9.3f}{s['pairs_per_s']:>10.2f}{s['peak_memory_mb']:>11.0f}"
              f"{s['step_time_ratio_vs_' + baseline]:>9.3f}{s['pairs_per_s_ratio_vs_' + baseline]:>11.3f}"
              f"{s['peak_memory_ratio_vs_' + baseline]:>8.3f}{cpu}")
    print(f"(ratios against {baseline}; time x < 1 and pairs/s x > 1 mean faster than it; cpu = process CPU "
          f"seconds per step, all threads, the figure least disturbed by other load)")


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "machine": platform.machine(), "load_avg_1m": os.getloadavg()[0]}
    for mod in ("transformers", "trl", "accelerate", "deepspeed"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main_side_by_side(name: str, script: str, spec: dict, side_names: list[str], baseline: str, rounds: int,
                      timeout: int = 1800) -> dict:
    """Alternate the sides for `rounds` rounds, each in a fresh child process; print and save the table."""
    results: dict[str, list[dict]] = {s: [] for s in side_names}
    for r in range(rounds):
        for side in side_names:
            res = _child(script, side, spec, timeout)
            results[side].append(res)
            print(f"round {r + 1}/{rounds} {side:<20} median step {res['median_step_s']:.3f}s "
                  f"({res['timed_steps']} steps), peak {res['peak_memory_mb']:.0f} MiB", flush=True)
    summary = compare(results, baseline)
    print()
    print_table(summary, baseline)
    payload = {"name": name, "spec": spec, "env": environment(), "baseline": baseline, "summary": summary,
               "raw": results}
    path = write_results(name, payload)
    print(f"\nwrote {path}")
    return payload


def common_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per side and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per side and round")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the sides (noise control)")
    p.add_argument("--seed", type=int, default=0)
    return p
