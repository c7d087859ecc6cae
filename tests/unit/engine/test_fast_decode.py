"""The sampler's in-place KV cache (rl.engine.fast_decode.preallocated_dynamic_cache): the same tokens and
log-probs as HF's concatenating DynamicCache, and the cache operations the sampler uses."""

from __future__ import annotations

import pytest
import torch

import rl.engine.generation as generation
from rl.engine.fast_decode import preallocated_dynamic_cache
from rl.engine.generation import generate
from rl.models.tiny import build_config

V, EOS = 300, 2


def _model(kv_heads: int, family: str = "llama"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = build_config(family, V, hidden=32, layers=2, heads=4)
    cfg.num_key_value_heads = kv_heads
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _hf_cache(monkeypatch):
    from transformers import DynamicCache

    monkeypatch.setattr(generation, "preallocated_dynamic_cache", lambda config, capacity: DynamicCache(config=config))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # plain attention, GQA, MQA
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=20)])
def test_in_place_cache_gives_the_concatenating_caches_rollout(kv_heads, sampling, monkeypatch):
    """Left-padded prompts of 1..6 tokens, 2 samples each (shared prefill), rows leaving the batch as they
    sample EOS (dropped rows: the cache's batch selection), 20 new tokens (past the PREPACK threshold)."""
    model = _model(kv_heads)
    prompts = [[1] + list(range(60, 60 + k)) for k in range(6)]
    kw = dict(max_new_tokens=20, seed=7, eos_token_id=EOS, num_samples=2, **sampling)
    ours = generate(model, 0, prompts, **kw)
    with monkeypatch.context() as m:
        _hf_cache(m)
        hf = generate(model, 0, prompts, **kw)
    assert torch.equal(ours.tokens, hf.tokens) and torch.equal(ours.mask, hf.mask)
    assert ours.finish_reasons == hf.finish_reasons
    torch.testing.assert_close(ours.logprobs, hf.logprobs, atol=1e-6, rtol=0)


def test_in_place_cache_without_padding_or_sharing(monkeypatch):
    model = _model(2)
    prompts = [[1, 70, 71, 72]] * 3
    kw = dict(max_new_tokens=5, seed=3, share_prefill=False, drop_finished=False)
    ours = generate(model, 0, prompts, **kw)
    _hf_cache(monkeypatch)
    hf = generate(model, 0, prompts, **kw)
    assert torch.equal(ours.tokens, hf.tokens)
    torch.testing.assert_close(ours.logprobs, hf.logprobs, atol=1e-6, rtol=0)


def test_layer_operations_match_concatenation():
    from transformers import DynamicCache

    cfg = build_config("llama", V, hidden=32, layers=1, heads=4)
    ours, hf = preallocated_dynamic_cache(cfg, capacity=4), DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(0)

    def kv(b, n):
        return torch.randn(b, 2, n, 8, generator=g), torch.randn(b, 2, n, 8, generator=g)

    def same():
        for a, b in ((ours.layers[0].keys, hf.layers[0].keys), (ours.layers[0].values, hf.layers[0].values)):
            assert torch.equal(a, b)
        assert ours.get_seq_length() == hf.get_seq_length()

    for b, n in ((3, 3), (3, 1), (3, 2)):  # the third write outgrows the capacity of 4: the buffer is reallocated
        k, v = kv(b, n)
        ours.update(k, v, 0)
        hf.update(k, v, 0)
        same()
    for op, arg in (("batch_repeat_interleave", 2), ("batch_select_indices", torch.tensor([0, 3, 5])), ("crop", -2)):
        getattr(ours, op)(arg)
        getattr(hf, op)(arg)
        same()
    k, v = kv(3, 1)
    ours.update(k, v, 0)
    hf.update(k, v, 0)
    same()


bf16_cpu = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                              reason="rollout_dtype=bfloat16 needs a CPU with bf16 instructions")


@bf16_cpu
def test_bf16_linears_compute_the_bf16_product_and_are_removed_after():
    """Inside prepacked_linears(..., torch.bfloat16) a linear returns fp32 holding the bf16 product of the
    bf16-rounded input and weight (not the fp32 product); after the block the module is plain again."""
    from rl.engine.fast_decode import prepacked_linears

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(96, 160))
    x = torch.randn(5, 96)
    exact = lin(x)
    bf16 = torch.nn.functional.linear(x.bfloat16(), lin[0].weight.bfloat16(), lin[0].bias.bfloat16()).float()
    with prepacked_linears(lin, rows=5, dtype=torch.bfloat16):
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (5, 160)
    assert (y - bf16).abs().max() < 2e-2 * bf16.abs().max()  # bf16 rounding of the output, no more
    assert (y - exact).abs().max() > 1e-4  # not the fp32 product
    assert "forward" not in lin[0].__dict__ and torch.equal(lin(x), exact)


@bf16_cpu
def test_bf16_sampler_log_probs_are_the_bf16_models_not_the_fp32_policys():
    """generate(dtype=bfloat16) samples from the bf16 model: its log-probs are the bf16 model's scores of its
    tokens (a teacher-forced forward with the same bf16 linears, up to bf16's rounding of a different
    computation order) and differ from the fp32 policy's; the tokens are in the vocabulary, the mask as fp32's."""
    from rl.engine.fast_decode import prepacked_linears

    model = _model(2)
    prompts = [[1] + list(range(60, 60 + k)) for k in range(1, 5)]
    out = generate(model, 0, prompts, max_new_tokens=12, seed=3, temperature=1.0, num_samples=2, dtype="bfloat16")
    batch = out.to_batch()
    mask = batch["labels"][:, 1:] != -100

    def score():
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)[mask]

    fp32 = score()
    with prepacked_linears(model, rows=batch["input_ids"].shape[0], dtype=torch.bfloat16):
        bf16 = score()
    sampled = batch["old_logprobs"][mask]
    to_bf16, to_fp32 = (sampled - bf16).abs().mean(), (sampled - fp32).abs().mean()
    assert to_fp32 > 1e-5, "the bf16 sampler gave the fp32 model's log-probs"  # measured 3.3e-4 (bf16: 0.0)
    assert to_bf16 < 0.25 * to_fp32, (float(to_bf16), float(to_fp32))


@pytest.mark.parametrize("kv_heads", [2, 1])  # GQA, MQA
def test_grouped_decode_attention_samples_what_sdpa_samples(kv_heads):
    """A model routed through rl_segments (what training with packing leaves a policy with) decodes with the
    grouped matmul attention (rl.engine.segments._grouped_decode): the same tokens and log-probs as plain SDPA
    up to float rounding, on left-padded prompts of different lengths, with rows leaving the batch."""
    from rl.engine import segments

    model = _model(kv_heads)
    prompts = [[1] + list(range(60, 60 + k)) for k in range(1, 7)]
    kw = dict(max_new_tokens=20, seed=5, eos_token_id=EOS, num_samples=2, temperature=1.0)
    plain = generate(model, 0, prompts, **kw)
    calls = []
    grouped = segments._grouped_decode
    segments._grouped_decode = lambda *a: calls.append(1) or grouped(*a)
    try:
        assert segments.enable(model)
        ours = generate(model, 0, prompts, **kw)
    finally:
        segments._grouped_decode = grouped
    assert calls  # the decode steps took the grouped path
    assert torch.equal(ours.tokens, plain.tokens) and torch.equal(ours.mask, plain.mask)
    assert torch.allclose(ours.logprobs, plain.logprobs, atol=1e-5)
