"""Online DPO (rl/trainers/online_dpo.py): pairing and weights by hand; the trainer's loss on fixed sampled pairs equals
our offline DPO's (rl/dpo.py functions) for sigmoid / ipo / hinge, ties left out; the same step equals TRL
1.16's experimental OnlineDPOTrainer.training_step on identical completions; config errors; an "it learns"
run on the tiny model; the launch script end to end with an exact resume."""

from __future__ import annotations

import copy
import json
import shutil
import sys

import pytest
import torch

import rl.engine.tracking
import rl.trainers.online_dpo
from rl.algos.preference import preference_loss
from rl.config.fields import build
from rl.data.preference import collate_pairs
from rl.engine.generation import Rollout
from rl.engine.packing import left_pad
from rl.engine.scoring import concatenated_logps
from rl.errors import ConfigError
from rl.models.loading import load_causal_lm
from rl.rollout.prompts import encode_prompt
from rl.trainers.online_dpo import (
    OnlineDPOConfig,
    OnlineDPOTrainer,
    pair_up,
    pair_weights,
)
from tests.conftest import LEARN_SEED, launch_module, learned, run_cmd

NAN = float("nan")
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
        "logps/chosen", "logps/rejected")


# ------------------------------------------------------------------------------- hand-computed

def test_pair_up_and_weights_hand_computed():
    # pairs: (0.2, 0.9) second wins; (1, 1) tie; (0.5, -1) first wins; (nan, 3) unscored -> tie
    chosen, rejected, tie = pair_up(torch.tensor([0.2, 0.9, 1.0, 1.0, 0.5, -1.0, NAN, 3.0]))
    assert chosen.tolist() == [1, 2, 4, 6] and rejected.tolist() == [0, 3, 5, 7]
    assert tie.tolist() == [False, True, False, True]
    # 2 untied pairs in the step, 2 processes x 3 accumulation = 6 units: w = 6 / 2 = 3 on untied pairs
    assert pair_weights(tie, 2, 6).tolist() == [3.0, 0.0, 3.0, 0.0]
    assert pair_weights(torch.tensor([True, True]), 0, 4).tolist() == [0.0, 0.0]  # all ties: no gradient


def test_config_errors():
    base = {"model_name": "m"}
    for bad, match in (({"beta": 0}, "beta"), ({"loss_type": "orpo"}, "loss_type"),
                       ({"temperature": 0}, "temperature"), ({"label_smoothing": 0.1, "loss_type": "ipo"},
                                                               "label_smoothing"),
                       ({"max_length": 8, "max_completion_length": 8}, "max_length"),
                       ({"max_staleness": 1}, "max_staleness.*asynchronous rollouts are GRPO's"),
                       ({"rollout_processes": 1}, "rollout_processes.*set rollout_processes=0")):
        with pytest.raises(ConfigError, match=match):
            build(OnlineDPOConfig, {**base, **bad})


# ------------------------------------------------------------------------------- fixed pairs

def _fixed_rollout(tok, table: dict):
    """A stand-in for rl.engine.generation.generate that returns fixed completions: `table` maps a prompt's token
    ids to its two completions (token lists), rows interleaved per prompt as generate(num_samples=2) does."""

    def fake_generate(model, tokenizer, prompt_ids, num_samples=1, **kw):
        assert num_samples == 2
        rows = [(p, c) for p in prompt_ids for c in table[tuple(p)]]
        ids, pmask = left_pad([p for p, _ in rows], tok.pad_token_id)
        n = max(len(c) for _, c in rows)
        tokens = torch.full((len(rows), n), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, (_, c) in enumerate(rows):
            tokens[i, :len(c)], mask[i, :len(c)] = torch.tensor(c), 1
        return Rollout(tokens, torch.zeros(len(rows), n), mask, [p for p, _ in rows], ids, pmask, tok.pad_token_id,
                       ["stop" if c[-1] == tok.eos_token_id else "length" for _, c in rows])

    return fake_generate


@pytest.fixture(scope="module")
def perturbed(tiny_llama):
    """The tiny model with seeded noise on every weight: a policy that differs from its reference
    (each test trains a deep copy)."""
    model = load_causal_lm(tiny_llama, dtype="float32")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture
def no_plot(monkeypatch):
    """The runs' metrics.png is not what these tests check (matplotlib costs seconds per run)."""
    monkeypatch.setattr(rl.engine.tracking, "plot_history", lambda *a, **k: None)


def _pairs(tok, prompts):
    """Per prompt two completions, distinct texts of different lengths ending in EOS ->
    ({prompt ids: [ids a, ids b]}, {prompt: (text a, text b)})."""
    table, texts = {}, {}
    for i, p in enumerate(prompts):
        a, b = "ab" * (1 + i % 2) + str(i), "xyz" * (1 + i % 3) + str(i)
        table[tuple(encode_prompt(tok, p, 64))] = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                                                   for x in (a, b)]
        texts[p] = (a, b)
    return table, texts


@pytest.mark.parametrize("loss_type, packing", [("sigmoid", False), ("ipo", False), ("hinge", False),
                                               ("sigmoid", True)])
def test_loss_on_fixed_pairs_equals_offline_dpo(loss_type, packing, tiny_llama, tiny_tokenizer, perturbed, tmp_path,
                                                monkeypatch, no_plot):
    """One step on 4 prompts in 2 micro-batches of 2, one pair a tie: the logged loss and TRL-named metrics
    equal rl.dpo's collate_pairs + concatenated_logps + preference_loss on the 3 untied pairs (1e-6, relative
    for values above 1: the logps/* sums are ~35, the IPO loss ~3, in fp32), so the
    left-padded rollout rows, the re-ordering into [chosen..., rejected...], the reference log-probs and the
    tie-aware exact mean across micro-batches change nothing; with packing=true (padding-free rows) neither."""
    tok = tiny_tokenizer
    prompts = ["1+1=", "what is 7*6? ", "hi", "a longer prompt here: "]
    table, texts = _pairs(tok, prompts)
    # reward: each prompt's first answer wins, except for "hi" whose two answers tie
    score = {x: (0.5 if p == "hi" else 1.0 - j) for p, ab in texts.items() for j, x in enumerate(ab)}

    def reward(prompts, completions, **kw):
        return [score[c] for c in completions]

    monkeypatch.setattr(rl.trainers.online_dpo, "generate", _fixed_rollout(tok, table))
    packed_calls = []
    real_pack = rl.trainers.online_dpo.pack_rollout_rows
    monkeypatch.setattr(rl.trainers.online_dpo, "pack_rollout_rows", lambda *a: packed_calls.append(1) or real_pack(*a))
    policy = perturbed
    cfg = build(OnlineDPOConfig, dict(model_name=tiny_llama, ref_model=tiny_llama, output_dir=str(tmp_path),
                                      report_to=["none"], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                                      loss_type=loss_type, beta=0.3, max_length=72, max_completion_length=8,
                                      learning_rate=1e-3, dtype="float32", packing=packing))
    t = OnlineDPOTrainer(cfg, model=copy.deepcopy(policy), tokenizer=tok, reward_funcs=[reward],
                         train_prompts=[{"prompt": p} for p in prompts])
    row = t.train()[0]
    assert row["online_dpo/ties"] == pytest.approx(0.25)
    assert len(packed_calls) == (2 if packing else 0)  # one packed forward per micro-batch

    examples = []
    for p in prompts:
        if p == "hi":
            continue
        c, r = table[tuple(encode_prompt(tok, p, 64))]
        examples.append({"prompt_ids": encode_prompt(tok, p, 64), "chosen_ids": c, "rejected_ids": r})
    b = collate_pairs(examples, tok.pad_token_id)
    ref = load_causal_lm(tiny_llama, dtype="float32")
    c, r, cl, rl_ = concatenated_logps(policy, b)
    rc, rr, _, _ = concatenated_logps(ref, b)
    per_pair, stats = preference_loss(loss_type, c, r, rc, rr, cl, rl_, 0.3)
    want = {"loss": float(per_pair.mean()), **{k: float(v.float().mean()) for k, v in stats.items()}}
    assert abs(want["rewards/margins"]) > 1e-3  # the policy differs from its reference: not a trivial log 2
    for k in KEYS:  # fp32: left- vs right-padded batches round differently, ~1e-7 relative
        assert row[k] == pytest.approx(want[k], abs=1e-6, rel=1e-6), k
    # objective/scores is the mean reward of all 8 completions; kl from the trained answers
    assert row["objective/scores"] == pytest.approx(sum(reward(None, [x for ab in texts.values() for x in ab])) / 8)
    assert row["objective/kl"] == pytest.approx(float(torch.cat([c - rc, r - rr]).mean()), abs=1e-5)


def test_step_equals_trl_online_dpo_training_step(tiny_llama, tiny_tokenizer, perturbed, tmp_path, monkeypatch,
                                                  no_plot):
    """TRL 1.16's experimental OnlineDPOTrainer.training_step and ours on the same 4 prompts, the same two
    completions each (its _generate replaced by the same fixed tokens) and the same reward: equal loss and
    rewards/* (1e-6). Prompts of one length: TRL's forward passes no position ids, so left padding would
    shift its positions (ours count from the first real token). One completion lacks its EOS and
    missing_eos_penalty turns its pair around in both. Sigmoid only: TRL's online IPO sums the log-ratios
    where ours (and TRL's offline DPOTrainer) averages them per token."""
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig as TRLConfig
    from trl.experimental.online_dpo import OnlineDPOTrainer as TRLTrainer

    tok = tiny_tokenizer
    prompts = ["q1: aaa", "q2: bbb", "q3: ccc", "q4: ddd"]
    table, texts = _pairs(tok, prompts)
    score = {x: float(i) for i, x in enumerate(sorted({x for ab in texts.values() for x in ab}))}
    assert all(score[a] != score[b] for a, b in texts.values())  # no ties: TRL keeps them, we skip them
    winner = list(table)[1]
    table[winner][1] = table[winner][1][:-1]  # the higher-scored answer of prompt 2 without EOS: penalised
    assert score[texts[prompts[1]][1]] > score[texts[prompts[1]][0]]

    def reward(prompts, completions, **kw):
        return [score[c] for c in completions]

    policy, beta = perturbed, 0.2
    ordered = list(table)  # prompt ids in prompt order
    # activation_checkpointing off by its current name: TRL's default (on) goes through a deprecated alias
    args = TRLConfig(output_dir=str(tmp_path / "trl"), activation_checkpointing=False,
                     per_device_train_batch_size=4, beta=beta, loss_type="sigmoid",
                     bf16=False, use_cpu=True, report_to="none", max_new_tokens=8, max_length=72, seed=0,
                     disable_dropout=True, learning_rate=1e-3, missing_eos_penalty=10.5)
    theirs = TRLTrainer(model=copy.deepcopy(policy), ref_model=load_causal_lm(tiny_llama, dtype="float32"),
                        reward_funcs=[reward], args=args, processing_class=tok,
                        train_dataset=Dataset.from_dict({"prompt": prompts}))

    def trl_generate(model, prompts_, images=None):
        # TRL's layout: [first samples of all prompts..., second samples...]
        ids, pmask = left_pad([list(p) for p in ordered] * 2, tok.pad_token_id)
        comps = [table[p][0] for p in ordered] + [table[p][1] for p in ordered]
        n = max(map(len, comps))
        cids = torch.tensor([c + [tok.pad_token_id] * (n - len(c)) for c in comps])
        cmask = torch.tensor([[1] * len(c) + [0] * (n - len(c)) for c in comps])
        return ids, pmask, cids, cmask, None

    theirs._generate = trl_generate
    trl_loss = float(theirs.training_step(theirs.model, {"prompt": prompts}))

    monkeypatch.setattr(rl.trainers.online_dpo, "generate", _fixed_rollout(tok, table))
    cfg = build(OnlineDPOConfig, dict(model_name=tiny_llama, ref_model=tiny_llama, output_dir=str(tmp_path / "o"),
                                      report_to=["none"], per_device_train_batch_size=4, max_steps=1, beta=beta, max_length=72,
                                      max_completion_length=8, learning_rate=1e-3, dtype="float32",
                                      missing_eos_penalty=10.5))
    row = OnlineDPOTrainer(cfg, model=copy.deepcopy(policy), tokenizer=tok, reward_funcs=[reward],
                           train_prompts=[{"prompt": p} for p in prompts]).train()[0]
    assert row["online_dpo/ties"] == 0.0
    assert row["loss"] == pytest.approx(trl_loss, abs=1e-6)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
              "logps/rejected", "objective/scores", "objective/scores_margin"):
        assert row[k] == pytest.approx(theirs.stats[k][-1], abs=1e-6, rel=1e-6), k
    assert abs(row["rewards/margins"]) > 1e-3


# ------------------------------------------------------------------------------- it learns

def test_it_learns_a_printable_fraction(tiny_llama, tmp_path, no_plot):
    """Reward: the fraction of max_completion_length filled with printable ASCII characters (optimum 1.0; a
    random byte-level model starts near 95/259 per token). Two samples per prompt, the better one chosen:
    the mean score of the last 3 steps exceeds that of the first 3 by 0.15. Measured (RL_TEST_SEED 0-3, default
    threads; seeds 1-2 also with 1 thread and with AVX2 kernels, bench/learning_spread.py's variants): gain
    0.264 to 0.285 (the same value under every variant of a seed), so the bar has a margin of 0.11."""
    L = 4

    def printable(prompts, completions, **kw):
        return [sum(" " <= ch <= "~" for ch in c) / L for c in completions]

    cfg = build(OnlineDPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path), learning_rate=1e-2,
                                      lr_scheduler_type="constant", per_device_train_batch_size=32, max_completion_length=L, max_length=16,
                                      max_steps=8, beta=0.1, report_to=["jsonl"], seed=LEARN_SEED))
    rows = [{"prompt": f"{a}+{b}="} for a in range(10) for b in range(10)]
    t = OnlineDPOTrainer(cfg, reward_funcs=[printable], train_prompts=rows)
    h = t.train()
    assert t.reference.mode == "copy" and len(h) == 8
    first, last = (sum(r["objective/scores"] for r in part) / 3 for part in (h[:3], h[-3:]))
    assert 0 < h[0]["online_dpo/ties"] < 1
    assert learned("online_dpo_score_gain", last - first) > 0.15, (first, last)


# ------------------------------------------------------------------------------- launch

def test_launch_end_to_end_and_exact_resume(tmp_path, tiny_llama, capsys):
    """The tiny recipe for 2 steps in a subprocess, a checkpoint each step; then the last checkpoint is removed
    and the launch script's main() resumes (resume=auto) from step 1: its step 2 equals the uninterrupted one
    (the step's prompts and sampling seeds are functions of the step; the optimizer state comes back bitwise).
    A user mistake is one `error:` line and exit 2."""
    out = tmp_path / "run"
    args = ["--config", "recipes/tiny/online_dpo.yaml", f"output_dir={out}", "max_steps=2", "save_steps=1",
            "per_device_train_batch_size=8", "max_completion_length=4", "report_to=[jsonl]"]
    p = run_cmd([sys.executable, "launch/online_dpo.py", *args], timeout=300)
    assert "online_dpo done: 2 steps" in p.stdout and (out / "model.safetensors").exists()
    first = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = [r for r in first if "loss" in r]
    assert [r["step"] for r in first] == [1, 2] and "online_dpo/ties" in first[0]

    shutil.rmtree(out / "checkpoints" / "checkpoint-2")
    main = launch_module("online_dpo").main
    main([*args, "resume=auto"])
    assert f"resumed from {out / 'checkpoints' / 'checkpoint-1'}" in capsys.readouterr().out
    again = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    again = [r for r in again if "loss" in r][-1]
    assert again["step"] == 2
    for k in ("loss", "objective/scores", "rewards/margins", "grad_norm"):
        assert again[k] == pytest.approx(first[-1][k], abs=1e-6), k

    with pytest.raises(SystemExit) as e:
        main([*args[:2], f"output_dir={tmp_path / 'x'}", "loss_type=orpo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and "loss_type" in err[0]
