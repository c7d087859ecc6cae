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
