"""Does DPO teach a real pretrained model? Ours vs TRL 1.16's DPOTrainer on SmolLM2-135M-Instruct, over seeds.

The target can be learnt and its held-out measure cannot be gamed: preference pairs on the chat-format sums
of data/smollm2/ where the chosen answer is the correct sentence ("26 + 28 = 54") and the rejected one is the
same sentence off by one ("26 + 28 = 53" and "26 + 28 = 55": both signs, so a bias towards larger or smaller
numbers wins nothing). Training pairs come from the 128 math_train problems (256 pairs); the measures are on
held-out problems of math_test.jsonl that no pair was made from:

* greedy held-out accuracy (`before`, `after`, `gain`): the neutral evaluator of bench/bench_real_grpo.py
  (transformers' greedy `generate` on the first --eval-n problems, the last number must be the sum);
* held-out preference accuracy (`pref_acc`): over both off-by-one pairs of the first --pref-n held-out
  problems, the fraction where the trained model's log-prob margin log p(chosen) - log p(rejected) exceeds
  the base model's margin on the same pair (the sign of DPO's implicit reward margin), computed by one
  neutral function (`answer_logps`: a plain transformers forward), not by either trainer's code.
  `pref_abs_before`/`pref_abs_after`: the fraction where log p(chosen) > log p(rejected) outright.

Both sides get the same model, the same pairs as conversational messages (each trainer tokenises them
itself; tests/integration/test_real.py checks the two agree on the first step to 1e-4), LoRA (rank 8,
alpha 16, dropout 0, "all-linear"; the reference is the policy with its adapters off on both) or, with
--full, a full fine-tune (reference: a frozen copy), the sigmoid loss with the same beta, learning rate
(constant, no warmup), AdamW (fused, betas 0.9/0.999, eps 1e-8, no weight decay), gradient clipping 1.0,
pairs per step, steps, fp32, no gradient checkpointing (TRL defaults to it), a live reference forward every
step (TRL's default; no precomputation on either side), max_length 128. Each (side, seed) trains in its own
child process, interleaved (ours s0, trl s0, ours s1, ...); the parent evaluates the saved models.

    python bench/bench_real_dpo.py                            # 3 seeds x 2 sides, the default budget
    python bench/bench_real_dpo.py --steps 2 --eval-n 8 --pref-n 8 --seeds 0   # a quick check of the script

Writes bench/results/real_dpo.json (the schema of real_grpo.json, plus pref_acc per run) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RL_NO_PROGRESS", "1")

from bench.bench_real_grpo import (  # noqa: E402  (after the path set-up above)
    DATA,
    child,
    greedy_accuracy,
    held_out,
    load_for_eval,
    problems,
    report_child,
    summarize,
    table,
    versions,
)


def pairs(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(question, chosen, rejected) for every problem, twice: rejected off by +1 and by -1."""
    return [(p["question"], f"{p['a']} + {p['b']} = {p['a'] + p['b']}", f"{p['a']} + {p['b']} = {p['a'] + p['b'] + d}")
            for p in rows for d in (1, -1)]


def messages(ps):
    """Pairs as TRL's conversational columns: prompts, chosen and rejected as message lists."""
    return ([[{"role": "user", "content": q}] for q, _, _ in ps],
            [[{"role": "assistant", "content": c}] for _, c, _ in ps],
            [[{"role": "assistant", "content": r}] for _, _, r in ps])


# ------------------------------------------------------------------------------------------ the sides
def run_ours(model_dir: str, a, out: str) -> dict:
    from rl.config.fields import build
    from rl.data.preference import PreferenceDataset
    from rl.trainers.dpo import DPOConfig, DPOTrainer

    cfg = build(DPOConfig, dict(
        model_name=model_dir, output_dir=out, seed=a.seed, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_ratio=0.0, optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=1.0, max_steps=a.steps,
        per_device_train_batch_size=a.pairs, gradient_accumulation_steps=1, beta=a.beta, loss_type="sigmoid", label_smoothing=0.0,
        max_length=128, max_prompt_length=96, precompute_ref_logps=False, dtype="float32",
        gradient_checkpointing=False, report_to=["none"], logging_steps=1, eval_steps=0, save_merged=bool(a.lora),
        lora={"enabled": bool(a.lora), "rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}))
    trainer = DPOTrainer(cfg)
    ds = PreferenceDataset(*messages(pairs(problems(DATA / "math_train.jsonl"))), trainer.tokenizer,
                           max_length=128, max_prompt_length=96)
    t0, c0 = time.time(), time.process_time()
    history = trainer.train(ds)
    train_s, train_cpu = time.time() - t0, time.process_time() - c0
    final = Path(out) / "final"
    trainer.save(str(final))
    losses = [r["loss"] for r in history if "loss" in r]
    return {"train_s": train_s, "train_cpu_s": train_cpu, "loss_first": losses[0], "loss_last": losses[-1],
            "model": str(final / "merged" if a.lora else final)}


def run_trl(model_dir: str, a, out: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = DPOConfig(output_dir=out, seed=a.seed, bf16=False, use_cpu=True, learning_rate=a.lr,
                     lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch_fused", weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                     gradient_checkpointing=False, max_steps=a.steps, per_device_train_batch_size=a.pairs,
                     gradient_accumulation_steps=1, beta=a.beta, loss_type=["sigmoid"], label_smoothing=0.0,
                     max_length=128, precompute_ref_log_probs=False,
                     logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
    P, C, R = messages(pairs(problems(DATA / "math_train.jsonl")))
    peft = (LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
            if a.lora else None)
    trainer = DPOTrainer(model=model, args=args, processing_class=tok, peft_config=peft, callbacks=[Losses()],
                         train_dataset=Dataset.from_dict({"prompt": P, "chosen": C, "rejected": R}))
    t0, c0 = time.time(), time.process_time()
    trainer.train()
    train_s, train_cpu = time.time() - t0, time.process_time() - c0
    final = Path(out) / "final"
    trained = trainer.model.merge_and_unload() if a.lora else trainer.model
    trained.save_pretrained(final, safe_serialization=True)
    tok.save_pretrained(final)
    return {"train_s": train_s, "train_cpu_s": train_cpu, "loss_first": losses[0], "loss_last": losses[-1],
            "model": str(final)}


# ------------------------------------------------------------------------------------- the evaluator
def answer_logps(tok, model, questions: list[str], answers: list[str], batch: int = 32):
    """(N,) summed log-prob of each answer (its text then <|im_end|>) after its question as a ChatML user turn
    with the assistant header: one plain forward per chunk, left-padded so every row's answer ends at the
    right edge and the LM head runs over the last positions only (`logits_to_keep`)."""
    import torch

    from bench.bench_real_grpo import chat_prompt

    eos = tok.eos_token_id
    out = []
    for i in range(0, len(questions), batch):
        rows, lens = [], []
        for q, ans in zip(questions[i:i + batch], answers[i:i + batch]):
            p_ids = tok(chat_prompt(tok, q), add_special_tokens=False)["input_ids"]
            a_ids = tok(ans, add_special_tokens=False)["input_ids"] + [eos]
            rows.append(p_ids + a_ids)
            lens.append(len(a_ids))
        width, k = max(map(len, rows)), max(lens)
        ids = torch.tensor([[eos] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                           logits_to_keep=k + 1).logits[:, :-1].float()  # positions predicting the last k tokens
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, -k:, None])[..., 0]
        keep = torch.arange(k)[None, :] >= (k - torch.tensor(lens))[:, None]
        out.append((lp * keep).sum(-1))
    return torch.cat(out)


def margins(tok, model, ps):
    """(N,) log p(chosen) - log p(rejected) of each (question, chosen, rejected) pair; each distinct
    (question, answer) is scored once (a problem's chosen answer serves both of its pairs)."""
    import torch

    keys = list(dict.fromkeys([(q, c) for q, c, _ in ps] + [(q, r) for q, _, r in ps]))
    lp = dict(zip(keys, answer_logps(tok, model, [q for q, _ in keys], [x for _, x in keys]).tolist()))
    return torch.tensor([lp[(q, c)] - lp[(q, r)] for q, c, r in ps])


def evaluate(model_dir: str, a, base_margins=None) -> dict:
    tok, model = load_for_eval(model_dir)
    acc = greedy_accuracy(tok, model, held_out(a.eval_n), 24)
    m = margins(tok, model, pairs(held_out(a.pref_n)))
    out = {"accuracy": acc, "margins": m, "pref_abs": float((m > 0).float().mean())}
    if base_margins is not None:
        out["pref_acc"] = float((m > base_margins).float().mean())
        out["margin_gain_mean"] = float((m - base_margins).mean())
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per side")
    p.add_argument("--pairs", type=int, default=8, help="pairs per step")
    p.add_argument("--lr", type=float, default=5e-5, help="learning rate")
    p.add_argument("--beta", type=float, default=0.1, help="DPO beta")
    p.add_argument("--lora", type=int, default=1, help="1: LoRA rank 8 (default), 0: full fine-tune")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; each side runs once per seed")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # a child's seed
    p.add_argument("--eval-n", type=int, default=128, help="held-out problems for greedy accuracy (of 256)")
    p.add_argument("--pref-n", type=int, default=32, help="held-out problems for preference accuracy (2 pairs each)")
    p.add_argument("--sides", default="ours,trl", help="comma-separated: ours, trl")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench-real-dpo"))
    p.add_argument("--keep-models", action="store_true", help="keep each run's model (517 MB each)")
    p.add_argument("--out-json", default=str(ROOT / "bench" / "results" / "real_dpo.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        report_child((run_ours if a.child == "ours" else run_trl)(a.model_dir, a, a.out))
        return
    from rl.models.gguf import prepare_packaged

    sides, seeds = a.sides.split(","), [int(s) for s in a.seeds.split(",")]
    model_dir = str(prepare_packaged("smollm2-135m-instruct"))
    work = Path(a.workdir)
    t0 = time.time()
    base = evaluate(model_dir, a)
    result = {"n_eval": a.eval_n, "n_pref_pairs": 2 * a.pref_n, "base": base["accuracy"],
              "base_pref_abs": base["pref_abs"], "base_eval_s": time.time() - t0, "config": vars(a),
              "versions": versions(), "load_start": os.getloadavg()[0], **{side: [] for side in sides}}
    for seed in seeds:
        for side in sides:
            run_dir = work / f"{side}-s{seed}"
            r = child(__file__, side, model_dir, a, seed, str(run_dir), ("steps", "pairs", "lr", "beta", "lora"))
            t_eval = time.time()
            ev = evaluate(r["model"], a, base["margins"])
            if not a.keep_models:
                shutil.rmtree(run_dir, ignore_errors=True)
            result[side].append({"seed": seed, "before": base["accuracy"], "after": ev["accuracy"],
                                 "gain": ev["accuracy"] - base["accuracy"], "seconds": r.pop("train_s"),
                                 "cpu_seconds": r.pop("train_cpu_s"), "pref_acc": ev["pref_acc"],
                                 "pref_abs_before": base["pref_abs"], "pref_abs_after": ev["pref_abs"],
                                 "margin_gain_mean": ev["margin_gain_mean"], "eval_s": time.time() - t_eval, **r})
            print(f"{side} seed {seed}: {100 * base['accuracy']:.1f}% -> {100 * ev['accuracy']:.1f}%, preference "
                  f"accuracy {100 * ev['pref_acc']:.1f}%, in {result[side][-1]['seconds']:.0f} s "
                  f"(load {r['load_before']:.1f})", flush=True)
    result["summary"] = summarize(result, sides)
    for side in sides:
        prefs = [r["pref_acc"] for r in result[side]]
        result["summary"][side].update(pref_acc_mean=statistics.mean(prefs),
                                       pref_acc_std=statistics.stdev(prefs) if len(prefs) > 1 else 0.0)
    result["total_s"] = time.time() - t0
    out = Path(a.out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    label = (f"{'LoRA' if a.lora else 'full fine-tune'}, {a.steps} steps x {a.pairs} pairs, lr {a.lr}, beta {a.beta}, "
             f"seeds {a.seeds}; base prefers the chosen answer on {100 * base['pref_abs']:.1f}% of "
             f"{2 * a.pref_n} held-out pairs")
    print(table(result, sides, label, {f"held-out preference accuracy ({2 * a.pref_n} pairs)": lambda runs: (
        f"{100 * statistics.mean(r['pref_acc'] for r in runs):.1f}% +- "
        f"{100 * (statistics.stdev(r['pref_acc'] for r in runs) if len(runs) > 1 else 0.0):.1f}")}))
    print(f"wrote {out} (total {result['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
