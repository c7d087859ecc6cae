"""Padding-free packed SFT batches (rl.packing): per-token log-probs, loss and gradients equal the padded
path's, so attention does not cross example boundaries (SDPA and eager, every tiny family)."""

import pytest
import torch

from rl.losses import token_logprobs
from rl.packing import pack_examples
from rl.sft import collate, sum_normalised_nll
from rl.tiny import build_config

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
    from rl.config import build
    from rl.sft import SFTConfig, SFTTrainer

    data = [{"input_ids": list(range(3, 3 + n)), "labels": [-100] * (n // 3) + list(range(3 + n // 3, 3 + n))}
            for n in (5, 12, 3, 9, 7, 16, 4, 10)] * 2
    rows = {}
    for packing in (False, True):
        cfg = build(SFTConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / str(packing)), batch_size=4,
                                    gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2, seed=0,
                                    report_to=["none"], packing=packing, dtype="float32"))
        rows[packing] = SFTTrainer(cfg).train(data)
    assert len(rows[False]) == len(rows[True]) >= 2
    for a, b in zip(rows[False], rows[True]):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["num_tokens"] == a["num_tokens"]
