"""DPO step time and memory: rl.dpo.DPOTrainer vs TRL 1.16's DPOTrainer, side by side.

Same model weights (a locally written ~3M-parameter Llama: hidden 256, 3 layers), same pairs (8 per step,
64-token prompts, 192-token answers including EOS, so no truncation and no padding), same AdamW
(lr 1e-6, constant, clip 1.0), fp32 on CPU (TRL gets bf16=False: CPU bf16 autocast is ~20x slower here)
and no gradient checkpointing on either side. Sides:

    trl              TRL, reference forward every step (its default)
    trl_precompute   TRL with precompute_ref_log_probs=True
    ours             rl.dpo defaults: frozen-copy reference forward every step (LM head chunked automatically
                     once B*T*V > 2**26, `rl.engine.chunked`), each pair's prompt computed once for both answers,
                     packed without padding (share_prompt_forward: `rl.data.preference.pack_pairs_shared`)
    ours_padded      ours with share_prompt_forward=False, packing=False: rows padded to the longest
    ours_full        rl.dpo with logprob_chunk_size=0, padded: full (2B, T, V) logits, as before rl.engine.chunked
    ours_precompute  rl.dpo with precompute_ref_logps=True (one reference pass before training)
    ours_packed      rl.dpo with packing=True (share_prompt_forward=False): each step's chosen and rejected sequences packed padding-free
                     into rows no longer than the longest (`rl.engine.packing`), training and reference forwards
    ours_packed_precompute  ours_packed with precompute_ref_logps=True

Realistic settings (issue 17): `--vocab 49152` / `--vocab 152064` widen the tiny model's embedding and
LM head to a real vocabulary (the byte-level tokenizer still emits ids < 259; the cost is the head's),
and `--lengths longtail` draws each prompt from 16-256 and each answer from 16-512 tokens, log-normal
(median 48 / 96): the step then holds exactly those `--pairs` pairs every time (one pass over them is
one step), so both sides pad the same batch to the same longest row, whatever their shuffling.

Step time is the interval between consecutive optimizer-step ends (data, forwards, backward, optimizer,
metrics), measured the same way on both sides, as wall time and as process CPU time (all threads; on a
shared machine the CPU time is the steadier figure). The one-time precompute pass falls in the first,
untimed step on both sides. Run:

    python bench/bench_dpo.py                       # CPU: 2 rounds x 4 timed steps per side
    python bench/bench_dpo.py --vocab 152064 --lengths longtail --pairs 2 --hidden 256 --layers 2 \
        --sides trl,trl_precompute,ours_full,ours --rounds 1 --steps 2
    python bench/bench_dpo.py --vocab 152064 --lengths longtail --pairs 4 --hidden 256 --layers 2 \
        --sides trl,ours,ours_packed --rounds 1 --steps 1 --warmup 1
    python bench/bench_dpo.py --device cuda --hidden 896 --layers 24 --heads 14 --family qwen2

The real model (issue 27): SmolLM2-135M-Instruct, long-tailed pairs, batch 4, 2 threads per side:

    python bench/bench_dpo.py --model smollm2-135m-instruct --lengths longtail --pairs 4 --threads 2 \
        --sides trl,ours,ours_packed --rounds 3 --steps 2 --warmup 1      # add --bf16 for bf16 autocast
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness  # noqa: E402

LONGTAIL = {"prompt": (16, 256, 48), "answer": (16, 512, 96)}  # (min, max, median) tokens


def longtail_length(rng: random.Random, lo: int, hi: int, median: int) -> int:
    """A log-normal length (sigma 0.8: most short, a few long) clipped to [lo, hi]."""
    return max(lo, min(hi, round(median * rng.lognormvariate(0.0, 0.8))))


def make_pairs(n: int, prompt_len: int, answer_len: int, seed: int, lengths: str = "fixed"):
    """Random letters (one token each with the byte-level tokenizer); answers leave room for EOS.
    lengths="longtail": each prompt and answer length drawn by `longtail_length` (LONGTAIL)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def text(k):
        return "".join(rng.choice(letters) for _ in range(k))

    def size(kind, fixed):
        return fixed if lengths == "fixed" else longtail_length(rng, *LONGTAIL[kind])

    P, C, R = [], [], []
    for _ in range(n):
        P.append(text(size("prompt", prompt_len)))
        C.append(text(size("answer", answer_len) - 1))
        R.append(text(size("answer", answer_len) - 1))
    return P, C, R


def _data(spec):
    """The pairs of a run: `pairs` x steps fixed-length pairs, or the same `pairs` long-tailed pairs
    every step (a dataset of exactly one batch)."""
    n = 1 if spec.get("lengths", "fixed") == "longtail" else _n_steps(spec)
    return make_pairs(spec["pairs"] * n, spec["prompt_len"], spec["answer_len"], spec["seed"],
                      spec.get("lengths", "fixed"))


def _max_length(spec) -> int:
    if spec.get("lengths", "fixed") == "longtail":
        return LONGTAIL["prompt"][1] + LONGTAIL["answer"][1] + 8
    return spec["prompt_len"] + spec["answer_len"] + 8


def _n_steps(spec):
    return spec["warmup"] + spec["steps"]


def side_ours(spec: dict, precompute: bool, chunk: int | None = None, packing: bool | None = None) -> dict:
    """`packing` None: DPOConfig's defaults (shared prompts); True / False: packed / padded, prompts not shared."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])

    from rl.config.fields import build
    from rl.data.preference import PreferenceDataset
    from rl.trainers.dpo import DPOConfig, DPOTrainer

    n = _n_steps(spec)
    P, C, R = _data(spec)
    longtail = spec.get("lengths", "fixed") == "longtail"
    chosen = {} if packing is None else {"packing": packing, "share_prompt_forward": False}
    cfg = build(DPOConfig, dict(
        model_name=spec["model"], output_dir=tempfile.mkdtemp(prefix="bench-dpo-"), report_to=["none"],
        per_device_train_batch_size=spec["pairs"], max_steps=n, learning_rate=1e-6, lr_scheduler_type="constant", max_grad_norm=1.0,
        max_length=_max_length(spec),
        max_prompt_length=LONGTAIL["prompt"][1] + 4 if longtail else spec["prompt_len"] + 4,
        dtype=("bfloat16" if spec.get("bf16") else "float32") if spec["device"] == "cpu" else "auto",
        device=spec["device"], precompute_ref_logps=precompute, seed=spec["seed"], logprob_chunk_size=chunk,
        **chosen))
    from rl.engine.pipeline import ForwardBackwardPipeline

    # Step ends, measured the same way as on the TRL side (intervals between consecutive optimizer steps).
    wall, cpu = [time.perf_counter()], [time.process_time()]
    original = ForwardBackwardPipeline._optim_step

    def timed_optim_step(self, *a, **kw):
        out = original(self, *a, **kw)
        if spec["device"].startswith("cuda"):
            torch.cuda.synchronize()
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
        return out

    ForwardBackwardPipeline._optim_step = timed_optim_step
    import rl.engine.chunked as engine

    chunked = []  # training forwards that ran the LM head chunk by chunk (rl.engine.chunked)
    real_capture = engine.capture_head
    engine.capture_head = lambda *a, **k: chunked.append(1) or real_capture(*a, **k)
    trainer = DPOTrainer(cfg)
    ds = PreferenceDataset(P, C, R, trainer.tokenizer, cfg.max_length, cfg.max_prompt_length)
    assert ds.truncation["prompts_truncated"] == ds.truncation["answers_truncated"] == 0
    if not longtail:
        assert {len(e["prompt_ids"]) for e in ds.examples} == {spec["prompt_len"]}
        assert {len(e["chosen_ids"]) for e in ds.examples} == {spec["answer_len"]}
    t0 = time.perf_counter()
    wall[0], cpu[0] = t0, time.process_time()
    history = trainer.train(ds)
    total = time.perf_counter() - t0
    # positions per training forward of one step's pairs: padded (2B rows x the longest) or packed rows
    rows = trainer._collate(ds.examples[:spec["pairs"]], ds.pad_token_id)["input_ids"]
    inner = [h["step_time"] for h in history]  # the trainer's own per-step clock, for comparison
    return {"step_times": [b - a for a, b in zip(wall, wall[1:])],
            "step_cpu_times": [b - a for a, b in zip(cpu, cpu[1:])], "x_trainer_step_time_s": inner,
            "x_train_wall_s": total, "x_first_loss": history[0]["loss"], "x_chunked_training_forwards": len(chunked),
            "x_forward_rows_x_width": list(rows.shape)}


def side_trl(spec: dict, precompute: bool) -> dict:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig as TRLDPOConfig
    from trl import DPOTrainer as TRLDPOTrainer

    from rl.models.loading import load_causal_lm, load_tokenizer

    n = _n_steps(spec)
    P, C, R = _data(spec)
    ends: list[float] = []
    cpu: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_step_end(self, args, state, control, **kw):
            if spec["device"].startswith("cuda"):
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            cpu.append(time.process_time())

    cuda = spec["device"].startswith("cuda")
    args = TRLDPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=spec["pairs"], max_steps=n,
        learning_rate=1e-6, lr_scheduler_type="constant", max_grad_norm=1.0, beta=0.1, bf16=cuda or bool(spec.get("bf16")),
        gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no", use_cpu=not cuda,
        max_length=_max_length(spec), seed=spec["seed"], disable_tqdm=True,
        precompute_ref_log_probs=precompute)
    model = load_causal_lm(spec["model"], dtype="float32")
    trainer = TRLDPOTrainer(model=model, args=args, processing_class=load_tokenizer(spec["model"]),
                            train_dataset=Dataset.from_dict({"prompt": P, "chosen": C, "rejected": R}),
                            callbacks=[Clock()])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    # With precompute_ref_log_probs TRL scores the data inside train(), before its first step: that lands
    # in step 1's interval, which is a warm-up step (excluded), as on our side.
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return {"step_times": [b - a for a, b in zip(ends, ends[1:])],
            "step_cpu_times": [b - a for a, b in zip(cpu, cpu[1:])], "x_train_wall_s": total,
            "x_first_loss": logs[0]["loss"] if logs else None}


SIDES = {
    "trl": lambda s: side_trl(s, False),
    "trl_precompute": lambda s: side_trl(s, True),
    "ours": lambda s: side_ours(s, False),
    "ours_padded": lambda s: side_ours(s, False, packing=False),
    "ours_full": lambda s: side_ours(s, False, chunk=0, packing=False),
    "ours_precompute": lambda s: side_ours(s, True),
    "ours_packed": lambda s: side_ours(s, False, packing=True),
    "ours_packed_precompute": lambda s: side_ours(s, True, packing=True),
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if harness.side_main(SIDES, argv):
        return
    p = harness.common_args(__doc__)
    p.add_argument("--pairs", type=int, default=8, help="preference pairs per optimizer step")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=192, help="answer tokens including EOS")
    p.add_argument("--family", default="llama")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None, help="widen the tiny model's vocabulary (e.g. 49152, 152064)")
    p.add_argument("--lengths", choices=("fixed", "longtail"), default="fixed",
                   help="fixed: --prompt-len/--answer-len; longtail: prompts 16-256, answers 16-512 tokens")
    p.add_argument("--model", default=None, help="an existing model dir (or a packaged name, e.g. "
                   "smollm2-135m-instruct) instead of writing a tiny one")
    p.add_argument("--threads", type=int, default=None, help="torch threads per side (default: torch's)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU on both sides (ours dtype "
                   "bfloat16, TRL bf16=True), fp32 weights")
    p.add_argument("--sides", default="trl,ours_precompute,ours,trl_precompute",
                   help="comma-separated sides; the first is the baseline")
    a = p.parse_args(argv)
    model = a.model
    if model is not None:
        from rl.models.sources import resolve_model_path

        model = resolve_model_path(model)
    if model is None:
        from rl.models.tiny import write_tiny_model

        model = str(write_tiny_model(harness.RESULTS / f"tiny-{a.family}-h{a.hidden}-l{a.layers}", family=a.family,
                                     hidden=a.hidden, layers=a.layers, heads=a.heads))
        if a.vocab:
            model = widen_vocab(model, a.vocab)
    from transformers import AutoConfig, AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())
    print(f"model {model}: {n_params / 1e6:.2f}M parameters; {a.pairs} pairs/step of {a.prompt_len}+{a.answer_len} "
          f"tokens; device {a.device}")
    spec = {"model": model, "n_params": n_params, "device": a.device, "pairs": a.pairs, "prompt_len": a.prompt_len,
            "answer_len": a.answer_len, "steps": a.steps, "warmup": a.warmup, "seed": a.seed, "lengths": a.lengths,
            "vocab": a.vocab, "threads": a.threads, "bf16": a.bf16}
    if a.lengths == "longtail":
        P, C, R = _data(spec)
        rows = [len(p) + 1 + max(len(c), len(r)) + 1 for p, c, r in zip(P, C, R)]
        print(f"long-tailed pairs: prompt+answer tokens per pair {sorted(rows)} (padded to {max(rows)})")
    sides = a.sides.split(",")
    print(f"load average at the start {os.getloadavg()}")
    harness.main_side_by_side("dpo", __file__, spec, sides, baseline=sides[0], rounds=a.rounds)
    print(f"load average at the end {os.getloadavg()}")


def widen_vocab(model_dir: str, vocab: int) -> str:
    """A copy of the tiny model with a `vocab`-wide embedding and (tied) LM head, saved beside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(f"{model_dir}-v{vocab}")
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.resize_token_embeddings(vocab, mean_resizing=False)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return str(out)


if __name__ == "__main__":
    main()
