"""Two languages (rl/config/vocabulary.py): the reference docs' names and TRL's are silent aliases with their
documented meanings; only our own former names (DEPRECATED) say once that they are deprecated; no schema holds
two keys of one meaning; --help lists no deprecated name."""

import dataclasses
import re
import subprocess
import sys
import warnings

import pytest

from rl.config.fields import build, fields_of
from rl.config.parse import parse_config, to_dict
from rl.config.schema import OnlineConfig, TrainConfig
from rl.config.vocabulary import ALIASES, DEPRECATED, aliases_of, reset_warnings
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
    "log_every": (SFTConfig, 5), "lr_scheduler": (SFTConfig, "cosine"), "ref_model_name": (DPOConfig, "ref/x"),
    "add_eos": (SFTConfig, False), "epsilon_low": (GRPOConfig, 0.15),
}
# the reference docs' names: (schema, alias, its key there, a value other than the default)
REFERENCE = [
    (PPOConfig, "batch_size", "per_device_train_batch_size", 4), (PPOConfig, "ppo_epochs", "num_ppo_epochs", 3),
    (PPOConfig, "clip_ratio", "epsilon", 0.15), (PPOConfig, "kl_penalty_coef", "beta", 0.3),
    (PPOConfig, "value_coef", "vf_coef", 0.4), (PPOConfig, "max_new_tokens", "max_completion_length", 17),
    (PPOConfig, "save_every", "save_steps", 7), (PPOConfig, "eval_every", "eval_steps", 11),
    (DPOConfig, "num_epochs", "num_train_epochs", 3), (DPOConfig, "batch_size", "per_device_train_batch_size", 3),
    (GRPOConfig, "max_new_tokens", "max_completion_length", 9),
]
SCHEMAS = [TrainConfig, OnlineConfig, RewardModelConfig, *(_schema(t) for t in TRAINERS)]


def _deprecation_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "deprecated" in line]


def test_every_old_key_has_a_case():
    assert set(CASES) == set(DEPRECATED)


def test_no_name_is_both_an_alias_and_deprecated():
    assert not set(ALIASES) & set(DEPRECATED)


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


@pytest.mark.parametrize("schema,alias,key,value", REFERENCE, ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_reference_name_is_its_key_silently_everywhere(schema, alias, key, value, capsys, tmp_path):
    assert aliases_of(schema)[alias] == key and getattr(schema(model_name="m"), key) != value
    expected = to_dict(parse_config(schema, ["model_name=m", f"{key}={value}"]))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name: m\n{alias}: {value}\n")
    reset_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cfg in (parse_config(schema, ["model_name=m", f"{alias}={value}"]),
                    parse_config(schema, ["--config", str(recipe)]), schema(model_name="m", **{alias: value}),
                    build(schema, {"model_name": "m", alias: value})):
            assert to_dict(cfg) == expected and getattr(cfg, alias) == value
        cfg.__setattr__(alias, value)  # setting the reference's attribute sets the key
        assert alias not in vars(cfg)
    assert capsys.readouterr().err == ""


def test_two_names_of_one_key_with_different_values_is_one_error_line():
    with pytest.raises(ConfigError, match="keys 'batch_size' and 'per_device_train_batch_size' are the same setting "
                                          "with different values"):
        parse_config(SFTConfig, ["model_name=m", "per_device_train_batch_size=4", "batch_size=2"])
    with pytest.raises(ConfigError, match="keys 'clip_ratio' and 'epsilon' are the same setting"):
        PPOConfig(model_name="m", clip_ratio=0.1, epsilon=0.3)
    assert PPOConfig(model_name="m", clip_ratio=0.1, epsilon=0.1).epsilon == 0.1  # one setting, said twice


def test_the_reference_ppo_example_keeps_its_meanings():
    """The reference docs' PPOConfig block: num_iterations = 100 rollout rounds, ppo_epochs = 4 updates per batch
    (TRL's num_ppo_epochs), the CLI's documented sampling defaults; no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = PPOConfig(model_name="m", batch_size=16, mini_batch_size=4, ppo_epochs=4, num_iterations=100)
    plan = ppo_plan(cfg, 64, 1)
    assert (plan["iterations"], plan["steps_per_iteration"], plan["total_steps"]) == (100, 16, 1600)
    assert ppo_plan(cfg, 64, 1, rounds=3)["total_steps"] == 48  # PPOTrainer.train(prompts, num_iterations=3)
    default = PPOConfig(model_name="m")
    assert (default.max_completion_length, default.top_k, default.num_ppo_epochs, default.beta) == (128, 50, 4, 0.1)
    # without rounds the run is max_steps optimizer steps (TRL's meaning); both is one error line
    steps = ppo_plan(PPOConfig(model_name="m", per_device_train_batch_size=8, mini_batch_size=4, num_ppo_epochs=3,
                               max_steps=10), 64, 1)
    assert (steps["steps_per_iteration"], steps["iterations"], steps["total_steps"]) == (6, 2, 10)
    with pytest.raises(ConfigError, match="num_iterations=2 .rollout rounds. and max_steps=10"):
        PPOConfig(model_name="m", num_iterations=2, max_steps=10)
    # GRPO's num_iterations is TRL's mu (updates per batch): the reference's rl_num_ppo_epochs reaches it there
    assert build(GRPOConfig, {"model_name": "m", "rl_num_ppo_epochs": 2}).num_iterations == 2
    assert build(PPOConfig, {"model_name": "m", "rl_num_ppo_epochs": 2}).num_ppo_epochs == 2


def test_a_run_length_on_the_command_line_replaces_the_recipes(tmp_path):
    recipe = ROOT / "recipes/tiny/ppo.yaml"
    assert (parse_config(PPOConfig, ["--config", str(recipe)]).num_iterations,
            parse_config(PPOConfig, ["--config", str(recipe), "max_steps=5"]).num_iterations) == (12, None)


def test_an_error_names_the_key_as_typed():
    with pytest.raises(ConfigError, match="key 'max_new_tokens' has value 'x'"):
        parse_config(PPOConfig, ["model_name=m", "max_new_tokens=x"])
    with pytest.raises(ConfigError, match="key 'clip_ratio' .epsilon. must be > 0"):
        parse_config(PPOConfig, ["model_name=m", "clip_ratio=-1"])


def test_a_new_name_on_the_command_line_overrides_another_name_in_the_recipe(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name: m\nbatch_size: 2\nlog_every: 3\n")
    reset_warnings()
    cfg = parse_config(SFTConfig, ["--config", str(recipe), "per_device_train_batch_size=4", "logging_steps=5"])
    assert (cfg.per_device_train_batch_size, cfg.logging_steps) == (4, 5)
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
    assert SFTConfig(model_name="m", log_every=3).logging_steps == 3
    assert _deprecation_lines(capsys.readouterr().err) == []


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_no_schema_has_two_keys_of_one_meaning(schema):
    fields = fields_of(schema)
    assert not [old for old in DEPRECATED if old in fields], "a deprecated name is a field again"
    assert not [(a, k) for a, k in aliases_of(schema).items() if a in fields]


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


def test_the_pipelines_stage_sections_take_every_name_before_the_merge(capsys):
    """A recipe's grpo.eval_steps and a command line's grpo.eval_every are one setting: the override wins."""
    from rl.scripts.pipeline import PipelineConfig

    reset_warnings()
    cfg = parse_config(PipelineConfig, ["--config", str(ROOT / "recipes/tiny/pipeline.yaml"), "grpo.eval_every=0",
                                        "sft.batch_size=4", "sft.log_every=2"])
    assert cfg.grpo["eval_steps"] == 0 and cfg.sft["per_device_train_batch_size"] == 4
    assert cfg.sft["logging_steps"] == 2
    assert _deprecation_lines(capsys.readouterr().err) == [
        "warning: key 'sft.log_every' is deprecated; use 'sft.logging_steps'"]
