"""rl.models.limits: the one place that knows a model's context, and the one-line refusals built on it."""

from __future__ import annotations

import pytest

from rl.errors import ConfigError
from rl.models.limits import check_length, context_length, prompt_room
from rl.models.tiny import build_config


def test_context_length_names_the_field_of_each_family():
    assert context_length(build_config("gpt2", 320, max_positions=1024)) == (1024, "n_positions")
    for family in ("llama", "qwen2", "gemma"):
        assert context_length(build_config(family, 320, max_positions=512)) == (512, "max_position_embeddings")

    class Wrapped:  # a DDP / DeepSpeed engine: the model under .module, its config on the model
        module = type("M", (), {"config": build_config("gpt2", 320, max_positions=64)})()

    assert context_length(Wrapped()) == (64, "n_positions")
    assert context_length(object()) is None  # no config, no known limit: nothing is refused


def test_check_length_and_prompt_room_refuse_in_one_line():
    gpt2 = build_config("gpt2", 320, max_positions=1024)
    check_length(1024, gpt2, "tiny:gpt2")  # exactly the context fits
    with pytest.raises(ConfigError) as e:
        check_length(2048, gpt2, "tiny:gpt2", key="sft.max_length")
    assert str(e.value) == ("key 'sft.max_length': 2048 tokens exceed tiny:gpt2's context of 1024 positions (its "
                            "config's n_positions); set sft.max_length=1024 or less")
    assert prompt_room(gpt2, 24, "m") == 1000 and prompt_room(object(), 10 ** 6, "m") is None
    with pytest.raises(ConfigError, match=r"^--max-completion-length 1024 leaves no room for the prompt in m's context of "
                                          r"1024 positions .*; lower --max-completion-length below 1024$"):
        prompt_room(gpt2, 1024, "m")
