"""Spread of every "it learns" test's measured quantity over seeds, thread counts and CPU kernels.

    python bench/learning_spread.py                       # seeds 0-3 x {default threads, 1 thread, AVX2}
    python bench/learning_spread.py --seeds 0 1 --variants native1 avx2

Float results differ between CPUs (vector width and kernel choice change the order of sums), and a
tiny random model turns a 1e-7 difference into a different sampled token and then a different run.
So the thresholds of the "it learns" tests must hold across machines, not only on one run. This runs
each such test with RL_TEST_SEED=<seed> under each variant (`avx2` forces AVX2 kernels in ATen, MKL and
oneDNN on an AVX-512 machine: a stand-in for another CPU), reads the `learned: <name> <value>` lines the
tests print, and tabulates min / median / max next to each test's threshold. Writes
bench/results/learning_spread.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/unit/trainers/test_sft.py::test_tiny_sft_learns_and_saves_a_loadable_model",
    "tests/unit/trainers/test_reward.py::test_it_learns_held_out_accuracy",
    "tests/unit/trainers/test_dpo.py::test_it_learns_heldout_reward_accuracy",
    "tests/unit/trainers/test_grpo.py::test_beta_zero_loads_no_reference_and_learns",
    "tests/integration/test_ppo_e2e.py::test_ppo_learns_char_fraction_with_bounded_kl",
    "tests/integration/test_pipeline.py::test_tiny_pipeline_raises_heldout_accuracy",
    "tests/unit/trainers/test_online_dpo.py::test_it_learns_a_printable_fraction",
    "tests/integration/test_simpo_launch.py::test_simpo_recipe_runs_and_learns",
    "tests/unit/trainers/test_kto.py::test_kto_recipe_runs_and_learns",
    "tests/unit/trainers/test_distill.py::test_it_learns_the_student_moves_toward_the_teacher",
    "tests/unit/envs/test_tools.py::test_sft_teacher_then_grpo_raises_the_tool_call_rate",
]
# name -> (threshold, direction): the bound each test asserts
THRESHOLDS = {"sft_loss_ratio": (0.5, "<"), "reward_heldout_accuracy": (0.95, ">="),
              "dpo_heldout_accuracy": (0.9, ">="), "grpo_reward_gain": (0.2, ">"),
              "ppo_reward_ratio": (2.0, ">="), "ppo_reward_end": (0.03, ">"), "ppo_max_kl": (50.0, "<"), "pipeline_gain": (0.10, ">="),
              "online_dpo_score_gain": (0.15, ">"), "simpo_eval_accuracy": (0.6, ">="),
              "kto_eval_margin": (0.2, ">"), "distill_jsd_ratio": (0.9, "<="),
              "tool_call_probability_gain": (0.3, ">=")}
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
VARIANTS = {"native": {}, "native1": {"OMP_NUM_THREADS": "1"}, "avx2": {"OMP_NUM_THREADS": "1", **AVX2}}


def run(seed: int, variant: str) -> tuple[dict[str, float], str]:
    env = {**os.environ, **VARIANTS[variant], "RL_TEST_SEED": str(seed)}
    if variant == "native":
        env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    values = {m[1]: float(m[2]) for m in re.finditer(r"^learned: (\S+) (\S+)$", proc.stdout, re.M)}
    summary = (proc.stdout.strip().splitlines() or ["?"])[-1]
    return values, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("-k", default=None, help="only the tests whose id contains this")
    args = ap.parse_args()
    if args.k:
        TESTS[:] = [t for t in TESTS if args.k in t]
    rows = []
    for seed in args.seeds:
        for variant in args.variants:
            t0 = time.time()
            values, summary = run(seed, variant)
            rows.append({"seed": seed, "variant": variant, "values": values, "pytest": summary})
            print(f"seed {seed} {variant:8s} {time.time() - t0:5.0f} s  {summary}  "
                  + " ".join(f"{k}={v:.3f}" for k, v in sorted(values.items())), flush=True)
    print(f"\n{'quantity':26s} {'bound':>8s} {'min':>7s} {'median':>7s} {'max':>7s}  n")
    for name, (bound, op) in THRESHOLDS.items():
        vals = [r["values"][name] for r in rows if name in r["values"]]
        if vals:
            print(f"{name:26s} {op:>2s}{bound:6.2f} {min(vals):7.3f} {statistics.median(vals):7.3f} "
                  f"{max(vals):7.3f}  {len(vals)}")
    out = ROOT / "bench" / "results" / "learning_spread.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
