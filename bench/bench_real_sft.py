"""SFT step time and memory on a real model: rl.trainers.sft vs TRL 1.16's SFTTrainer, side by side.

Model: SmolLM2-135M-Instruct (`--model`, default `smollm2-135m-instruct`, resolved by rl.models.loading),
fp32 weights, 2 threads per side (`--threads`). Data: `--rows` chat rows (default 64) of a user question
and an assistant answer made of English words, each row's length drawn long-tailed in 42-404 tokens
(chat template included), the same rows on both sides. Completion-only loss on both (ours: `messages`
rows, the last assistant turn is the completion; TRL: conversational prompt/completion rows). Batch 8
(`--batch`), AdamW lr 2e-5 constant, clip 1.0, no gradient checkpointing. Both sides take the rows in
file order (no shuffle: TRL's sampler made sequential, our epoch shuffle off), so step k holds the
same 8 rows on every side. Sides:

    ours_padded            rl SFT, micro-batches right-padded to their longest row
    ours_packing           rl SFT, packing: true (one row per micro-batch, per-example attention,
                           rl.engine.segments; the rows' common system-prompt prefix computed once,
                           share_prompt_forward's default)
    ours_packing_noshare   the same with share_prompt_forward: false (every row computes its own prefix)
    ours_packing_mask      the same without rl.engine.segments: SDPA under transformers' block-diagonal mask
    ours_packing_untuned   ours_packing without the malloc tuning our CPU training applies (rl.engine.host_memory)
    trl_padded             TRL SFTConfig defaults (padded batches)
    trl_padding_free       TRL SFTConfig(padding_free=True): one row per batch, position_ids, SDPA
                           under the block-diagonal mask (its varlen kernel is flash attention: GPU only)
    *_bf16                 the same with bf16 autocast (ours dtype: bfloat16; TRL bf16=True), fp32 weights
    trl_*_malloc           TRL's side with the malloc tuning ours applies (what TRL would gain from it)

Step time is the interval between consecutive optimizer-step ends, wall and process CPU (all threads),
peak RSS per side process; the load average is printed and saved. Run:

    python bench/bench_real_sft.py --rounds 1 --steps 2           # a quick look
    python bench/bench_real_sft.py --rounds 3                     # the README figures
    python bench/bench_real_sft.py --sides trl_padding_free,ours_packing,trl_padding_free_bf16,ours_packing_bf16
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

WORDS = ("the of and to in is it that for on with as was at by be this from or have an are not but what all "
         "were when we there can one which do their if will up other about out many then them these so some "
         "her would make like him into time has look two more write go see number no way could people my "
         "than first water been call who oil its now find long down day did get come made may part").split()


def make_rows(n: int, tokenizer, seed: int, lo: int = 42, hi: int = 404, median: int = 110) -> list[dict]:
    """`n` chat rows whose tokenized length (chat template, prompt + answer + EOS) lies in [lo, hi],
    drawn log-normal around `median`; the first row is `lo` long and the second `hi`, so the range is hit."""
    from rl.data.chat import render_chat

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target = lo if i == 0 else hi if i == 1 else max(lo, min(hi, round(median * rng.lognormvariate(0, 0.7))))
        q = " ".join(rng.choice(WORDS) for _ in range(max(3, target // 6)))
        a_words = [rng.choice(WORDS) for _ in range(target)]
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ""}]
        prompt = render_chat(tokenizer, msgs[:1], add_generation_prompt=True)
        base = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) + 1  # + EOS
        k = max(1, target - base)  # one token per word (common words, leading space)
        msgs[1]["content"] = " ".join(a_words[:k])
        rows.append({"messages": msgs})
    return rows


def step_tokens(lengths: list[int], batch: int, steps: int) -> list[int]:
    """Input tokens of each step's rows, the rows taken in order and again from the start each epoch."""
    n = len(lengths)
    return [sum(lengths[(i * batch + j) % n] for j in range(batch)) for i in range(steps)]


def _setup(spec):
    import torch

    torch.set_num_threads(spec["threads"])
    from rl.models.loading import load_tokenizer

    tok = load_tokenizer(spec["model"])
    return tok, make_rows(spec["rows"], tok, spec["seed"])


def _malloc(keep_memory: bool | None) -> None:
    """None: as shipped (our CPU training tunes malloc, TRL does not); True: tuned; False: never."""
    from rl.engine import host_memory

    if keep_memory:
        host_memory.keep_freed_memory()
    elif keep_memory is False:
        host_memory.keep_freed_memory = lambda: False


def side_ours(spec: dict, packing: bool, bf16: bool, segments: bool = True, share: bool = True,
              keep_memory: bool | None = None) -> dict:
    import torch

    _malloc(keep_memory)

    from rl.config.fields import build
    from rl.data.sft import tokenize_examples
    from rl.engine import segments as seg
    from rl.engine.pipeline import ForwardBackwardPipeline
    from rl.trainers.sft import SFTConfig, SFTTrainer

    _, rows = _setup(spec)
    cfg = build(SFTConfig, dict(
        model_name=spec["model"], output_dir=tempfile.mkdtemp(prefix="bench-sft-"), report_to=["none"],
        per_device_train_batch_size=spec["batch"], max_steps=spec["warmup"] + spec["steps"], learning_rate=2e-5,
        lr_scheduler_type="constant", max_grad_norm=1.0, max_length=1024, seed=spec["seed"], packing=packing,
        dtype="bfloat16" if bf16 else "float32", share_prompt_forward=share))
    cfg.shuffle = False  # file order, as the TRL side (rl.trainers.epoch reads it)
    if not segments:
        seg.enable = lambda model: False
    wall, cpu = [0.0], [0.0]
    original = ForwardBackwardPipeline._optim_step

    def timed(self, *a, **kw):
        out = original(self, *a, **kw)
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
        return out

    ForwardBackwardPipeline._optim_step = timed
    trainer = SFTTrainer(cfg)
    data = tokenize_examples(rows, trainer.tokenizer, cfg)
    lengths = [len(e["input_ids"]) for e in data]
    wall[0], cpu[0] = time.perf_counter(), time.process_time()
    history = trainer.train(data)
    return {"step_times": [b - a for a, b in zip(wall, wall[1:])],
            "step_cpu_times": [b - a for a, b in zip(cpu, cpu[1:])], "x_first_loss": history[0]["loss"],
            "x_tokens_per_step": step_tokens(lengths, spec["batch"], len(history)),
            "x_attn": trainer.pipeline.unwrapped_model.config._attn_implementation, "x_torch_threads": torch.get_num_threads()}


def side_trl(spec: dict, padding_free: bool, bf16: bool, keep_memory: bool | None = None) -> dict:
    import torch

    _malloc(keep_memory)
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl import SFTConfig as TRLSFTConfig
    from trl import SFTTrainer as TRLSFTTrainer

    from rl.models.loading import load_causal_lm

    tok, rows = _setup(spec)
    ends, cpu = [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            cpu.append(time.process_time())

    class InOrder(TRLSFTTrainer):
        def _get_train_sampler(self, *a, **kw):  # file order, as our side
            return SequentialSampler(self.train_dataset)

    args = TRLSFTConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-sft-"), per_device_train_batch_size=spec["batch"],
        max_steps=spec["warmup"] + spec["steps"], learning_rate=2e-5, lr_scheduler_type="constant",
        max_grad_norm=1.0, bf16=bf16, gradient_checkpointing=False, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=spec["device"] == "cpu", max_length=None if padding_free else 1024, seed=spec["seed"], disable_tqdm=True,
        padding_free=padding_free, dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in rows])
    model = load_causal_lm(spec["model"], dtype="float32")
    trainer = InOrder(model=model, args=args, processing_class=tok, train_dataset=data, callbacks=[Clock()])
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return {"step_times": [b - a for a, b in zip(ends, ends[1:])],
            "step_cpu_times": [b - a for a, b in zip(cpu, cpu[1:])], "x_first_loss": logs[0]["loss"] if logs else None,
            "x_tokens_per_step": step_tokens(lengths, spec["batch"], len(logs)),
            "x_attn": model.config._attn_implementation, "x_torch_threads": torch.get_num_threads()}


SIDES = {
    "ours_padded": lambda s: side_ours(s, False, False),
    "ours_packing": lambda s: side_ours(s, True, False),
    "ours_packing_mask": lambda s: side_ours(s, True, False, segments=False),
    "ours_packing_noshare": lambda s: side_ours(s, True, False, share=False),
    "ours_packing_untuned": lambda s: side_ours(s, True, False, keep_memory=False),
    "trl_padded": lambda s: side_trl(s, False, False),
    "trl_padding_free": lambda s: side_trl(s, True, False),
    "ours_padded_bf16": lambda s: side_ours(s, False, True),
    "ours_packing_bf16": lambda s: side_ours(s, True, True),
    "ours_packing_bf16_untuned": lambda s: side_ours(s, True, True, keep_memory=False),
    "trl_padded_bf16": lambda s: side_trl(s, False, True),
    "trl_padding_free_bf16": lambda s: side_trl(s, True, True),
    "trl_padding_free_malloc": lambda s: side_trl(s, True, False, keep_memory=True),
    "trl_padding_free_bf16_malloc": lambda s: side_trl(s, True, True, keep_memory=True),
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if harness.side_main(SIDES, argv):
        return
    p = harness.common_args(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch threads per side")
    p.add_argument("--sides", default="trl_padding_free,ours_packing,ours_padded,trl_padded",
                   help="comma-separated sides; the first is the baseline")
    a = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    from rl.models.loading import load_tokenizer

    tok = load_tokenizer(a.model)
    rows = make_rows(a.rows, tok, a.seed)
    from rl.data.chat import render_chat

    lens = [len(tok(render_chat(tok, r["messages"][:1], add_generation_prompt=True) + r["messages"][1]["content"],
                    add_special_tokens=False)["input_ids"]) + 1 for r in rows]
    steps = a.warmup + a.steps
    print(f"model {a.model}; {a.rows} chat rows of {min(lens)}-{max(lens)} tokens (median {sorted(lens)[len(lens) // 2]}),"
          f" batch {a.batch}, {steps} steps ({a.warmup} untimed); tokens per step "
          f"{step_tokens(lens, a.batch, steps)}; load average {os.getloadavg()}")
    spec = {"model": a.model, "device": a.device, "pairs": a.batch, "rows": a.rows, "batch": a.batch,
            "steps": a.steps, "warmup": a.warmup, "seed": a.seed, "threads": a.threads,
            "load_avg_start": os.getloadavg()}
    sides = a.sides.split(",")
    out = harness.main_side_by_side("real_sft", __file__, spec, sides, baseline=sides[0], rounds=a.rounds)
    print(f"load average at the end {os.getloadavg()} (start {spec['load_avg_start']})")
    return out


if __name__ == "__main__":
    main()
