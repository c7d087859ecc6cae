"""The weights a rollout engine loads (rl.engine.weight_sync): HF names, merged LoRA, tied head, no value head."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from rl.engine.weight_sync import hf_name, policy_weights
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
