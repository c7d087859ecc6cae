"""One vocabulary (rl/config/vocabulary.py): TRL's names are the fields, our former names deprecated aliases
that behave exactly as the new key and say so once; no schema holds two keys of one meaning; --help shows
only the new names."""

import dataclasses
import re
import subprocess
import sys

import pytest

from rl.config.fields import build, fields_of
from rl.config.parse import parse_config, to_dict
from rl.config.schema import OnlineConfig, TrainConfig
from rl.config.vocabulary import DEPRECATED, reset_warnings
from rl.errors import ConfigError
from rl.models.reward_config import RewardModelConfig
from rl.scripts.cli import TRAINERS, _schema
from rl.trainers.dpo import DPOConfig
from rl.trainers.grpo_config import GRPOConfig
from rl.trainers.ppo_config import PPOConfig, ppo_plan
from rl.trainers.sft import SFTConfig
from tests.conftest import ROOT

# old key -> (a schema that has the new key, a value other than its default)
CASES = {
    "batch_size": (SFTConfig, 3), "num_epochs": (SFTConfig, 3), "log_every": (SFTConfig, 5),
    "save_every": (SFTConfig, 7), "eval_every": (SFTConfig, 11), "lr_scheduler": (SFTConfig, "cosine"),
    "max_new_tokens": (PPOConfig, 17), "ref_model_name": (DPOConfig, "ref/x"), "add_eos": (SFTConfig, False),
    "kl_penalty_coef": (PPOConfig, 0.3), "clip_ratio": (PPOConfig, 0.15), "epsilon_low": (GRPOConfig, 0.15),
    "value_coef": (PPOConfig, 0.4), "ppo_epochs": (PPOConfig, 3),
}
SCHEMAS = [TrainConfig, OnlineConfig, RewardModelConfig, *(_schema(t) for t in TRAINERS)]


def _deprecation_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "deprecated" in line]


def test_every_old_key_has_a_case():
    assert set(CASES) == set(DEPRECATED)


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_old_key_parses_to_the_new_field_with_one_deprecation_line(old, capsys, tmp_path):
    schema, value = CASES[old]
    new = DEPRECATED[old]
    assert dataclasses.fields(schema) and new in fields_of(schema) and old not in fields_of(schema)
    assert getattr(schema(model_name="m"), new) != value  # the case proves something
    want = f"warning: key '{old}' is deprecated; use '{new}'"
    expected = to_dict(parse_config(schema, ["model_name=m", f"{new}={value}"]))
    capsys.readouterr()
    # on the command line, in a recipe (both read twice by parse_config) and as a keyword: one line per run
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name: m\n{old}: {value}\n")
    for argv in (["model_name=m", f"{old}={value}"], ["--config", str(recipe)]):
        reset_warnings()
        cfg = parse_config(schema, argv)
        assert getattr(cfg, new) == value and to_dict(cfg) == expected
        assert _deprecation_lines(capsys.readouterr().err) == [want]
    reset_warnings()
    cfg = schema(model_name="m", **{old: value})
    assert to_dict(cfg) == expected
    assert getattr(cfg, old) == value  # an old attribute reads the new field
    cfg2 = build(schema, {"model_name": "m", old: value})
    assert to_dict(cfg2) == expected
    assert _deprecation_lines(capsys.readouterr().err) == [want]


def test_old_and_new_key_together_is_one_error_line():
    with pytest.raises(ConfigError, match="keys 'batch_size' and 'per_device_train_batch_size' are the same setting"):
        parse_config(SFTConfig, ["model_name=m", "batch_size=2", "per_device_train_batch_size=4"])
    with pytest.raises(ConfigError, match="keys 'batch_size' and 'per_device_train_batch_size'"):
        SFTConfig(model_name="m", batch_size=2, per_device_train_batch_size=4)
    # the reference docs' PPOConfig(ppo_epochs=4, num_iterations=100): 100 were rounds, now it says so
    with pytest.raises(ConfigError, match="num_iterations now means the updates per rollout batch.*max_steps"):
        PPOConfig(model_name="m", ppo_epochs=4, num_iterations=100)


def test_a_new_name_on_the_command_line_overrides_an_old_one_in_the_recipe(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name: m\nbatch_size: 2\n")
    reset_warnings()
    assert parse_config(SFTConfig, ["--config", str(recipe), "per_device_train_batch_size=4"]).per_device_train_batch_size == 4
    assert len(_deprecation_lines(capsys.readouterr().err)) == 1


def test_setting_an_old_attribute_sets_the_new_field(capsys):
    reset_warnings()
    cfg = SFTConfig(model_name="m")
    cfg.log_every = 9
    assert cfg.logging_steps == 9 and "log_every" not in vars(cfg)
    assert _deprecation_lines(capsys.readouterr().err) == ["warning: key 'log_every' is deprecated; use 'logging_steps'"]


def test_only_the_main_process_prints(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    reset_warnings()
    assert SFTConfig(model_name="m", batch_size=3).per_device_train_batch_size == 3
    assert _deprecation_lines(capsys.readouterr().err) == []


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_no_schema_has_two_keys_of_one_meaning(schema):
    fields = fields_of(schema)
    assert not [old for old in DEPRECATED if old in fields], "a deprecated name is a field again"
    assert not [(old, new) for old, new in DEPRECATED.items() if old in fields and new in fields]


def test_ppo_counts_optimizer_steps_and_num_iterations_is_updates_per_batch():
    cfg = PPOConfig(model_name="m", per_device_train_batch_size=8, mini_batch_size=4, num_iterations=3, max_steps=10)
    plan = ppo_plan(cfg, 64, 1)
    # a round: 3 passes x 2 minibatches = 6 optimizer steps; 10 steps stop part-way through round 2
    assert (plan["steps_per_iteration"], plan["iterations"], plan["total_steps"]) == (6, 2, 10)
    assert ppo_plan(cfg, 64, 1, rounds=3)["total_steps"] == 18  # PPOTrainer.train(prompts, rounds=3)
    # the sampling keys are the one shared declaration: GRPO's defaults
    grpo = GRPOConfig(model_name="m")
    assert [getattr(cfg, k) for k in ("top_k", "top_p", "temperature", "max_completion_length")] == \
        [getattr(grpo, k) for k in ("top_k", "top_p", "temperature", "max_completion_length")]


def test_grpo_epsilon_high_defaults_to_epsilon():
    assert GRPOConfig(model_name="m", epsilon=0.1).epsilon_high == 0.1
    assert GRPOConfig(model_name="m", epsilon=0.1, epsilon_high=0.28).epsilon_high == 0.28


HELP = r"""
import contextlib, io, runpy, sys
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit:
            pass
    print("=== " + script)
    print(out.getvalue())
"""


def test_help_of_every_launch_script_lists_no_deprecated_name():
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "launch").glob("*.py"))
    proc = subprocess.run([sys.executable, "-c", HELP, *scripts], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pages = dict(re.findall(r"=== (\S+)\n(.*?)(?=\n=== |\Z)", proc.stdout, re.S))
    assert sorted(pages) == scripts
    for script, page in pages.items():
        assert "usage" in page, (script, page[:500])
        for old in DEPRECATED:
            for form in (old, old.replace("_", "-")):
                hits = re.findall(rf"(?<![\w.-]){form}(?![\w-])", page)
                assert not hits, f"{script} --help names the deprecated {form!r}"
    assert "--max-completion-length" in pages["launch/eval.py"] and "--per_device_train_batch_size" in pages["launch/sft.py"]


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_a_recipe_in_the_new_names_prints_no_deprecation(trainer, capsys, tmp_path):
    """The code reads only the new names: building a config and its preflight checks warn about nothing
    (reading an old attribute would print the deprecation line, as the recipe runs showed once)."""
    from rl.scripts.common import preflight_problems

    reset_warnings()
    recipe = ROOT / "recipes" / "tiny" / f"{trainer}.yaml"
    cfg = parse_config(_schema(trainer), ["--config", str(recipe), f"output_dir={tmp_path}"])
    preflight_problems(cfg)
    assert _deprecation_lines(capsys.readouterr().err) == []


def test_the_pipelines_stage_sections_rename_old_keys_before_the_merge(capsys):
    """A recipe's grpo.eval_steps and a command line's grpo.eval_every are one setting: the override wins."""
    from rl.scripts.pipeline import PipelineConfig

    reset_warnings()
    cfg = parse_config(PipelineConfig, ["--config", str(ROOT / "recipes/tiny/pipeline.yaml"), "grpo.eval_every=0",
                                        "sft.batch_size=4"])
    assert cfg.grpo["eval_steps"] == 0 and cfg.sft["per_device_train_batch_size"] == 4
    assert sorted(_deprecation_lines(capsys.readouterr().err)) == [
        "warning: key 'grpo.eval_every' is deprecated; use 'grpo.eval_steps'",
        "warning: key 'sft.batch_size' is deprecated; use 'sft.per_device_train_batch_size'"]
