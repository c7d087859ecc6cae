"""DPO family: hand-computed losses, data handling, log-prob invariance, LoRA reference, it learns."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

from rl.algos.preference import (
    hinge_loss,
    ipo_loss,
    orpo_loss,
    preference_loss,
    sigmoid_loss,
)
from rl.config.fields import build
from rl.data.preference import PreferenceDataset, collate_pairs
from rl.engine.scoring import concatenated_logps
from rl.errors import ConfigError
from rl.trainers.dpo import DPOConfig, DPOTrainer, dpo_batch_loss
from tests.conftest import LEARN_SEED, learned


def _softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


def _cfg(**kw) -> DPOConfig:
    base = dict(model_name="tiny:llama", output_dir="/tmp/unused", report_to=["none"], max_length=64,
                max_prompt_length=32, per_device_train_batch_size=4, dtype="float32")
    base.update(kw)
    return build(DPOConfig, base)


# ----------------------------------------------------------------------------------- pure losses

def test_sigmoid_and_conservative_loss_hand_computed():
    delta = torch.tensor([1.0, -2.0])
    # -log sigmoid(0.5) = log(1 + e^-0.5); -log sigmoid(-1) = log(1 + e^1)
    assert sigmoid_loss(delta, beta=0.5).tolist() == pytest.approx([_softplus(-0.5), _softplus(1.0)], abs=1e-6)
    # cDPO, eps = 0.1: 0.9 * softplus(-h) + 0.1 * softplus(h)
    got = sigmoid_loss(delta, beta=0.5, label_smoothing=0.1).tolist()
    want = [0.9 * _softplus(-0.5) + 0.1 * _softplus(0.5), 0.9 * _softplus(1.0) + 0.1 * _softplus(-1.0)]
    assert got == pytest.approx(want, abs=1e-6)


def test_hinge_and_ipo_hand_computed():
    assert hinge_loss(torch.tensor([1.0, -2.0, 4.0]), beta=0.5).tolist() == pytest.approx([0.5, 2.0, 0.0])
    # chosen ratio 2 over 4 tokens (0.5), rejected -1 over 2 tokens (-0.5): d = 1; 1/(2*0.25) = 2 -> (1-2)^2
    got = ipo_loss(torch.tensor([2.0]), torch.tensor([-1.0]), torch.tensor([4.0]), torch.tensor([2.0]), beta=0.25)
    assert got.item() == pytest.approx(1.0)


def test_orpo_hand_computed():
    # chosen: sum -2 over 4 tokens -> mean -0.5; rejected: -6 over 3 -> mean -2
    pc, pr = math.exp(-0.5), math.exp(-2.0)
    ratio = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
    want = 0.5 + 0.1 * _softplus(-ratio)  # NLL + beta * -log sigmoid(ratio)
    loss, nll, got_ratio = orpo_loss(torch.tensor([-2.0]), torch.tensor([-6.0]), torch.tensor([4.0]),
                                     torch.tensor([3.0]), beta=0.1)
    assert got_ratio.item() == pytest.approx(ratio, abs=1e-5)
    assert nll.item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    # ... and through preference_loss: rewards are beta * mean log-prob, no reference involved
    per_pair, stats = preference_loss("orpo", torch.tensor([-2.0]), torch.tensor([-6.0]), None, None,
                                      torch.tensor([4.0]), torch.tensor([3.0]), beta=0.1)
    assert per_pair.item() == pytest.approx(want, abs=1e-6)
    assert stats["rewards/chosen"].item() == pytest.approx(-0.05)
    assert stats["rewards/rejected"].item() == pytest.approx(0.1 * -2.0)


def test_reference_free_hand_computed():
    c, r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    lengths = torch.tensor([3.0, 3.0])
    per_pair, stats = preference_loss("sigmoid", c, r, None, None, lengths, lengths, beta=0.2)
    # delta = c - r = [1, -3]; loss = softplus(-0.2 * delta)
    assert per_pair.tolist() == pytest.approx([_softplus(-0.2), _softplus(0.6)], abs=1e-6)
    assert stats["rewards/chosen"].tolist() == pytest.approx([-0.6, -1.0])
    assert stats["rewards/accuracies"].tolist() == [1.0, 0.0]
    assert stats["rewards/margins"].tolist() == pytest.approx([0.2, -0.6])
    # with a reference the ratios shift: ref = [-3, -5] for chosen cancels chosen's reward
    per_pair, stats = preference_loss("sigmoid", c, r, torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0]),
                                      lengths, lengths, beta=0.2)
    assert stats["rewards/chosen"].tolist() == pytest.approx([0.0, 0.0])
    assert stats["rewards/rejected"].tolist() == pytest.approx([0.0, 0.4])


def test_config_validation():
    with pytest.raises(ConfigError, match="label_smoothing"):
        _cfg(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ConfigError, match="max_prompt_length"):
        _cfg(max_prompt_length=64)
    with pytest.raises(ConfigError, match="nothing to precompute"):
        _cfg(loss_type="orpo", precompute_ref_logps=True)
    with pytest.raises(ConfigError, match="did you mean beta"):
        build(DPOConfig, {"model_name": "x", "betaa": 0.1})
    assert _cfg(dpo_beta=0.3).beta == 0.3


# ------------------------------------------------------------------------------------------ data

def test_dataset_masks_per_example_prompt_lengths(tiny_tokenizer):
    tok = tiny_tokenizer
    ds = PreferenceDataset(["ab", "abcdef"], ["XY", "Z"], ["Q", "RST"], tok, max_length=64, max_prompt_length=32)
    ex = ds.examples
    # byte tokenizer: BOS (its post-processor adds it, as Llama's does) + one token per character
    assert [len(e["prompt_ids"]) for e in ex] == [3, 7] and ex[0]["prompt_ids"][0] == tok.bos_token_id
    eos = tok.eos_token_id
    assert ex[0]["chosen_ids"] == tok("XY", add_special_tokens=False)["input_ids"] + [eos]
    assert ex[1]["rejected_ids"] == tok("RST", add_special_tokens=False)["input_ids"] + [eos]
    b = collate_pairs([ds[0], ds[1]], ds.pad_token_id)
    assert b["input_ids"].shape == (4, 11)  # width = longest of the batch (7 + 3 + eos), not max_length
    # row 0 = chosen of pair 0: 3 prompt tokens, 3 answer tokens, then padding
    assert b["labels"][0].tolist() == [-100] * 3 + ex[0]["chosen_ids"] + [-100] * 5
    # row 3 = rejected of pair 1: 7 prompt tokens (its own length, not pair 0's), 4 answer tokens
    assert b["labels"][3].tolist() == [-100] * 7 + ex[1]["rejected_ids"]
    assert b["attention_mask"][0].tolist() == [1] * 6 + [0] * 5
    left = collate_pairs([ds[0], ds[1]], ds.pad_token_id, padding_side="left")
    assert left["labels"][0].tolist() == [-100] * 5 + [-100] * 3 + ex[0]["chosen_ids"]
    assert left["position_ids"][0, 5:].tolist() == list(range(6))


def test_dataset_truncation_left_prompt_and_answers(tiny_tokenizer, caplog):
    tok = tiny_tokenizer
    with caplog.at_level(logging.WARNING, logger="rl.data.preference"):
        ds = PreferenceDataset(["abcdefghij", "ok"], ["12345678", "y"], ["n", "no"], tok, max_length=8,
                               max_prompt_length=4)
    e = ds.examples[0]
    raw = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert e["prompt_ids"] == raw("ghij")  # the END of the prompt is kept (BOS included in the cut)
    assert e["chosen_ids"] == raw("1234")  # answers keep their start, cut to fit 8 tokens
    assert e["rejected_ids"] == raw("n") + [tok.eos_token_id]
    assert ds.examples[1]["prompt_ids"] == tok("ok")["input_ids"]  # BOS + "ok": it fits
    assert ds.truncation == {"pairs": 2, "prompts_truncated": 1, "answers_truncated": 1}
    assert "1 of 2 prompts" in caplog.text and "1 pairs had answers cut" in caplog.text


def test_dataset_chat_template(tiny_tokenizer):
    tok = tiny_tokenizer
    ds = PreferenceDataset([[{"role": "user", "content": "hi"}]], [[{"role": "assistant", "content": "hello"}]],
                           [[{"role": "assistant", "content": "go"}]], tok, max_length=64, max_prompt_length=32)
    e = ds.examples[0]
    assert tok.decode(e["prompt_ids"]) == "<|user|>\nhi\n<|assistant|>\n"
    assert tok.decode(e["chosen_ids"]) == "hello\n"
    assert tok.decode(e["rejected_ids"]) == "go\n"
    # plain strings with chat_template=True render the same way
    ds2 = PreferenceDataset(["hi"], ["hello"], ["go"], tok, 64, 32, chat_template=True)
    assert ds2.examples == ds.examples


# ---------------------------------------------------------------------------- log-prob invariance

@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    from rl.models.loading import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(tiny_llama, dtype="float32").eval()


def test_logps_invariant_to_neighbours_padding_side_and_max_length(tiny_model, tiny_tokenizer):
    tok, model = tiny_tokenizer, tiny_model
    prompts = ["Q: 2+2?", "A much longer prompt, with more words in it: 7*6?", "x"]
    chosen = ["4", "forty-two, and a long tail of explanation", "yes"]
    rejected = ["5", "41", "no no no no no no"]
    short = PreferenceDataset(prompts, chosen, rejected, tok, max_length=128, max_prompt_length=64)
    long = PreferenceDataset(prompts, chosen, rejected, tok, max_length=1024, max_prompt_length=512)
    alone = concatenated_logps(model, collate_pairs([short[0]], short.pad_token_id))
    for ds in (short, long):
        for side in ("right", "left"):
            b = collate_pairs([ds[0], ds[1], ds[2]], ds.pad_token_id, padding_side=side)
            c, r, cl, rl = concatenated_logps(model, b)
            assert c[0].item() == pytest.approx(alone[0].item(), abs=1e-4)
            assert r[0].item() == pytest.approx(alone[1].item(), abs=1e-4)
            assert (cl[0].item(), rl[0].item()) == (alone[2].item(), alone[3].item()) == (2, 2)
    # the training path (the engine's forward: right padding, no position_ids) agrees as well
    b = collate_pairs([short[1], short[0]], short.pad_token_id)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    _, m = dpo_batch_loss(logits, b["labels"], b["attention_mask"], loss_type="sigmoid", beta=0.1,
                          ref_chosen_logps=torch.zeros(2), ref_rejected_logps=torch.zeros(2))
    c1, r1, *_ = concatenated_logps(model, collate_pairs([short[1]], short.pad_token_id))
    assert m["logps/chosen"].item() == pytest.approx((alone[0] + c1).item() / 2, abs=1e-4)
    assert m["logps/rejected"].item() == pytest.approx((alone[1] + r1).item() / 2, abs=1e-4)


# ------------------------------------------------------------------------------ reference models

def test_lora_reference_equals_frozen_copy(tiny_llama, tiny_tokenizer, tmp_path):
    from rl.models.loading import load_causal_lm

    tok = tiny_tokenizer
    ds = PreferenceDataset(["hello ", "what is 2+3? "], ["world", "5"], ["moon", "six"], tok, 64, 32)
    b = collate_pairs([ds[0], ds[1]], ds.pad_token_id)
    lora = DPOTrainer(_cfg(output_dir=str(tmp_path / "a"), lora={"enabled": True, "dropout": 0.0}),
                      tokenizer=tok, model=load_causal_lm(tiny_llama, dtype="float32"))
    assert lora.ref_mode == "adapters"
    lora._setup(total_steps=1)
    with torch.no_grad():  # make the adapters matter, so "disabled" is a real test
        for n, p in lora.pipeline.unwrapped_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    full = DPOTrainer(_cfg(output_dir=str(tmp_path / "b")), tokenizer=tok,
                      model=load_causal_lm(tiny_llama, dtype="float32"))
    assert full.ref_mode == "copy"
    full._setup(total_steps=1)
    got, want = lora._reference_logps(b), full._reference_logps(b)
    assert torch.allclose(got[0], want[0], atol=1e-4) and torch.allclose(got[1], want[1], atol=1e-4)
    policy = concatenated_logps(lora.pipeline.model, b)  # adapters on: differs, so the check has teeth
    assert (policy[0] - want[0]).abs().max() > 1e-2


def test_precomputed_reference_matches_live_reference(tiny_llama, tiny_tokenizer, tmp_path):
    from rl.models.loading import load_causal_lm

    tok = tiny_tokenizer
    rng = random.Random(1)
    P = [f"p{i} " + "z" * rng.randint(0, 9) for i in range(8)]
    C = ["a" * rng.randint(1, 6) for _ in P]
    R = ["b" * rng.randint(1, 6) for _ in P]
    runs = {}
    for pre in (False, True):
        ds = PreferenceDataset(P, C, R, tok, 64, 32)
        t = DPOTrainer(_cfg(output_dir=str(tmp_path / str(pre)), precompute_ref_logps=pre, max_steps=3,
                            learning_rate=1e-3), tokenizer=tok, model=load_causal_lm(tiny_llama, dtype="float32"))
        runs[pre] = t.train(ds)
        if pre:
            assert t.reference.model is None and ds.ref_logps.shape == (8, 2)
    for a, b in zip(runs[False], runs[True]):
        for k in ("loss", "rewards/chosen", "rewards/margins", "logps/rejected"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), k


# ---------------------------------------------------------------------------------- it learns

def _vowel_pairs(n: int, seed: int):
    """Chosen answers are made of vowels, rejected ones of consonants: a property, not a memorised string."""
    rng = random.Random(seed)
    P = ["say: " + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 5))) for _ in range(n)]
    C = ["".join(rng.choice("aeiou") for _ in range(rng.randint(3, 8))) for _ in range(n)]
    R = ["".join(rng.choice("bcdfghklmnpqrstvwxz") for _ in range(rng.randint(3, 8))) for _ in range(n)]
    return P, C, R


def test_it_learns_heldout_reward_accuracy(tiny_tokenizer, tmp_path):
    """It learns: implicit-reward accuracy >= 0.9 on 32 held-out pairs; spread measured by
    bench/learning_spread.py: 1.000 in all 12 runs (seeds 0-3 x {2 threads, 1 thread, AVX2 kernels})."""
    tok = tiny_tokenizer
    train = PreferenceDataset(*_vowel_pairs(64, 2 * LEARN_SEED), tok, 64, 32)
    held = PreferenceDataset(*_vowel_pairs(32, 2 * LEARN_SEED + 1), tok, 64, 32)
    t = DPOTrainer(_cfg(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=2, learning_rate=2e-3, seed=LEARN_SEED,
                        lr_scheduler_type="constant", precompute_ref_logps=True, beta=0.1), tokenizer=tok)
    history = t.train(train, eval_dataset=held)
    after = history[-1]
    assert learned("dpo_heldout_accuracy", after["eval/rewards/accuracies"]) >= 0.9, after
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference at step 1
    assert after["eval/loss"] < 0.5


@pytest.mark.parametrize("recipe", ["recipes/tiny/dpo.yaml", "recipes/gemma/270m_dpo.yaml"])
def test_recipes_validate(recipe):
    from conftest import ROOT

    from rl.config.parse import parse_config

    cfg = parse_config(DPOConfig, ["--config", str(ROOT / recipe)])
    assert cfg.max_prompt_length < cfg.max_length
    head = (ROOT / recipe).read_text().splitlines()[:6]
    assert all(line.startswith("#") for line in head)  # the header: purpose, hardware, command, ds_config


def test_chunked_reference_scoring_equals_full(tiny_model, tiny_tokenizer):
    """DPO's reference forward with logprob_chunk_size: the same sums of answer log-probs."""
    ds = PreferenceDataset(["say: 1", "say: 22"], ["aei", "ou"], ["bcd", "fgh"], tiny_tokenizer, 64, 32)
    b = collate_pairs([ds[0], ds[1]], ds.pad_token_id)
    with torch.no_grad():
        full = concatenated_logps(tiny_model, b)
        chunked = concatenated_logps(tiny_model, b, chunk_size=2)
    for x, y in zip(full, chunked):
        assert torch.allclose(x, y, atol=1e-5)


# --------------------------------------------------------------------- a user's loss, by dotted path

USER_LOSSES = '''
import torch.nn.functional as F


def doubled_sigmoid(pair, beta, label_smoothing=0.0):
    """DPO's sigmoid loss at twice the beta: -log sigmoid(2 beta (chosen log-ratio - rejected log-ratio))."""
    c, r = pair.logratios()
    return -F.logsigmoid(2 * beta * (c - r)), {}
'''


def test_a_users_preference_loss_by_dotted_path(tmp_path, monkeypatch, tiny_llama, tiny_tokenizer):
    """`loss_type: my_module:my_function` needs no edit of the package: the config accepts it, the registry
    imports it on first use, and a DPO step with it equals the built-in sigmoid loss at twice the beta."""
    (tmp_path / "user_dpo_losses.py").write_text(USER_LOSSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    c, r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -2.5])
    n = torch.tensor([2.0, 3.0])
    mine, stats = preference_loss("user_dpo_losses:doubled_sigmoid", c, r, rc, rr, n, n, beta=0.1)
    # chosen log-ratios (0.5, -1), rejected (-1, 0.5): deltas 1.5, -1.5 -> softplus(-0.3), softplus(0.3)
    assert mine.tolist() == pytest.approx([_softplus(-0.3), _softplus(0.3)], abs=1e-6)
    assert stats["rewards/margins"].tolist() == pytest.approx([0.15, -0.15], abs=1e-6)
    with pytest.raises(ConfigError, match="has no callable 'nope'"):
        _cfg(loss_type="user_dpo_losses:nope")
    tok = tiny_tokenizer
    ds = PreferenceDataset(["hello ", "what is 2+3? "], ["world", "5"], ["moon", "six"], tok, 64, 32)
    first = {}
    for name, loss_type, beta in (("user", "user_dpo_losses:doubled_sigmoid", 0.1), ("builtin", "sigmoid", 0.2)):
        cfg = _cfg(output_dir=str(tmp_path / name), loss_type=loss_type, beta=beta, per_device_train_batch_size=2, max_steps=1,
                   model_name=tiny_llama)
        first[name] = DPOTrainer(cfg, tokenizer=tok).train(ds)[0]
    assert first["user"]["loss"] == pytest.approx(first["builtin"]["loss"], abs=1e-6)
    assert first["user"]["grad_norm"] == pytest.approx(first["builtin"]["grad_norm"], rel=1e-5)
