"""Recipe parsing: overrides, help, and the one-line errors a user gets for each kind of mistake."""

import sys

import pytest

from rl.config.fields import build
from rl.config.parse import help_text, parse_config, save_config
from rl.config.schema import TrainConfig
from rl.errors import ConfigError
from tests.conftest import ROOT, run_cmd


@pytest.fixture
def recipe(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model_name: tiny:llama\nlearning_rate: 1.0e-4\nlora:\n  rank: 4\ndata:\n  path: x.jsonl\n")
    return p


def test_overrides_in_every_form(recipe):
    cfg = parse_config(TrainConfig, ["--config", str(recipe), "--batch-size", "4", "lora.alpha=8",
                                     "--gradient_checkpointing", "--data.text_column=body", "report_to=[jsonl,wandb]",
                                     "--max_grad_norm", "null"])
    assert cfg.learning_rate == 1e-4 and cfg.per_device_train_batch_size == 4
    assert cfg.lora.rank == 4 and cfg.lora.alpha == 8
    assert cfg.gradient_checkpointing is True
    assert cfg.data.path == "x.jsonl" and cfg.data.text_column == "body"
    assert cfg.report_to == ["jsonl", "wandb"] and cfg.max_grad_norm is None


def test_scientific_notation_and_bool_words(recipe):
    cfg = parse_config(TrainConfig, ["--config", str(recipe), "learning_rate=3e-5", "lora.enabled=yes"])
    assert cfg.learning_rate == pytest.approx(3e-5) and cfg.lora.enabled is True


@pytest.mark.parametrize("argv,expected", [
    (["--learnig_rate", "3"], "unknown key 'learnig_rate' (did you mean learning_rate?)"),
    (["lora.rnk=3"], "unknown key 'lora.rnk' (did you mean lora.rank"),
    (["per_device_train_batch_size=abc"], "key 'per_device_train_batch_size' has value 'abc', expected int"),
    (["dtype=fp8"], "expected 'float32' | 'bfloat16' | 'float16' | 'auto'"),
    (["per_device_train_batch_size=0"], "'per_device_train_batch_size' must be at least 1"),
])
def test_errors_name_key_value_and_fix(recipe, argv, expected):
    with pytest.raises(ConfigError) as e:
        parse_config(TrainConfig, ["--config", str(recipe), *argv])
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_required_key_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="missing required key 'model_name'"):
        parse_config(TrainConfig, [])
    with pytest.raises(ConfigError, match="recipe file not found: nope.yaml"):
        parse_config(TrainConfig, ["--config", "nope.yaml"])
    # a required key may come from the command line instead of the recipe
    (tmp_path / "r.yaml").write_text("per_device_train_batch_size: 2\n")
    cfg = parse_config(TrainConfig, ["--config", str(tmp_path / "r.yaml"), "model_name=m"])
    assert cfg.model_name == "m"


def test_recipe_mistake_names_the_recipe(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model_name: m\nkl_coeff: 0.1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'kl_coeff'"):
        parse_config(TrainConfig, ["--config", str(p)])
    p.write_text("model_name: m\n  bad: [indent\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        parse_config(TrainConfig, ["--config", str(p)])


def test_help_lists_every_field_with_default(tmp_path):
    text = help_text(TrainConfig, "x")
    for key in ("--model_name", "--learning_rate", "(default: 1e-05)", "--lora.rank", "--data.path"):
        assert key in text


def test_resolved_config_round_trips(recipe, tmp_path):
    cfg = parse_config(TrainConfig, ["--config", str(recipe), "seed=7"])
    out = save_config(cfg, tmp_path / "out")
    again = parse_config(TrainConfig, ["--config", str(out)])
    assert again == cfg


@pytest.mark.slow
def test_launch_script_exits_2_with_one_line(recipe):
    import subprocess

    proc = subprocess.run([sys.executable, "launch/sft.py", "--config", str(recipe), "--lerning_rate", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: command line: unknown key 'lerning_rate' "
                                                "(did you mean learning_rate?)"]
    assert "Traceback" not in proc.stderr
    out = run_cmd([sys.executable, "launch/sft.py", "--help"], timeout=120).stdout
    assert "--completion_only_loss" in out and "--lora.rank" in out


def test_one_alias_table_for_reference_and_trl_names():
    """rl/config/fields.py ALIASES: one table; each schema takes the first candidate that is one of its keys."""
    from rl.trainers.dpo import DPOConfig
    from rl.trainers.grpo_config import GRPOConfig
    from rl.trainers.ppo_config import PPOConfig
    from rl.trainers.sft import SFTConfig

    ppo = build(PPOConfig, {"model_name": "m", "rl_kl_coef": 0.3, "max_completion_length": 7, "bf16": True,
                            "per_device_train_batch_size": 8, "mini_batch_size": 8, "logging_steps": 3,
                            "cliprange": 0.1, "vf_coef": 0.2})
    assert (ppo.beta, ppo.max_completion_length, ppo.dtype, ppo.per_device_train_batch_size, ppo.logging_steps) == \
        (0.3, 7, "bfloat16", 8, 3)
    assert (ppo.epsilon, ppo.vf_coef) == (0.1, 0.2)
    grpo = build(GRPOConfig, {"model_name": "m", "rl_kl_coef": 0.3, "max_new_tokens": 9, "epsilon": 0.1,
                              "epsilon_high": 0.3, "num_train_epochs": 2, "save_steps": 5})
    assert (grpo.beta, grpo.max_completion_length, grpo.epsilon, grpo.epsilon_high, grpo.num_train_epochs,
            grpo.save_steps) == (0.3, 9, 0.1, 0.3, 2, 5)
    dpo = build(DPOConfig, {"model_name": "m", "model_ref": "r", "dpo_beta": 0.2, "precompute_ref_log_probs": True,
                            "bf16": False, "lr_scheduler_type": "cosine"})
    assert (dpo.ref_model, dpo.beta, dpo.precompute_ref_logps, dpo.dtype, dpo.lr_scheduler_type) == \
        ("r", 0.2, True, "float32", "cosine")
    # a name with no meaning for a trainer is an unknown key there, and suggestions prefer our own keys
    with pytest.raises(ConfigError, match="unknown key 'rl_gamma'"):
        build(SFTConfig, {"model_name": "m", "rl_gamma": 0.9})
    with pytest.raises(ConfigError, match=r"unknown key 'max_stepz' \(did you mean max_steps\?\)"):
        build(SFTConfig, {"model_name": "m", "max_stepz": 3})
    with pytest.raises(ConfigError, match="key 'bf16' has value 'maybe', expected bool"):
        build(SFTConfig, {"model_name": "m", "bf16": "maybe"})


def test_every_float_key_of_every_schema_refuses_nan_and_inf():
    """One rule for every float key (issue: temperature=nan, epsilon_high=nan, overlong_penalty=nan trained
    nothing and exited 0): each schema's float keys, set to nan or inf on the command line, are one
    ConfigError naming the key, at parse time."""
    import dataclasses

    from rl.config.parse import parse_config
    from rl.scripts.cli import TRAINERS, _schema

    checked = 0
    for trainer in TRAINERS:
        schema = _schema(trainer)
        for f in dataclasses.fields(schema):
            if not isinstance(f.default, float):
                continue
            for bad in ("nan", "inf"):
                with pytest.raises(ConfigError, match=rf"key '{f.name}' must be a finite number"):
                    parse_config(schema, ["--model_name", "tiny:llama", f"{f.name}={bad}"])
            checked += 1
    assert checked > 40  # every trainer's learning rate, betas, clips, penalties, temperatures, ...
