"""The tiny model's head_dim option (rl.models.tiny): the shape vLLM's CPU attention accepts, next to the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl.models.tiny import build_config, write_tiny_model


def test_head_dim_64_keeps_the_hidden_size_and_widens_the_heads(tmp_path, tiny_llama):
    path = write_tiny_model(tmp_path / "hd64", head_dim=64)
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (64, 4, 64)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 64, 64)
    assert model(torch.tensor([[1, 40, 41]])).logits.shape == (1, 3, cfg.vocab_size)
    # the spec marker tells the two shapes apart (a cached default model is not taken for this one), and the
    # default's marker has no head_dim entry (models cached before the option stay valid)
    assert json.loads((path / "tiny_spec.json").read_text())["head_dim"] == 64
    assert "head_dim" not in json.loads(Path(tiny_llama, "tiny_spec.json").read_text())
    with pytest.raises(ValueError, match="gpt2"):
        build_config("gpt2", 320, head_dim=64)
