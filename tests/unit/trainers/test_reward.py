"""Reward models: pooling, Bradley-Terry math (hand-computed and against TRL), pairwise, multi-objective
masks, save/load, QLoRA on CPU, and an "it learns" run on a synthetic preference set."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from rl.algos.preference import bradley_terry_loss
from rl.algos.reduce import masked_mse
from rl.data.preference import load_preference_pairs, pad_batch
from rl.errors import ConfigError
from rl.models.reward import (
    MultiObjectiveRewardModel,
    PairwiseRewardModel,
    RewardModel,
    RewardModelConfig,
    load_reward_model,
    pool_hidden,
)
from rl.trainers.reward import RewardModelTrainer
from tests.conftest import LEARN_SEED, learned

GOOD = ["good", "nice", "great", "fine"]
BAD = ["bad", "poor", "awful", "rude"]


def synthetic_pairs(n: int, seed: int = 0):
    """Pairs that differ in one word only: the chosen answer has a 'good' word where the rejected one
    has a 'bad' word, at a random position in random filler."""
    rng = random.Random(seed)

    def word():
        return "".join(rng.choice("abcdehjkmqvwxyz") for _ in range(rng.randint(3, 6)))

    prompts, chosen, rejected = [], [], []
    for _ in range(n):
        body = [word() for _ in range(3)]
        k = rng.randint(0, 3)
        c, r = body[:], body[:]
        c.insert(k, rng.choice(GOOD))
        r.insert(k, rng.choice(BAD))
        prompts.append(" ".join(word() for _ in range(2)) + ": ")
        chosen.append(" ".join(c))
        rejected.append(" ".join(r))
    return prompts, chosen, rejected


def make(cls=RewardModel, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("model_name", "tiny:llama")
    kw.setdefault("use_lora", False)
    kw.setdefault("dropout_prob", 0.0)
    kw.setdefault("dtype", "float32")
    return cls(RewardModelConfig(**kw))


TEXTS = ["hello world", "a", "some longer text here!"]


# -------------------------------------------------------------------------------- pure math

def test_pool_hidden_hand_computed():
    hidden = torch.arange(8, dtype=torch.float32).view(2, 4, 1)  # row 0: 0..3, row 1: 4..7
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])  # right-padded, left-padded
    assert pool_hidden(hidden, mask, "last").flatten().tolist() == [1.0, 7.0]
    assert pool_hidden(hidden, mask, "cls").flatten().tolist() == [0.0, 5.0]
    assert pool_hidden(hidden, mask, "mean").flatten().tolist() == [0.5, 6.0]


def test_bradley_terry_hand_computed():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    loss, m = bradley_terry_loss(chosen, rejected)
    # -logsigmoid(1) = log(1 + e^-1) = 0.31326; -logsigmoid(-1) = 1.31326
    assert loss.item() == pytest.approx((0.3132617 + 1.3132617) / 2, abs=1e-6)
    assert m["accuracy"].item() == 0.5 and m["margin"].item() == 0.0
    loss, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, -1.0]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)  # both differences become 0
    loss, _ = bradley_terry_loss(chosen, rejected, center_rewards_coefficient=0.5)
    assert loss.item() == pytest.approx((0.3132617 + 1.3132617) / 2 + 0.5 * 1.0, abs=1e-6)


def test_bradley_terry_matches_trl_reward_trainer(tiny_cache):
    """TRL 1.16's RewardTrainer.compute_loss on the same rewards: loss, accuracy and margin agree."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from rl.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer("tiny:llama")
    hf = load_causal_lm("tiny:llama", task="classifier", dtype="float32")
    # activation_checkpointing off by its current name: TRL's default (on) goes through a deprecated alias
    args = RewardConfig(output_dir=str(tiny_cache / "trl-rm"), bf16=False, activation_checkpointing=False,
                        report_to=[], use_cpu=True,
                        center_rewards_coefficient=0.1)
    trl = RewardTrainer(model=hf, args=args, processing_class=tok,
                        train_dataset=Dataset.from_list([{"chosen": "a b", "rejected": "c"}] * 2))
    rc, rr = torch.tensor([1.0, -0.5, 2.0, 0.3]), torch.tensor([0.0, 0.5, 2.0, -1.2])
    margin = torch.tensor([0.5, 0.0, 1.0, 0.2])
    stub = lambda **kw: SimpleNamespace(logits=torch.cat([rc, rr]).unsqueeze(-1))  # noqa: E731
    trl.model.train()
    ones = torch.ones(8, 2, dtype=torch.long)
    expected = trl.compute_loss(stub, {"input_ids": ones, "attention_mask": ones, "margin": margin})
    ours, m = bradley_terry_loss(rc, rr, margin, center_rewards_coefficient=0.1)
    assert ours.item() == pytest.approx(expected.item(), abs=1e-6)
    assert m["accuracy"].item() == pytest.approx(trl._metrics["train"]["accuracy"][-1], abs=1e-6)
    assert m["margin"].item() == pytest.approx(trl._metrics["train"]["margin"][-1], abs=1e-6)


def test_masked_mse_per_objective_per_entry_and_all_masked():
    pred = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    target = torch.tensor([[0.0, 0.0, float("nan")], [4.0, 3.0, float("nan")]])  # NaN only under the mask
    loss, per = masked_mse(pred, target, torch.tensor([1, 1, 0]))  # per objective (K,)
    # squared errors of the unmasked entries: 1, 4, 0, 4 -> mean 9/4
    assert loss.item() == pytest.approx(9 / 4)
    assert per.tolist() == pytest.approx([0.5, 4.0, 0.0])
    entry = torch.tensor([[1, 0, 0], [1, 1, 0]])  # per entry (B, K): 1, 0, 4 -> 5/3
    loss, per = masked_mse(pred, target, entry)
    assert loss.item() == pytest.approx(5 / 3)
    assert per.tolist() == pytest.approx([0.5, 4.0, 0.0])
    loss, per = masked_mse(pred, target, torch.zeros(3))
    assert loss.item() == 0.0 and loss.requires_grad and per.tolist() == [0.0, 0.0, 0.0]
    loss.backward()
    assert torch.equal(pred.grad, torch.zeros_like(pred))
    with pytest.raises(ValueError, match="objective_mask"):
        masked_mse(pred, target, torch.ones(4))


# -------------------------------------------------------------------------------- models

@pytest.mark.parametrize("family,pooling,lora", [("llama", "last", False), ("llama", "mean", False),
                                                 ("llama", "cls", False), ("gpt2", "last", True)])
def test_left_and_right_padding_give_identical_rewards(tiny_cache, family, pooling, lora):
    m = make(model_name=f"tiny:{family}", pooling_strategy=pooling, use_lora=lora).eval()
    ids = m.encode(TEXTS)
    if pooling == "cls":  # every text starts with BOS, so a causal LM's first state is the same for all
        assert {x[0] for x in ids} == {m.get_tokenizer().bos_token_id}
        ids = [x[1:] for x in ids]  # first tokens that differ: the std check below can see a pooling bug
    right = m(*pad_batch(ids, m.pad_token_id, "right"))["rewards"]
    left = m(*pad_batch(ids, m.pad_token_id, "left"))["rewards"]
    alone = torch.cat([m(*pad_batch([x], m.pad_token_id))["rewards"] for x in ids])
    assert right.shape == (3, 1)
    torch.testing.assert_close(left, right, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, right, atol=1e-5, rtol=1e-5)
    assert right.std() > 0  # different texts, different rewards: the test would see a pooling bug


def test_temperature_scales_rewards_and_lora_targets_all_linear(tiny_cache):
    m = make(model_name="tiny:gpt2", use_lora=True).eval()
    ids, mask = pad_batch(m.encode(TEXTS), m.pad_token_id)
    r1 = m(ids, mask)["rewards"]
    m.config = dataclasses.replace(m.config, temperature=4.0)
    torch.testing.assert_close(m(ids, mask)["rewards"], r1 / 4)
    adapted = {n.split(".lora_A")[0].split(".")[-1] for n, _ in m.named_parameters() if "lora_A" in n}
    assert {"c_attn", "c_proj", "c_fc"} <= adapted  # GPT-2's Conv1D layers, not only q/v
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert "head.weight" in trainable and all("lora_" in n or n.startswith("head.") for n in trainable)


def test_pairwise_batch_size_one(tiny_cache):
    m = make(PairwiseRewardModel).train()
    a, b = pad_batch(m.encode(["short"]), m.pad_token_id), pad_batch(m.encode(["a much longer one"]), m.pad_token_id)
    logit = m.forward_pair(a[0], a[1], b[0], b[1])
    assert logit.shape == (1,)
    ra, rb = m.rewards(*a)[:, 0], m.rewards(*b)[:, 0]
    torch.testing.assert_close(logit, ra - rb, atol=1e-5, rtol=1e-5)
    loss1 = m.compute_bradley_terry_loss(a[0], a[1], b[0], b[1], torch.tensor([1]))
    loss0 = m.compute_bradley_terry_loss(a[0], a[1], b[0], b[1], torch.tensor([0]))
    assert loss1.item() == pytest.approx(-F.logsigmoid(logit).item(), abs=1e-5)
    assert loss0.item() == pytest.approx(-F.logsigmoid(-logit).item(), abs=1e-5)
    loss1.backward()
    assert m.head.weight.grad is not None and m.head.weight.grad.abs().sum() > 0


def test_multi_objective_outputs_masks_and_config_untouched(tiny_cache):
    cfg = RewardModelConfig(model_name="tiny:llama", use_lora=False, dropout_prob=0.0, dtype="float32")
    m = MultiObjectiveRewardModel(cfg, num_objectives=3, objective_weights=[0.5, 0.3, 0.2])
    assert cfg.num_labels == 1 and m.config.num_labels == 3  # the caller's config is not changed
    ids, mask = pad_batch(m.encode(TEXTS), m.pad_token_id)
    out = m(ids, mask, return_all_objectives=True)
    assert out["rewards"].shape == (3, 3) and out["combined_reward"].shape == (3, 1)
    torch.testing.assert_close(out["combined_reward"], out["rewards"] @ torch.tensor([[0.5], [0.3], [0.2]]))
    target = torch.randn(3, 3)
    loss, per = m.compute_multi_objective_loss(ids, mask, target, objective_mask=torch.tensor([[1, 0, 1]] * 3))
    ref, _ = masked_mse(out["rewards"], target, torch.tensor([[1, 0, 1]] * 3))
    torch.testing.assert_close(loss, ref)
    assert per.shape == (3,) and per[1].item() == 0.0
    zero, _ = m.compute_multi_objective_loss(ids, mask, target, objective_mask=torch.zeros(3, 3))
    assert zero.item() == 0.0
    zero.backward()  # all masked still backpropagates (zero gradients)
    assert m.head.weight.grad is not None and m.head.weight.grad.abs().sum() == 0
    torch.testing.assert_close(m.score(TEXTS), out["combined_reward"][:, 0].detach(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="objective_weights"):
        MultiObjectiveRewardModel(cfg, num_objectives=2, objective_weights=[1.0, 2.0, 3.0])


def test_reward_temperature_alias_temperature(tmp_path):
    from rl.config.parse import parse_config
    from rl.trainers.reward_config import RewardTrainConfig

    cfg = RewardModelConfig(temperature=2.0)  # the reference docs' keyword
    assert cfg.reward_temperature == 2.0 and cfg.temperature == 2.0
    assert dataclasses.replace(cfg, reward_temperature=3.0).temperature == 3.0
    recipe = tmp_path / "old.yaml"  # a recipe written before the rename
    recipe.write_text("model_name: tiny:llama\ntemperature: 4.0\n")
    assert parse_config(RewardTrainConfig, ["--config", str(recipe)]).reward_temperature == 4.0
    assert parse_config(RewardTrainConfig, ["--config", str(recipe), "temperature=5"]).reward_temperature == 5.0
    assert parse_config(RewardTrainConfig, ["--config", "recipes/tiny/reward.yaml"]).reward_temperature == 1.0


def test_config_errors():
    with pytest.raises(ConfigError, match="use_lora"):
        RewardModelConfig(load_in_4bit=True, use_lora=False)
    with pytest.raises(ConfigError, match="pooling_strategy"):
        RewardModelConfig(pooling_strategy="max")
    with pytest.raises(ConfigError, match="temperature"):
        RewardModelConfig(temperature=0.0)


# -------------------------------------------------------------------------------- save / load

def _no_pickles(path):
    assert not [p for p in path.rglob("*") if p.suffix in (".bin", ".pt", ".pkl", ".pth")]


def test_full_save_load_round_trip_and_hf_classifier(tiny_cache, tmp_path):
    from transformers import AutoModelForSequenceClassification

    m = make(temperature=2.0).eval()
    with torch.no_grad():
        m.head.weight.normal_()  # make the head matter
    before = m.score(TEXTS)
    m.save(tmp_path / "rm")
    _no_pickles(tmp_path / "rm")
    loaded = load_reward_model(tmp_path / "rm")
    assert torch.equal(loaded.score(TEXTS), before)
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training
    # Without this package: HF's classifier reads the same last token; temperature is folded in.
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    ids, mask = pad_batch(m.encode(TEXTS), m.pad_token_id, "left")
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0]
    torch.testing.assert_close(logits, before, atol=1e-5, rtol=1e-5)
    assert json.loads((tmp_path / "rm" / "reward_config.json").read_text())["hf_compatible"] is True
    # a reward_config.json of the former format (`temperature`, the training keys too) still loads
    path = tmp_path / "rm" / "reward_config.json"
    meta = json.loads(path.read_text())
    meta["config"]["temperature"] = meta["config"].pop("reward_temperature")
    meta["config"].update(learning_rate=1e-4, warmup_steps=100, warmup_ratio=None, seed=42, resume=None)
    path.write_text(json.dumps(meta))
    old = load_reward_model(tmp_path / "rm")
    assert old.config.reward_temperature == 2.0 and torch.equal(old.score(TEXTS), before)


def test_lora_save_load_round_trip_via_trainer(tiny_cache, tmp_path):
    m = make(model_name="tiny:gpt2", use_lora=True).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n or n.startswith("head."):
                p.normal_(std=0.1)  # LoRA B starts at zero; give the adapters an effect
    before = m.score(TEXTS)
    trainer = RewardModelTrainer(m.config, model=m, tokenizer=m.get_tokenizer(), device="cpu")
    trainer.save_model(tmp_path / "lora")
    _no_pickles(tmp_path / "lora")
    assert (tmp_path / "lora" / "adapter.safetensors").exists()
    assert torch.equal(load_reward_model(tmp_path / "lora").score(TEXTS), before)
    fresh = make(model_name="tiny:gpt2", use_lora=True, seed=1).eval()
    assert not torch.equal(fresh.score(TEXTS), before)
    RewardModelTrainer(fresh.config, model=fresh, tokenizer=fresh.get_tokenizer(), device="cpu").load_model(tmp_path / "lora")
    assert torch.equal(fresh.score(TEXTS), before)


def test_multi_objective_save_load(tiny_cache, tmp_path):
    torch.manual_seed(0)
    cfg = RewardModelConfig(model_name="tiny:llama", use_lora=False, dropout_prob=0.0, dtype="float32")
    m = MultiObjectiveRewardModel(cfg, 2, [0.7, 0.3]).eval()
    before = m.score(TEXTS)
    m.save(tmp_path / "mo")
    loaded = load_reward_model(tmp_path / "mo")
    assert isinstance(loaded, MultiObjectiveRewardModel) and loaded.objective_weights.tolist() == pytest.approx([0.7, 0.3])
    assert torch.equal(loaded.score(TEXTS), before)


# -------------------------------------------------------------------------------- training

def test_accumulation_matches_one_big_batch(tiny_cache):
    """2 micro-batches of 4 pairs through the engine == 1 batch of 8 pairs (same init, same pairs):
    same loss and the same accumulated gradient norm (an over- or under-counted gradient would not be)."""
    prompts, chosen, rejected = synthetic_pairs(8, seed=3)
    steps = []
    for accum, bs in ((1, 8), (2, 4)):
        m = make(gradient_accumulation_steps=accum, learning_rate=1e-2, warmup_steps=0, lr_scheduler_type="constant",
                 max_grad_norm=None)
        trainer = RewardModelTrainer(m.config, model=m, tokenizer=m.get_tokenizer(), device="cpu")
        trainer.train_on_preferences(chosen, rejected, prompts=prompts, batch_size=bs)
        assert len(trainer.history) == 1
        steps.append(trainer.history[0])
    assert steps[1]["loss"] == pytest.approx(steps[0]["loss"], rel=1e-5)
    assert steps[1]["grad_norm"] == pytest.approx(steps[0]["grad_norm"], rel=1e-4)
    assert steps[1]["accuracy"] == pytest.approx(steps[0]["accuracy"])


def test_short_last_step_trains_on_exactly_its_pairs(tiny_cache):
    """9 pairs, global batch 4 x 2 micro-batches = 8: each epoch is a step of 8 pairs and a step of the
    1 left (no pairs repeated from the epoch's start), whose second micro-batch is an empty dummy. That
    step's loss (center term included), accuracy, rewards, tokens and gradient norm are those of exactly
    its one pair, scored by hand on the model the first step left."""
    prompts, chosen, rejected = synthetic_pairs(9, seed=5)
    m = make(gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=0, lr_scheduler_type="constant",
             max_grad_norm=None, center_rewards_coefficient=0.1)
    trainer = RewardModelTrainer(m.config, model=m, tokenizer=m.get_tokenizer(), device="cpu")
    hand = {}

    def after_step(step, metrics):
        if step != 1:
            return
        last = torch.randperm(9, generator=torch.Generator().manual_seed(m.config.seed))[8:].tolist()
        ids, mask, _, _ = trainer._batch(trainer._train, last)  # epoch 0's last pair, as a padded batch
        r = m(ids, mask)["rewards"][:, 0]
        loss, bt = bradley_terry_loss(r[:1], r[1:], center_rewards_coefficient=0.1)
        grads = torch.autograd.grad(loss, [q for q in m.parameters() if q.requires_grad])
        hand.update(loss=loss.item(), accuracy=bt["accuracy"].item(), mean_reward=r.mean().item(),
                    min_reward=r.min().item(), max_reward=r.max().item(), num_tokens=int(mask.sum()),
                    grad_norm=torch.stack([g.norm() for g in grads]).norm().item())

    out = trainer.train_on_preferences(chosen, rejected, prompts=prompts, batch_size=4, log_fn=after_step)
    assert [h["step"] for h in trainer.history] == [1, 2] and trainer.current_step == trainer.pipeline.step == 2
    for k in ("loss", "accuracy", "mean_reward", "min_reward", "max_reward", "num_tokens"):
        assert out[k] == pytest.approx(hand[k], abs=1e-6), k
    assert out["grad_norm"] == pytest.approx(hand["grad_norm"], rel=1e-5)
    assert out["epoch"] == 1.0


def test_short_step_weights_give_the_exact_mean_over_processes():
    """3 pairs in a step of 2 processes x 2 micro-batches: the split (`EpochTrainer.micro_batches`) is
    rank 0 [0], [2] and rank 1 [1], [] (a dummy); sum over micro-batches of loss / accumulation, then the
    mean over processes (what the engine and DDP do) is the mean of the 3 pairs' losses, center term too."""
    from types import SimpleNamespace

    from rl.trainers.reward import _bt_custom_loss

    rc, rr = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 1.5])
    kw = dict(center_rewards_coefficient=0.1)
    world, N = 2, 2
    per_rank = []
    for rank in range(world):
        t = RewardModelTrainer.__new__(RewardModelTrainer)
        t.cfg, t.accelerator = SimpleNamespace(gradient_accumulation_steps=N), SimpleNamespace(process_index=rank,
                                                                                              num_processes=world)
        micro = t.micro_batches([0, 1, 2])
        total = 0.0
        for idx in micro:
            pairs = idx or [0]
            out = {"rewards": torch.cat([rc[pairs], rr[pairs]]).unsqueeze(-1)}
            loss, _ = _bt_custom_loss(None, {"attention_mask": torch.ones(2 * len(pairs), 3)}, out, len(pairs),
                                      scale=len(idx) * t.step_weight(3), **kw)
            total += float(loss) / N
        per_rank.append((micro, total))
    assert [m for m, _ in per_rank] == [[[0], [2]], [[1], []]]
    assert sum(v for _, v in per_rank) / world == pytest.approx(float(bradley_terry_loss(rc, rr, **kw)[0]), abs=1e-6)


def test_eval_split_floors_like_split_eval(tiny_cache):
    """eval_fraction holds out floor(fraction x pairs) (at least one), the very pairs
    rl.data.records.split_eval holds out: 0.29 of 10 is 2 (rounding would give 3)."""
    from rl.data.records import split_eval

    prompts, chosen, rejected = synthetic_pairs(10, seed=4)
    for fraction, n_eval in ((0.29, 2), (0.05, 1)):
        m = make(max_length=32)
        trainer = RewardModelTrainer(m.config, model=m, tokenizer=m.get_tokenizer(), device="cpu")
        trainer.train_on_preferences(chosen, rejected, prompts=prompts, batch_size=8, eval_fraction=fraction)
        kept, held = split_eval(list(range(10)), fraction, m.config.seed)
        assert len(trainer.eval_split) == len(held) == n_eval
        assert trainer.eval_split.chosen == m.encode([prompts[i] + chosen[i] for i in held])
        assert len(trainer._train) == len(kept) == 10 - n_eval


def test_resume_continues_exactly(tiny_cache, tmp_path):
    """12 pairs in steps of 5, 5 and 2, two epochs (6 steps), a checkpoint every 2: resumed from
    checkpoint-2, steps 3-6 (a short step, the next epoch's shuffle, another short step) are the
    uninterrupted run's to 1e-6."""
    import shutil

    prompts, chosen, rejected = synthetic_pairs(12, seed=2)

    def run(**kw):
        m = make(seed=kw.pop("seed", 0), learning_rate=1e-2, warmup_steps=2, save_steps=2,
                 output_dir=str(tmp_path / "rm"), **kw)
        t = RewardModelTrainer(m.config, model=m, tokenizer=m.get_tokenizer(), device="cpu")
        t.train_on_preferences(chosen, rejected, prompts=prompts, num_epochs=2, batch_size=5)
        return t.history

    full = run()
    assert [round(h["epoch"], 3) for h in full] == [0.333, 0.667, 1.0, 1.333, 1.667, 2.0]
    for name in ("checkpoint-4", "checkpoint-6"):
        shutil.rmtree(tmp_path / "rm" / "checkpoints" / name)
    resumed = run(resume="auto", seed=1)  # another initialisation: the checkpoint's weights must win
    assert [h["step"] for h in resumed] == [3, 4, 5, 6]
    for a, b in zip(full[2:], resumed):
        for k in ("loss", "accuracy", "grad_norm", "learning_rate", "mean_reward", "num_tokens"):
            assert b[k] == pytest.approx(a[k], abs=1e-6), (a["step"], k)


def test_it_learns_held_out_accuracy(tiny_cache):
    """It learns: >= 95% held-out pair accuracy after 2 epochs; spread measured by bench/learning_spread.py
    over seeds 0-3 x {2 threads, 1 thread, AVX2 kernels}: 1.000 in all 12 runs."""
    prompts, chosen, rejected = synthetic_pairs(200, seed=LEARN_SEED)
    m = make(seed=LEARN_SEED, learning_rate=3e-3, warmup_steps=3, max_length=64)
    trainer = RewardModelTrainer(m.config, model=m, tokenizer=m.get_tokenizer(), device="cpu")
    before = trainer.evaluate(chosen[:40], rejected[:40], prompts[:40])
    out = trainer.train_on_preferences(chosen, rejected, prompts=prompts, num_epochs=2, batch_size=16,
                                       eval_fraction=0.2)
    print(f"held-out accuracy {before['eval/accuracy']:.3f} -> {out['eval/accuracy']:.3f}, "
          f"eval loss {before['eval/loss']:.3f} -> {out['eval/loss']:.3f}")
    assert before["eval/loss"] > 0.6  # the random model has no preference yet
    assert learned("reward_heldout_accuracy", out["eval/accuracy"]) >= 0.95
    assert out["eval/loss"] < 0.3 and out["eval/margin"] > 1.0
    for key in ("loss", "accuracy", "margin", "mean_reward", "std_reward", "min_reward", "max_reward",
                "rewards/chosen", "rewards/rejected", "learning_rate", "grad_norm"):
        assert key in out and math.isfinite(out[key])
    lrs = [h["learning_rate"] for h in trainer.history if "learning_rate" in h]
    assert lrs[0] < lrs[2]  # warmup
    # Held-out pairs are unseen: the split is disjoint from the training pairs.
    assert len(trainer.eval_split) == 40


def test_qlora_4bit_trains_on_cpu(tiny_cache, tmp_path):
    import bitsandbytes as bnb

    from rl.models.loading import trainable_fraction

    prompts, chosen, rejected = synthetic_pairs(64, seed=1)
    m = make(use_lora=True, load_in_4bit=True, lora_rank=8, lora_alpha=16, lora_dropout=0.0,
             learning_rate=1e-2, warmup_steps=0, lr_scheduler_type="constant", max_length=48)
    assert any(isinstance(mod, bnb.nn.Linear4bit) for mod in m.modules())
    n_train, n_all = trainable_fraction(m)
    assert 0 < n_train < n_all
    trainer = RewardModelTrainer(m.config, model=m, tokenizer=m.get_tokenizer(), device="cpu")
    trainer.train_on_preferences(chosen, rejected, prompts=prompts, num_epochs=2, batch_size=8)
    losses = [h["loss"] for h in trainer.history]
    print(f"QLoRA: {n_train} of {n_all} parameters trainable; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05
    before = m.score(TEXTS)
    trainer.save_model(tmp_path / "qlora")
    _no_pickles(tmp_path / "qlora")
    meta = json.loads((tmp_path / "qlora" / "reward_config.json").read_text())
    assert meta["weights"] == "lora" and meta["config"]["load_in_4bit"] is True
    torch.testing.assert_close(load_reward_model(tmp_path / "qlora").score(TEXTS), before)


# -------------------------------------------------------------------------------- data and recipe

def test_bad_preference_rows_reported_with_line_numbers(tmp_path):
    from rl.errors import DataError

    rows = [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a"},
            {"prompt": "q", "chosen": "  ", "rejected": "b"}, {"prompt": "q", "chosen": "same", "rejected": "same"},
            {"prompt": "q", "chosen": "c", "rejected": "d"}]
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError) as e:
        load_preference_pairs(path)
    msg = str(e.value)
    assert "3 bad preference rows" in msg
    assert f"{path}:2: missing field 'rejected'" in msg and f"{path}:3: field 'chosen' is empty" in msg
    assert f"{path}:4: 'chosen' and 'rejected' are identical" in msg
    good = load_preference_pairs(path, max_examples=1)
    assert good.prompts == ["q"] and good.chosen == ["a"] and good.rejected == ["b"]


def test_recipe_schema_aliases_and_recipes_validate():
    from rl.config.parse import parse_config
    from rl.trainers.reward_config import RewardTrainConfig

    cfg = parse_config(RewardTrainConfig, ["--config", "recipes/tiny/reward.yaml", "--prompt-text-column", "question",
                                           "--text-column", "good", "--rejected-text-column", "bad"])
    assert (cfg.data.prompt_column, cfg.data.chosen_column, cfg.data.rejected_column) == ("question", "good", "bad")
    gemma = parse_config(RewardTrainConfig, ["--config", "recipes/gemma/270m_reward.yaml"])
    # one config: the model reads the recipe itself (the reference's flat names are views of `lora`)
    assert gemma.load_in_4bit and gemma.use_lora and gemma.lora_target_modules == "all-linear"
    with pytest.raises(ConfigError, match="disagree"):
        parse_config(RewardTrainConfig, ["--config", "recipes/tiny/reward.yaml", "text_column=x", "data.chosen_column=y"])
    with pytest.raises(ConfigError, match="lora.enabled"):
        parse_config(RewardTrainConfig, ["--config", "recipes/tiny/reward.yaml", "load_in_4bit=true"])
