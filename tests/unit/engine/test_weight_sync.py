"""The weights a rollout engine loads (rl.engine.weight_sync): HF names, merged LoRA, tied head, no value head,
and the buckets they travel in (bit for bit in their dtype)."""

from __future__ import annotations

import copy
import json

import torch
from transformers import AutoModelForCausalLM

from rl.engine.weight_sync import ALIGN, Bucket, hf_name, pack_buckets, policy_weights, unpack_bucket
from rl.models.loading import apply_lora
from rl.models.value import PPOModel


def test_plain_model_sends_its_state_dict_with_the_tied_head(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sent = dict(policy_weights(model))
    assert model.config.tie_word_embeddings
    assert set(sent) == set(model.state_dict())  # lm_head.weight included: vLLM's reload needs it (tied or not)
    assert sent["lm_head.weight"].data_ptr() == sent["model.embed_tokens.weight"].data_ptr()
    assert all(torch.equal(sent[k], v) for k, v in model.state_dict().items())


def test_lora_sends_the_merged_weights_under_the_base_names_and_unmerges(tiny_llama):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = apply_lora(base, 4, 8, 0.0, "all-linear")
    for n, p in model.named_parameters():
        if "lora_B" in n:  # B starts at 0 (no change): give the adapters a real delta
            p.data.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expect = copy.deepcopy(model).merge_and_unload().state_dict()
    sent = {k: v.clone() for k, v in policy_weights(model)}
    assert set(sent) == set(expect) and not any("lora" in k for k in sent)
    assert all(torch.allclose(sent[k], expect[k], atol=1e-6) for k in expect)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(sent[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    after = dict(model.named_parameters())
    assert all(torch.allclose(after[n], v, atol=1e-6) for n, v in before.items())  # unmerged again


def test_value_head_model_sends_the_lm_only(tiny_llama):
    model = PPOModel(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32))
    names = [n for n, _ in policy_weights(model)]
    assert names and not any("value_head" in n for n in names) and "lm_head.weight" in names


def test_hf_names():
    assert hf_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight") is None
    assert hf_name("model.norm.weight") == "model.norm.weight"


def test_a_sync_stopped_half_way_still_unmerges_the_adapters(tiny_llama):
    """An engine that fails during a load leaves the generator unfinished: closing it (VLLMRollout.sync does,
    in a finally) must leave the LoRA policy as it was, not merged."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), 4, 8, 0.0, "all-linear")
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = policy_weights(model)
    next(weights), next(weights)  # merged now
    weights.close()
    assert all(torch.allclose(p, before[n], atol=1e-6) for n, p in model.named_parameters())


def _mixed():
    g = torch.Generator().manual_seed(0)
    return [("a.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
            ("b.fp16", torch.randn(7, generator=g).to(torch.float16)),
            ("c.fp32", torch.randn(4, 4, generator=g)),
            ("d.scalar", torch.tensor(3.25)),
            ("e.empty", torch.empty(0, 2)),
            ("f.int64", torch.arange(5)),
            ("g.bool", torch.tensor([True, False, True])),
            ("h.strided", torch.randn(6, 4, generator=g).t()),  # not contiguous
            ("i.nan_bits", torch.tensor([float("nan"), -0.0, float("inf")]))]


def test_buckets_give_every_tensor_back_bit_for_bit_in_its_dtype():
    items = _mixed()
    buckets = list(pack_buckets(items, bucket_bytes=96))
    got = [p for b in buckets for p in unpack_bucket(b)]
    assert [n for n, _ in got] == [n for n, _ in items]
    for (n, t), (_, u) in zip(items, got):
        assert u.dtype == t.dtype and u.shape == t.shape, n
        # the bytes themselves (NaN payloads, -0.0 included), not a float comparison
        assert torch.equal(u.contiguous().reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), n
    for b in buckets:  # one flat uint8 buffer each, never over the size unless a tensor is larger alone
        assert b.buffer.dtype == torch.uint8 and b.buffer.is_contiguous() and b.buffer.dim() == 1
        assert b.buffer.numel() <= 96 or len(b.metas) == 1
        assert all(m.offset % ALIGN == 0 for m in b.metas)
    # by hand: bf16 15*2 = 30 B, fp16 14 B at offset 64 (aligned) -> 78 B; fp32 64 B would pass 96: a new bucket
    assert [m.name for m in buckets[0].metas] == ["a.bf16", "b.fp16"] and buckets[0].buffer.numel() == 78


def test_a_tensor_larger_than_the_bucket_goes_alone_and_views_share_the_buffer():
    big = torch.arange(100, dtype=torch.float32)
    buckets = list(pack_buckets([("s", torch.ones(2)), ("big", big), ("t", torch.zeros(3))], bucket_bytes=64))
    assert [[m.name for m in b.metas] for b in buckets] == [["s"], ["big"], ["t"]]
    assert buckets[1].buffer.numel() == 400
    (name, view), = unpack_bucket(buckets[1])
    assert torch.equal(view, big) and view.data_ptr() == buckets[1].buffer.data_ptr()  # a view, no copy


def test_bucket_header_round_trip_and_a_model_through_buckets(tiny_llama):
    items = _mixed()
    b = next(pack_buckets(items, bucket_bytes=1 << 20))
    again = Bucket.from_header(json.loads(json.dumps(b.header())), b.buffer.clone())
    assert [(n, t.dtype, t.shape) for n, t in unpack_bucket(again)] == [(n, t.dtype, t.shape) for n, t in items]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    plain = [(n, t.clone()) for n, t in policy_weights(model)]
    for size in (4096, 1 << 20):  # many buckets, one
        got = [(n, t.clone()) for b in pack_buckets(policy_weights(model), size) for n, t in unpack_bucket(b)]
        assert [n for n, _ in got] == [n for n, _ in plain]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, plain))


def test_buckets_of_a_lora_policy_hold_the_merged_weights(tiny_llama):
    """The last bucket is complete only after the weights' iteration ends (and the adapters are unmerged): each
    tensor must be copied in when it arrives."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), 4, 8, 0.0, "all-linear")
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    expect = {k: v.clone() for k, v in policy_weights(model)}
    got = {n: t for b in pack_buckets(policy_weights(model), 1 << 30) for n, t in unpack_bucket(b)}
    assert set(got) == set(expect) and all(torch.equal(got[k], expect[k]) for k in expect)


def test_reused_buckets_fill_one_buffer_and_each_holds_its_own_tensors_while_current():
    items = [(f"t{i}", torch.full((10,), float(i))) for i in range(5)]  # 40 B each: one per 64 B bucket
    seen, ptrs = [], set()
    for b in pack_buckets(items, bucket_bytes=64, reuse=True):
        ptrs.add(b.buffer.data_ptr())
        seen += [(n, t.clone()) for n, t in unpack_bucket(b)]  # read before the next bucket is asked for
    assert len(ptrs) == 1 and [n for n, _ in seen] == [n for n, _ in items]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen, items))
