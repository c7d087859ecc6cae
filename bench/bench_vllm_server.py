"""Completions per second of 2 training processes through one `rl vllm-serve`: one generate call per step for both
(the prompts gathered to the main process, rl.rollout.vllm_batching) against one call per process (each posts its
own /generate; the server runs them one after the other).

    python bench/bench_vllm_server.py                        # SmolLM2-135M, 2 processes x 8 prompts x 4 samples
    python bench/bench_vllm_server.py --prompts 16 --new-tokens 64

Needs vLLM. The server and the two processes (torchrun, gloo) share this machine's cores, as a CPU run does; every
row samples exactly --new-tokens tokens (EOS ignored) from its own seed, so both ways do the same work. The median
of --repeats steps counts, after one warm-up step; the ratio of the two, measured one after the other against the
same server, is what carries to other machines. Results: printed, and written to bench/results/vllm_server.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP = 4


def worker(args) -> None:
    """One training process (under torchrun): its prompts through the server, --repeats times, both ways."""
    import torch.distributed as dist

    from rl.models.loading import load_tokenizer
    from rl.models.sources import resolve_model_path
    from rl.rollout.prompts import encode_prompt
    from rl.rollout.vllm_batching import generate_across_processes
    from rl.rollout.vllm_client import ServerClient
    from rl.rollout.vllm_engine import request_of, sampling_params

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = load_tokenizer(resolve_model_path(args.model))
    rows = range(rank * args.prompts, (rank + 1) * args.prompts)
    prompts = [encode_prompt(tok, f"What is {a} + {7 * a % 13}? Answer briefly.", 128, True) for a in rows]
    sp = {**sampling_params(GROUP, args.new_tokens, 1.0, 0, 1.0, []), "ignore_eos": True}
    request = request_of(prompts, sp, seed=rank * args.prompts * GROUP)
    client = ServerClient("127.0.0.1", args.port, 600.0)
    if rank == 0:
        client.wait_ready()
    ways = {"one_call": lambda: generate_across_processes(request, client.generate),
            "call_per_process": lambda: client.generate(*request)}
    times = {name: [] for name in ways}
    for i in range(args.repeats + 1):  # the ways interleaved, so that a change of load falls on both; 0: warm-up
        for name, step in ways.items():
            dist.barrier()
            t = time.time()
            got = step()
            dist.barrier()
            if i:
                times[name].append(time.time() - t)
            assert len(got) == len(prompts) and all(len(c) == GROUP for c in got)
    result = {}
    for name, ts in times.items():
        seconds = statistics.median(ts)
        result[name] = {"seconds": round(seconds, 3), "completions_per_s": round(world * len(prompts) * GROUP / seconds, 2)}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8, help="prompts per process per step (x 4 samples each)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server and of each process")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out-json", default=str(ROOT / "bench/results/vllm_server.json"))
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from rl.models.sources import resolve_model_path

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rl.rollout.vllm_server", "--model", resolve_model_path(args.model),
                               "--host", "127.0.0.1", "--port", str(port), "--group-port", str(free_port()),
                               "--max-model-len", "512"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(free_port()), __file__, "--worker", "--model", args.model, "--port", str(port),
                               "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--repeats",
                               str(args.repeats)], env=env, capture_output=True, text=True)
    finally:
        server.kill()
        server.wait()
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        raise SystemExit(f"the workers failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    ways = json.loads(line[0][7:])
    result = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "processes": 2, "prompts_per_process": args.prompts,
              "samples_per_prompt": GROUP, "new_tokens": args.new_tokens, "threads": args.threads,
              "load_before": round(load, 2), **ways,
              "one_call_over_per_process": round(ways["one_call"]["completions_per_s"]
                                                 / ways["call_per_process"]["completions_per_s"], 2)}
    Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    for name in ("one_call", "call_per_process"):
        print(f"{name:17} {ways[name]['completions_per_s']:8.2f} completions/s ({ways[name]['seconds']:.2f} s per step)")
    print(f"one call / one per process: {result['one_call_over_per_process']:.2f}x")


if __name__ == "__main__":
    main()
