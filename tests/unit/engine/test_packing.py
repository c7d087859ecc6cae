"""Padding-free packed batches (rl.engine.packing) for SFT, DPO and reward models: per-token log-probs,
per-sequence log-prob sums and pooled rewards, losses and gradients equal the padded path's, so
attention does not cross sequence boundaries (SDPA and eager, every tiny family), with negative controls."""

import contextlib
import random

import pytest
import torch

from rl.algos.preference import bradley_terry_loss
from rl.data.preference import collate_pairs, pack_pairs, pad_batch
from rl.data.sft import collate
from rl.engine.chunked import capture_head
from rl.engine.losses import token_logprobs
from rl.engine.packing import (
    pack_examples,
    pack_padded,
    pack_sequences,
    pool_packed,
    segment_sum,
    unpack_targets,
)
from rl.engine.scoring import concatenated_logps, sequence_logps
from rl.models.reward import RewardModel, RewardModelConfig
from rl.models.tiny import build_config
from rl.models.value import Critic, PPOModel
from rl.trainers.dpo import dpo_batch_loss
from rl.trainers.grpo import grpo_loss_fn
from rl.trainers.ppo_math import critic_loss, policy_loss
from rl.trainers.sft import sum_normalised_nll

EXAMPLES = [  # unequal lengths; labels -100 on a "prompt"; the last is one token long
    {"input_ids": [5, 17, 42, 9, 100, 7], "labels": [-100, -100, 42, 9, 100, 7]},
    {"input_ids": [11, 12, 13], "labels": [11, 12, 13]},
    {"input_ids": [200, 3, 77, 78, 79, 80, 81, 82, 83], "labels": [-100, -100, -100, 77, 78, 79, 80, 81, 82]},
    {"input_ids": [250], "labels": [250]},
]


def test_pack_examples_by_hand():
    b = pack_examples(EXAMPLES[:2])
    assert b["input_ids"].tolist() == [[5, 17, 42, 9, 100, 7, 11, 12, 13]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2]]
    # each example's first token is never a target (it follows the previous example's last token)
    assert b["labels"].tolist() == [[-100, -100, 42, 9, 100, 7, -100, 12, 13]]
    with pytest.raises(ValueError, match="as many labels"):
        pack_examples([{"input_ids": [1, 2], "labels": [1]}])


def _model(family, attn):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(family, 259, hidden=32, layers=2, heads=2),
                                            attn_implementation=attn).eval()


def _per_example_logprobs(model, logits_fn):
    """The per-token log-probs of each example's targets, in order, from `logits_fn`."""
    return torch.cat([x for x in logits_fn(model) if x.numel()])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_loss_and_gradients_equal_padded(family, attn):
    model = _model(family, attn)
    padded = collate(EXAMPLES, pad_id=0)
    packed = pack_examples(EXAMPLES)
    n_tokens = sum(sum(1 for x in e["labels"][1:] if x != -100) for e in EXAMPLES)
    out = {}
    for name, b in (("padded", padded), ("packed", packed)):
        model.zero_grad(set_to_none=True)
        if name == "padded":
            pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=pos,
                           use_cache=False).logits
        else:  # no attention mask and no cache: the model separates the examples by their position ids
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
        logp, mask = token_logprobs(logits, b["labels"])
        loss, _ = sum_normalised_nll(logits, b["labels"], None, scale=1.0 / n_tokens)
        loss.backward()
        out[name] = (logp[mask.bool()], float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert out["packed"][0].shape == out["padded"][0].shape == (n_tokens,)
    torch.testing.assert_close(out["packed"][0], out["padded"][0], atol=1e-5, rtol=1e-5)
    assert out["packed"][1] == pytest.approx(out["padded"][1], abs=1e-5)
    for n, g in out["padded"][2].items():
        torch.testing.assert_close(out["packed"][2][n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_without_position_ids_the_packed_row_would_attend_across_examples():
    """The check above can fail: one row with an all-ones mask (no boundaries) gives other log-probs."""
    model = _model("llama", "sdpa")
    packed = pack_examples(EXAMPLES)
    with torch.no_grad():
        sep = token_logprobs(model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                                   use_cache=False).logits, packed["labels"])[0]
        mixed = token_logprobs(model(input_ids=packed["input_ids"], attention_mask=torch.ones_like(packed["input_ids"]),
                                     position_ids=packed["position_ids"], use_cache=False).logits, packed["labels"])[0]
    assert (sep - mixed).abs().max() > 1e-3


def test_sft_trainer_packing_equals_padding(tmp_path, tiny_llama):
    """Two SFT steps (4 examples per micro-batch, 2 micro-batches per step): the same losses and
    grad norms with packing=true as with padded micro-batches."""
    from rl.config.fields import build
    from rl.trainers.sft import SFTConfig, SFTTrainer

    data = [{"input_ids": list(range(3, 3 + n)), "labels": [-100] * (n // 3) + list(range(3 + n // 3, 3 + n))}
            for n in (5, 12, 3, 9, 7, 16, 4, 10)] * 2
    rows = {}
    for packing in (False, True):
        cfg = build(SFTConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / str(packing)), per_device_train_batch_size=4,
                                    gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2, seed=0,
                                    report_to=["none"], packing=packing, dtype="float32"))
        rows[packing] = SFTTrainer(cfg).train(data)
    assert len(rows[False]) == len(rows[True]) >= 2
    for a, b in zip(rows[False], rows[True]):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["num_tokens"] == a["num_tokens"]


# ----------------------------------------------------------------- packed rows of whole sequences

def test_pack_sequences_by_hand():
    """Lengths 3, 1, 4, 2 in rows of at most 4 tokens (the longest), first-fit decreasing: [C], [A, B],
    [D, pad, pad]; the padding is its own segment (positions restart), index -1, labels -100."""
    A, B, C, D = ([1, 2, 3], [-100, 2, 3]), ([4], [4]), ([5, 6, 7, 8], [5, 6, 7, 8]), ([9, 10], [9, 10])
    b = pack_sequences([A, B, C, D], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7, 8], [-100, 2, 3, -100], [-100, 10, -100, -100]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert b["sequence_index"].tolist() == [[2, 2, 2, 2], [0, 0, 0, 1], [3, 3, -1, -1]]
    one = pack_sequences([A, B, C, D], pad_id=0, row_tokens=10)  # all in one row: no padding at all
    assert one["input_ids"].tolist() == [[5, 6, 7, 8, 1, 2, 3, 9, 10, 4]]
    assert one["sequence_index"].tolist() == [[2, 2, 2, 2, 0, 0, 0, 3, 3, 1]]
    # per-sequence sums and pooled vectors, by hand
    v = torch.arange(12, dtype=torch.float32).reshape(3, 4)  # value = flat position
    assert segment_sum(v, b["sequence_index"], 4).tolist() == [4 + 5 + 6, 7, 0 + 1 + 2 + 3, 8 + 9]
    h = v.unsqueeze(-1).repeat(1, 1, 2)  # (3, 4, 2) hidden states
    assert pool_packed(h, b["sequence_index"], 4, "last")[:, 0].tolist() == [6, 7, 3, 9]
    assert pool_packed(h, b["sequence_index"], 4, "cls")[:, 0].tolist() == [4, 7, 0, 8]
    assert pool_packed(h, b["sequence_index"], 4, "mean")[:, 0].tolist() == [5, 7, 1.5, 8.5]
    with pytest.raises(ValueError, match="shorter than the longest"):
        pack_sequences([A, C], row_tokens=3)
    with pytest.raises(ValueError, match="at least one token"):
        pack_sequences([A, ([], [])])


# unequal lengths, so that several sequences share rows; the longest (rejected of pair 1) sets the width
PAIRS = [
    {"prompt_ids": [5, 17, 42], "chosen_ids": [9, 100, 7, 8], "rejected_ids": [33]},
    {"prompt_ids": [11], "chosen_ids": [12, 13], "rejected_ids": [14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]},
    {"prompt_ids": [200, 3, 77, 78, 79], "chosen_ids": [80, 81], "rejected_ids": [82, 83, 84]},
    {"prompt_ids": [6, 6], "chosen_ids": [1], "rejected_ids": [2, 3]},
]
REF_C, REF_R = torch.tensor([-30.0, -20.0, -25.0, -5.0]), torch.tensor([-10.0, -40.0, -20.0, -9.0])


def _dpo_step(model, batch, packed: bool, chunk: int | None = None):
    """One DPO forward + backward of `batch`: (per-sequence logps, metrics, loss, grads)."""
    model.zero_grad(set_to_none=True)
    if packed:  # no attention mask and no cache: the model separates the sequences by their position ids
        with capture_head(model, chunk) if chunk else contextlib.nullcontext():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        extra = {"sequence_index": batch["sequence_index"]}
    else:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits
        extra = {}
    loss, metrics = dpo_batch_loss(logits, batch["labels"], None, loss_type="sigmoid", beta=0.1,
                                   ref_chosen_logps=REF_C, ref_rejected_logps=REF_R, **extra)
    loss.backward()
    return metrics, float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_dpo_logps_loss_and_gradients_equal_padded(family, attn):
    """DPO on 4 pairs packed into rows (3 rows for 8 sequences) vs the padded (8, 16) batch: the
    sequence log-prob sums (no-grad reference scoring, full and chunked LM head), the loss, its
    metrics and every parameter's gradient agree to 1e-5 (the packed training forward runs the
    chunked LM head, as the engine does at large sizes)."""
    model = _model(family, attn)
    padded, packed = collate_pairs(PAIRS, 0), pack_pairs(PAIRS, 0)
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]  # sequences do share rows
    want = concatenated_logps(model, padded)
    for chunk in (None, 3):
        got = concatenated_logps(model, packed, chunk_size=chunk)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert want[3].tolist() == [1, 11, 3, 2]  # rejected answer tokens: each sequence counted in full
    m_pad, loss_pad, g_pad = _dpo_step(model, padded, packed=False)
    m_pack, loss_pack, g_pack = _dpo_step(model, packed, packed=True, chunk=4)
    assert loss_pack == pytest.approx(loss_pad, abs=1e-5)
    for k, v in m_pad.items():
        assert float(m_pack[k]) == pytest.approx(float(v), abs=1e-5), k
    for n, g in g_pad.items():
        torch.testing.assert_close(g_pack[n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_packed_dpo_without_position_resets_or_with_a_mask_differs():
    """Negative controls: the same packed rows with plain 0..W-1 positions, or with an all-ones mask
    (either way attention crosses the sequence boundaries), give other sequence log-probs."""
    model = _model("llama", "sdpa")
    packed = pack_pairs(PAIRS, 0)
    want = concatenated_logps(model, packed)[:2]
    for kw in ({}, {"attention_mask": torch.ones_like(packed["input_ids"]), "position_ids": packed["position_ids"]}):
        with torch.no_grad():
            logits = model(input_ids=packed["input_ids"], use_cache=False, **kw).logits
        got = sequence_logps(logits, packed["labels"], packed["sequence_index"])[0].chunk(2)
        assert max((g - w).abs().max() for g, w in zip(got, want)) > 1e-3


# ------------------------------------------------------------------------------- reward models
TEXTS = [[5, 17, 42, 9, 100, 7], [11, 12, 13], [200, 3, 77, 78, 79, 80, 81, 82, 83], [250], [4, 5, 6, 7], [8, 9]]


def _reward_model(family, attn, pooling="last"):
    torch.manual_seed(0)
    m = RewardModel(RewardModelConfig(model_name=f"tiny:{family}", use_lora=False, dropout_prob=0.0, dtype="float32",
                                      pooling_strategy=pooling))
    m.backbone.set_attn_implementation(attn)
    return m.eval()  # eval: GPT-2's own dropout would differ between the two forwards; gradients still flow


def _bt_step(model, packed: bool):
    """Rewards of TEXTS (3 chosen, then 3 rejected), Bradley-Terry loss, gradients."""
    model.zero_grad(set_to_none=True)
    if packed:
        b = pack_sequences([(t, t) for t in TEXTS], pad_id=0)
        assert b["input_ids"].shape == (3, 9)  # [9], [6, 3], [4, 2, 1]: sequences share rows
        r = model(b["input_ids"], None, position_ids=b["position_ids"], sequence_index=b["sequence_index"])["rewards"]
    else:
        r = model(*pad_batch(TEXTS, 0))["rewards"]
    loss, _ = bradley_terry_loss(r[:3, 0], r[3:, 0], None, 0.01)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return r.detach(), float(loss.detach()), grads


@pytest.mark.parametrize("family,attn,pooling", [(f, a, "last") for f in ("llama", "qwen2", "gemma", "gpt2")
                                                 for a in ("sdpa", "eager")]
                         + [("llama", "sdpa", "mean"), ("gpt2", "eager", "cls")])
def test_packed_rewards_loss_and_gradients_equal_padded(family, attn, pooling):
    """The reward model on packed rows: each text's reward (read at its own last token, or its mean /
    first token), the Bradley-Terry loss and every gradient equal the padded batch's to 1e-5."""
    model = _reward_model(family, attn, pooling)
    (r_pad, loss_pad, g_pad), (r_pack, loss_pack, g_pack) = _bt_step(model, False), _bt_step(model, True)
    assert r_pack.shape == r_pad.shape == (6, 1)
    torch.testing.assert_close(r_pack, r_pad, atol=1e-5, rtol=1e-5)
    assert loss_pack == pytest.approx(loss_pad, abs=1e-5)
    assert g_pad.keys() == g_pack.keys() and len(g_pad) > 10
    for n, g in g_pad.items():
        torch.testing.assert_close(g_pack[n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_packed_rewards_with_a_mask_differ():
    """Negative control: the packed rows with an all-ones mask (attention across texts) give other rewards
    for the texts that do not start their row."""
    model = _reward_model("llama", "sdpa")
    b = pack_sequences([(t, t) for t in TEXTS], pad_id=0)
    with torch.no_grad():
        want = model(*pad_batch(TEXTS, 0))["rewards"][:, 0]
        h = model.backbone(input_ids=b["input_ids"], attention_mask=torch.ones_like(b["input_ids"]),
                           position_ids=b["position_ids"], use_cache=False).last_hidden_state
        mixed = model.head(pool_packed(h, b["sequence_index"], 6, "last"))[:, 0]
    assert (mixed - want).abs().max() > 1e-3


# ------------------------------------------------------------------------------------ trainers

def _count_calls(monkeypatch, *names) -> dict:
    """Count the calls of the functions at these dotted names (they still run)."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        module, attr = name.rsplit(".", 1)
        real = getattr(__import__(module, fromlist=[attr]), attr)

        def counted(*a, _name=name, _real=real, **k):
            counts[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(name, counted)
    return counts


def test_dpo_and_reward_trainers_packing_equals_padding(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch):
    """Two optimizer steps (4 pairs per micro-batch, 2 micro-batches per step) of the DPO trainer
    (frozen-copy reference, scored packed too) and of the reward-model trainer: the same losses,
    metrics and grad norms with packing=true as with padded micro-batches, and the same evaluation."""
    from rl.config.fields import build
    from rl.data.preference import PreferenceDataset
    from rl.trainers.dpo import DPOConfig, DPOTrainer
    from rl.trainers.reward import RewardModelTrainer

    monkeypatch.setattr("rl.engine.tracking.plot_history", lambda *a, **k: None)  # the metrics plot: 3-7 s a run
    packs = _count_calls(monkeypatch, "rl.trainers.dpo.pack_pairs", "rl.trainers.reward.pack_sequences")
    assert build(DPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path), padding_free=True)).packing  # TRL
    rng = random.Random(0)
    P = [f"q{i}: " + "z" * rng.randint(0, 12) for i in range(16)]
    C = ["a" * rng.randint(1, 14) for _ in P]
    R = ["b" * rng.randint(1, 14) for _ in P]
    dpo, rm = {}, {}
    for packing in (False, True):
        cfg = build(DPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / f"dpo{packing}"), per_device_train_batch_size=4,
                                    gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2, seed=0,
                                    max_length=64, max_prompt_length=32, report_to=["none"], packing=packing,
                                    dtype="float32", share_prompt_forward=False))
        t = DPOTrainer(cfg, tokenizer=tiny_tokenizer)
        ds = PreferenceDataset(P, C, R, tiny_tokenizer, 64, 32)
        dpo[packing] = (t.train(ds), t.evaluate(PreferenceDataset(P[:6], C[:6], R[:6], tiny_tokenizer, 64, 32)))
        torch.manual_seed(0)
        m = RewardModel(RewardModelConfig(model_name=tiny_llama, use_lora=False, dropout_prob=0.0, dtype="float32",
                                          gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=0,
                                          lr_scheduler_type="constant", packing=packing))
        trainer = RewardModelTrainer(m.config, model=m, tokenizer=tiny_tokenizer, device="cpu")
        trainer.train_on_preferences(C, R, prompts=P, batch_size=4)
        rm[packing] = (trainer.history, trainer.evaluate(C[:6], R[:6], P[:6]))
    # 2 steps x 2 micro-batches (DPO's reference scores the same packed rows) + the eval batches
    assert packs == {"rl.trainers.dpo.pack_pairs": 4 + 2, "rl.trainers.reward.pack_sequences": 4 + 1}
    for (a_rows, a_eval), (b_rows, b_eval) in ((dpo[False], dpo[True]), (rm[False], rm[True])):
        assert len(a_rows) == len(b_rows) == 2
        for a, b in zip(a_rows, b_rows):
            for k in ("loss", "rewards/chosen", "rewards/rejected"):
                assert b[k] == pytest.approx(a[k], abs=1e-5), k
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert a_rows[1]["loss"] != pytest.approx(a_rows[0]["loss"], abs=1e-4)  # the steps did change the model
        for k, v in a_eval.items():  # after two Adam steps at lr 1e-2: Adam's normalisation turns the
            assert b_eval[k] == pytest.approx(v, abs=1e-4), k  # gradients' 1e-7 differences into ~1e-5
    assert rm[True][0][0]["num_tokens"] == rm[False][0][0]["num_tokens"]  # real tokens only, padded or packed


# ------------------------------------------------------------------ GRPO's training forward

def _rollout_batch():
    """A rollout as `Rollout.to_batch` lays it out: left-padded prompts (width 5), completions right-
    padded after their end (width 6), labels on completion tokens only."""
    prompts = [[7, 8, 9, 10, 11], [12, 13], [14, 15, 16], [17]]
    completions = [[20, 21], [22, 23, 24, 25, 26, 27], [28], [29, 30, 31]]
    ids = torch.zeros(4, 11, dtype=torch.long)
    mask = torch.zeros(4, 11, dtype=torch.long)
    labels = torch.full((4, 11), -100)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, 5 - len(p):5], ids[i, 5:5 + len(c)] = torch.tensor(p), torch.tensor(c)
        mask[i, 5 - len(p):5 + len(c)] = 1
        labels[i, 5:5 + len(c)] = torch.tensor(c)
    return ids, mask, labels


def test_pack_padded_by_hand():
    ids, mask, labels = _rollout_batch()
    b = pack_padded(ids, mask, labels)
    # real lengths 7, 8, 4, 4 in rows of 8: [8], [7], [4, 4]
    assert b["input_ids"].tolist() == [[12, 13, 22, 23, 24, 25, 26, 27], [7, 8, 9, 10, 11, 20, 21, 0],
                                       [14, 15, 16, 28, 17, 29, 30, 31]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 2, 3, 0, 1, 2, 3]]
    v = torch.arange(21, dtype=torch.float32).reshape(3, 7)  # packed per-target values = their flat index
    back = unpack_targets(v, b["target_index"])
    # row 0 (no left padding) is packed row 1: padded targets t = 0..5 are its packed targets 0..5 (7..12)
    assert back[0].tolist() == [7, 8, 9, 10, 11, 12, 0, 0, 0, 0]
    assert back[3].tolist() == [0, 0, 0, 0, 18, 19, 20, 0, 0, 0]  # prompt [17] at 4, then 29, 30, 31
    t = b["target_index"]
    assert ((labels[:, 1:] != -100) <= (t >= 0)).all()  # every counted target has its place in the packed rows
    assert (b["labels"][:, 1:].reshape(-1)[t[t >= 0]] == labels[:, 1:][t >= 0]).all()
    with pytest.raises(ValueError, match="not contiguous"):
        pack_padded(ids, torch.tensor([[1, 0, 1] + [0] * 8] * 4), labels)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_grpo_loss_and_gradients_equal_padded(family, attn):
    """GRPO's training forward on the rollout packed (`pack_padded`, chunked LM head) vs padded with the
    sampler's positions: the same per-token log-probs, loss, metrics and gradients to 1e-5, off-policy
    (old log-probs != current) with a KL term, token_mean and sequence-level (GSPO) ratios."""
    model = _model(family, attn)
    ids, mask, labels = _rollout_batch()
    packed = pack_padded(ids, mask, labels)
    assert packed["input_ids"].numel() < ids.numel()
    g = torch.Generator().manual_seed(0)
    old = -5.5 + 0.3 * torch.randn(4, 10, generator=g)
    ref = -5.5 + 0.3 * torch.randn(4, 10, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75])
    for level, agg in (("token", "token_mean"), ("sequence", "sequence_mean")):
        kw = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, beta=0.04, temperature=0.7,
                  loss_aggregation=agg, importance_sampling_level=level)
        out = {}
        for name in ("padded", "packed"):
            model.zero_grad(set_to_none=True)
            if name == "padded":
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
                loss, metrics = grpo_loss_fn(logits, labels, mask, **kw)
                logp = token_logprobs(logits.detach() / 0.7, labels)[0]
            else:
                with capture_head(model, 3):
                    logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                                   use_cache=False).logits
                loss, metrics = grpo_loss_fn(logits, packed["labels"], None, target_index=packed["target_index"], **kw)
                with torch.no_grad():
                    logp = unpack_targets(token_logprobs(logits / 0.7, packed["labels"])[0], packed["target_index"])
            loss.backward()
            out[name] = (logp, float(loss.detach()), metrics, {n: p.grad.clone() for n, p in model.named_parameters()})
        torch.testing.assert_close(out["packed"][0], out["padded"][0], atol=1e-5, rtol=1e-5)
        assert out["packed"][1] == pytest.approx(out["padded"][1], abs=1e-5)
        for k, v in out["padded"][2].items():
            assert float(out["packed"][2][k]) == pytest.approx(float(v), abs=1e-5), k
        for n, grad in out["padded"][3].items():
            torch.testing.assert_close(out["packed"][3][n], grad, atol=1e-5, rtol=1e-4, msg=n)


# ------------------------------------------------------------------- PPO's training forward

@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_ppo_policy_and_value_loss_and_gradients_equal_padded(family, attn):
    """PPO's policy loss (clipped surrogate, entropy bonus, the shared value head's clipped value loss)
    on the rollout packed vs padded with the sampler's positions: the same loss, metrics and gradients
    to 1e-5; full logits and the chunked LM head. With llama/sdpa also a separate critic (`Critic`)."""
    ids, mask, labels = _rollout_batch()
    P = 5
    packed = pack_padded(ids, mask, labels)
    g = torch.Generator().manual_seed(1)
    resp = dict(P=P, tokens=ids[:, P:], mask=mask[:, P:].float(),
                old_logprobs=-5.5 + 0.3 * torch.randn(4, 6, generator=g),
                advantages=torch.randn(4, 6, generator=g), old_values=0.1 * torch.randn(4, 6, generator=g),
                returns=torch.randn(4, 6, generator=g), entropy_coef=0.01, temperature=0.7)
    torch.manual_seed(0)
    model = PPOModel(_model(family, attn))
    torch.nn.init.normal_(model.value_head.out.weight, std=0.1)  # it starts at zero: values 0, no value gradient
    models = [(model, policy_loss, resp)]
    if family == "llama" and attn == "sdpa":
        critic = Critic(_reward_model("llama", "sdpa"))
        models.append((critic, critic_loss, {k: resp[k] for k in ("P", "mask", "old_values", "returns")}))
    for m, loss_fn, kw in models:
        for chunk in ((None, 3) if loss_fn is policy_loss else (None,)):
            out = {}
            for name in ("padded", "packed"):
                m.zero_grad(set_to_none=True)
                if name == "padded":
                    o = m(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                          use_cache=False)
                    loss, metrics = loss_fn(m, {}, o, **kw)
                else:
                    with capture_head(m, chunk) if chunk else contextlib.nullcontext():
                        o = m(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
                    extra = {"packed_labels": packed["labels"]} if loss_fn is policy_loss else {}
                    loss, metrics = loss_fn(m, {}, o, target_index=packed["target_index"], **extra, **kw)
                loss.backward()
                out[name] = (float(loss.detach()), metrics,
                             {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
            assert out["packed"][0] == pytest.approx(out["padded"][0], abs=1e-5)
            for k, v in out["padded"][1].items():
                assert float(out["packed"][1][k]) == pytest.approx(float(v), abs=1e-5), k
            assert out["padded"][2].keys() == out["packed"][2].keys()
            for n, grad in out["padded"][2].items():
                torch.testing.assert_close(out["packed"][2][n], grad, atol=1e-5, rtol=1e-4, msg=n)


def test_grpo_and_ppo_trainers_packing_equals_padding(tmp_path, tiny_llama, monkeypatch):
    """One generation and optimizer step of the GRPO trainer (KL to a reference, 2 micro-batches) and
    one PPO iteration (separate critic, 2 micro-batches), packing=true vs padded: the same rollout
    (same seed, same weights), so the same losses, metrics and grad norms."""
    from rl.config.fields import build
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig
    from rl.trainers.ppo import PPOTrainer
    from rl.trainers.ppo_config import PPOConfig

    monkeypatch.setattr("rl.engine.tracking.plot_history", lambda *a, **k: None)
    packs = _count_calls(monkeypatch, "rl.trainers.grpo.pack_padded", "rl.trainers.ppo.pack_padded")
    rows = [{"prompt": f"{a}+{b}=" + "?" * a} for a in range(4) for b in range(4)]  # prompts of unequal length

    def length_reward(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    grpo, ppo = {}, {}
    for packing in (False, True):
        cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / f"g{packing}"),
                                     learning_rate=1e-2, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                                     max_completion_length=6, max_length=24, max_steps=1, beta=0.1,
                                     report_to=["none"], seed=0, packing=packing, share_prompt_forward=False))
        grpo[packing] = GRPOTrainer(cfg, reward_funcs=[length_reward], train_prompts=rows).train()
        cfg = PPOConfig(model_name=tiny_llama, output_dir=str(tmp_path / f"p{packing}"), seed=0, learning_rate=1e-2,
                        per_device_train_batch_size=8, mini_batch_size=8, gradient_accumulation_steps=2, num_ppo_epochs=1, max_completion_length=6,
                        max_length=32, max_steps=1, value_model="critic", dtype="float32", device="cpu",
                        report_to=["none"], packing=packing)
        ppo[packing] = PPOTrainer(cfg, reward_fn=lambda p, r, m=None: [len(x) / 6 for x in r]).train(
            [r["prompt"] for r in rows[::2]])
    assert packs == {"rl.trainers.grpo.pack_padded": 2, "rl.trainers.ppo.pack_padded": 2}  # the packed runs' micro-batches
    for runs, keys in ((grpo, ("loss", "kl", "clip_ratio/region_mean", "grad_norm")),
                       (ppo, ("loss/policy", "loss/value", "policy/entropy", "objective/kl"))):
        assert len(runs[False]) == len(runs[True]) == 1
        for k in keys:
            assert runs[True][0][k] == pytest.approx(runs[False][0][k], rel=1e-4, abs=1e-5), k
