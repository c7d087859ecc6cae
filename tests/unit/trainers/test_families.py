"""Every trainer, with its defaults, trains on every tiny model family (rl.models.tiny.FAMILIES).

Each family takes other paths through the trainers: GPT-2's learned position table turns shared prompts
off (rl.engine.segments.prefix_sharing), Gemma scales its embeddings, Qwen2's tokenizer adds a token of
its own. A default that works on Llama alone once shipped (DPO on GPT-2: KeyError 'sequence_index'), so
each launch script runs its tiny recipe one step on each family, in this process (conftest.run_main),
with only the sizes cut: no option that picks a code path is changed."""

from __future__ import annotations

import pytest

from rl.models.tiny import FAMILIES
from tests.conftest import run_main

# sizes only (batch, steps, lengths), never a feature switch: the defaults are what is under test
CHEAP = {
    "sft": ["per_device_train_batch_size=4", "max_steps=1"],
    "reward": ["per_device_train_batch_size=4", "max_steps=1"],
    "dpo": ["per_device_train_batch_size=4", "max_steps=1"],
    "kto": ["per_device_train_batch_size=4", "max_steps=1"],
    "ppo": ["per_device_train_batch_size=4", "mini_batch_size=4", "gradient_accumulation_steps=1",
            "max_completion_length=4", "max_steps=1"],  # max_steps replaces the recipe's num_iterations (rounds)
    "grpo": ["per_device_train_batch_size=8", "num_generations=4", "max_steps=1", "eval_num_prompts=4"],
    "online_dpo": ["per_device_train_batch_size=4", "max_steps=1", "max_completion_length=4"],
    "distill": ["per_device_train_batch_size=4", "gradient_accumulation_steps=1", "max_steps=1", "max_completion_length=4"],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("trainer", list(CHEAP))
def test_every_trainer_with_its_defaults_trains_on_every_tiny_family(trainer, family, tmp_path, capfd,
                                                                     monkeypatch):
    out = tmp_path / "run"
    argv = ["--config", f"recipes/tiny/{trainer}.yaml", f"model_name=tiny:{family}", *CHEAP[trainer],
            "logging_steps=1", "report_to=[jsonl]", f"output_dir={out}"]
    code, stdout, stderr = run_main(trainer, argv, capfd, monkeypatch)
    assert code == 0, (stdout + stderr)[-3000:]
    assert (out / "metrics.jsonl").read_text().strip(), stderr[-2000:]
