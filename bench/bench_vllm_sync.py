"""Weight sync time per step (policy -> vLLM engine), one tensor at a time against buckets, per model size, colocated
and through `rl vllm-serve`; and (mode lora) a LoRA policy's adapters alone against its merged weights.

    python bench/bench_vllm_sync.py                          # SmolLM2-135M and a 360M config with random weights
    python bench/bench_vllm_sync.py --models smollm2-135m-instruct --repeats 5

Needs vLLM (the README's vLLM section). Each (model, mode) runs in a process of its own (one engine per process:
vLLM's CPU engine keeps its KV cache until the process ends). A sync is what `VLLMRollout.sync` does after an
optimizer step: colocated, `load_weights(llm, policy_weights(model))` (one in-place `reload_weights`; with a bucket
size, the same tensors packed into buckets first, to see what packing would cost there); server,
`ServerClient.push` (the stream over the gloo group, loaded by the server as it arrives; the time ends when the
server confirms). The median of `--repeats` syncs counts, after one warm-up.
Timings under load: compare the columns of one row (measured side by side), not rows of different runs.
Results: printed, and written to bench/results/vllm_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A Llama shape of ~360M parameters (SmolLM2-360M's: hidden 960 in 15 heads of 64, 32 layers), random weights
LARGER = dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
              num_key_value_heads=5, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
BUCKETS_MB = (0, 512)  # 0: one tensor at a time; 512: the default (vllm_weight_sync_bucket_mb)


def model_dir(name: str, work: Path) -> str:
    """The packaged model's directory, or for "random-360m" a Llama of LARGER's shape with random weights."""
    from rl.models.sources import resolve_model_path

    if name != "random-360m":
        return resolve_model_path(name)
    out = work / "random-360m"
    if not (out / "config.json").exists():
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LARGER))
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct")).save_pretrained(out)
    return str(out)


def timed(fns: dict, repeats: int) -> dict:
    """The median seconds of each function, after one warm-up call each; the calls interleaved (one of each per
    round), so that a change of the machine's load falls on all of them alike."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.time()
            fn()
            times[k].append(time.time() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def side(args) -> dict:
    """One (model, mode) in this process: the median sync seconds per bucket size (and per LoRA path)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl.engine.weight_sync import pack_buckets, policy_weights, unpack_bucket
    from rl.rollout.vllm_client import ServerClient
    from rl.rollout.vllm_engine import engine_kwargs, in_process_llm, load_weights

    path = args.path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    out = {"model": args.model, "mode": args.mode, "params": n_params, "seconds": {}}
    if args.mode == "lora":
        return lora_side(args, model, out)
    if args.mode == "colocate":
        llm = in_process_llm(engine_kwargs(path, dtype="float32", max_model_len=256, gpu_memory_utilization=0.3))

        def sync(mb):  # what the engine does (mb 0), and the same tensors through buckets first
            weights = policy_weights(model)
            load_weights(llm, weights if not mb else
                         (p for b in pack_buckets(weights, mb << 20) for p in unpack_bucket(b)))
    else:
        client = ServerClient("127.0.0.1", args.port, 600.0, args.group_port)
        client.wait_ready()

        def sync(mb):
            client.push(policy_weights(model), mb << 20)
    medians = timed({f"bucket_{mb}mb": (lambda mb=mb: sync(mb)) for mb in BUCKETS_MB}, args.repeats)
    out["seconds"] = {k: round(v, 3) for k, v in medians.items()}
    print(f"{args.model} {args.mode}: {out['seconds']}", flush=True)
    return out


def lora_side(args, model, out: dict) -> dict:
    """A rank-16 LoRA policy on every linear layer, colocated: the merged weights (the default) against the adapters
    alone (written for vLLM's LoRA support, and its in-place reload at the next request; the
    same request without a reload is subtracted)."""
    import torch

    from rl.engine.weight_sync import policy_weights
    from rl.models.loading import apply_lora
    from rl.rollout.vllm_engine import engine_call, engine_kwargs, in_process_llm, load_weights
    from rl.rollout.vllm_lora import AdapterSlot, adapter_state

    policy = apply_lora(model, 16, 32, 0.0, "all-linear")
    for n, p in policy.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    out["adapter_params"] = sum(p.numel() for n, p in policy.named_parameters() if ".lora_" in n)
    llm = in_process_llm(engine_kwargs(args.path, dtype="float32", max_model_len=256, gpu_memory_utilization=0.3,
                                       max_lora_rank=16))
    slot = AdapterSlot()
    probe = ([[1, 2, 3]], [{"max_tokens": 1, "temperature": 0.0, "logprobs": 0}])
    def adapter_sync():
        slot.write(*adapter_state(policy))
        engine_call(llm, slot.request())(*probe)
    m = timed({"merged": lambda: load_weights(llm, policy_weights(policy)),
               "adapters": adapter_sync, "request_alone": lambda: engine_call(llm, slot.request())(*probe)},
              args.repeats)
    out["seconds"] = {"merged": round(m["merged"], 3), "adapters": round(m["adapters"] - m["request_alone"], 3),
                      "adapters_with_request": round(m["adapters"], 3), "request_alone": round(m["request_alone"], 3)}
    slot.close()
    print(f"{args.model} lora r16: merged {out['seconds']['merged']:.3f} s, adapters {out['seconds']['adapters']:.3f} s",
          flush=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(model: str, path: str, mode: str, args, env: dict) -> dict:
    server = None
    cmd = [sys.executable, __file__, "--side", "--model", model, "--path", path, "--mode", mode,
           "--repeats", str(args.repeats)]
    if mode == "server":
        port, group = free_port(), free_port()
        server = subprocess.Popen([sys.executable, "-m", "rl.rollout.vllm_server", "--model", path, "--host",
                                   "127.0.0.1", "--port", str(port), "--group-port", str(group), "--max-model-len",
                                   "256"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cmd += ["--port", str(port), "--group-port", str(group)]
    try:
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        raise SystemExit(f"{model} {mode} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {**json.loads(line[0][7:]), "load_before": round(load, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "random-360m"])
    p.add_argument("--modes", nargs="+", default=["colocate", "server", "lora"])
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per setting (the median counts)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each process")
    p.add_argument("--side", action="store_true", help=argparse.SUPPRESS)  # internal: one (model, mode)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--group-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out-json", default=str(ROOT / "bench/results/vllm_sync.json"))
    args = p.parse_args()
    if args.side:
        print("RESULT " + json.dumps(side(args)), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rl-bench-sync-") as work:
        for model in args.models:
            path = model_dir(model, Path(work))
            for mode in args.modes:
                rows.append(run_side(model, path, mode, args, env))
    result = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "repeats": args.repeats,
              "cpu": subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True,
                                    text=True).stdout.strip(), "rows": rows}
    Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(f"{r['model']:24} {r['params'] / 1e6:5.0f}M {r['mode']:9} "
              + "  ".join(f"{k} {v:.3f} s" for k, v in r["seconds"].items()))


if __name__ == "__main__":
    main()
