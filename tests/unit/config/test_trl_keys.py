"""No unknown key for a TRL field: every field of TRL 1.16's configs (SFT, DPO, GRPO, Reward, KTO, online DPO; its
ScriptArguments and ModelConfig beside each) is honoured by the trainer's schema (a field or an alias of the one
table) or listed in rl.config.trl_keys with its reason. TRL (pinned in the `dev` extra) is introspected, so a TRL
upgrade fails here on what is new. A TRL config with every field at TRL's default builds here and prints nothing."""

import dataclasses

import pytest

from rl.config.fields import build, fields_of
from rl.config.trl_keys import NOT_APPLICABLE, NOT_IMPLEMENTED, SAME_HERE, TABLES, ignored_reason
from rl.config.vocabulary import aliases_of, reset_warnings
from rl.scripts.cli import _schema

import trl  # noqa: E402 - pinned in the dev extra


def _trl_configs() -> dict[str, type]:
    from trl.experimental.online_dpo import OnlineDPOConfig

    return {"sft": trl.SFTConfig, "dpo": trl.DPOConfig, "grpo": trl.GRPOConfig, "reward": trl.RewardConfig,
            "kto": trl.KTOConfig, "online_dpo": OnlineDPOConfig}


def _trl_fields(trainer: str) -> dict[str, object]:
    """TRL's fields for `trainer`'s CLI (`trl <trainer> --config`): ScriptArguments, ModelConfig and the trainer's
    config (GRPO's script adds reward_funcs / reward_model_name_or_path), each with its declared default."""
    from trl.scripts.grpo import GRPOScriptArguments

    classes = [trl.ScriptArguments, trl.ModelConfig, _trl_configs()[trainer]]
    if trainer == "grpo":
        classes.append(GRPOScriptArguments)
    out = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            out[f.name] = getattr(default, "value", default)  # transformers' str enums: their value
    return out


def classify(trainer: str) -> dict[str, str]:
    """field -> honoured | same_here | not_applicable | not_implemented | UNKNOWN, for `trainer`'s schema."""
    schema = _schema(trainer)
    honoured = set(fields_of(schema)) | set(aliases_of(schema))
    kinds = {id(NOT_APPLICABLE): "not_applicable", id(SAME_HERE): "same_here", id(NOT_IMPLEMENTED): "not_implemented"}
    out = {}
    for name in _trl_fields(trainer):
        table = next((t for t in TABLES if name in t), None)
        out[name] = "honoured" if name in honoured else kinds[id(table)] if table is not None else "UNKNOWN"
    return out


def coverage(trainer: str) -> dict[str, int]:
    kinds = list(classify(trainer).values())
    counts = {k: kinds.count(k) for k in ("honoured", "same_here", "not_applicable", "not_implemented")}
    return {"total": len(kinds), **counts, "with_a_meaning": len(kinds) - counts["not_applicable"]}


TRAINERS = sorted(_trl_configs())


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_trl_field_is_honoured_or_listed_with_a_reason(trainer):
    unknown = sorted(k for k, v in classify(trainer).items() if v == "UNKNOWN")
    assert not unknown, (f"TRL fields of {trainer} neither honoured nor listed in rl/config/trl_keys.py: {unknown}; "
                         f"honour each (a schema field or an ALIASES entry) or list it with its reason")


@pytest.mark.parametrize("trainer", TRAINERS)
def test_honoured_is_at_least_80_percent_of_the_fields_with_a_meaning_here(trainer):
    c = coverage(trainer)
    assert c["honoured"] + c["same_here"] >= 0.8 * c["with_a_meaning"], c


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_trl_config_at_its_defaults_builds_here_without_a_line(trainer, capsys):
    """Every TRL field, at TRL's default, in one recipe: it builds, and no listed key prints a note (a default
    asks for nothing). TRL's defaults that mean "unset" (max_steps -1, bf16 null, eval_steps null) are read so."""
    reset_warnings()
    recipe = {k: v for k, v in _trl_fields(trainer).items() if k not in ("output_dir", "model_name_or_path")}
    recipe.update(model_name="tiny:llama", output_dir="runs/x")
    if trainer == "grpo":  # TRL's GRPO default samples 8 per prompt; our batch must hold whole groups
        recipe["per_device_train_batch_size"] = 8
    cfg = build(_schema(trainer), recipe, "trl-defaults.yaml")
    assert cfg.max_steps is None and cfg.model_name == "tiny:llama"
    assert "note:" not in capsys.readouterr().err
    for name, (quiet, reason) in {k: v for t in TABLES for k, v in t.items()}.items():
        assert reason and not reason.endswith("."), name  # one clause for the one line


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_listed_key_that_asks_for_something_says_so_once(trainer, capsys):
    reset_warnings()
    build(_schema(trainer), {"model_name": "m", "torch_compile": True, "dataloader_num_workers": 4}, "r.yaml")
    build(_schema(trainer), {"model_name": "m", "torch_compile": True}, "r.yaml")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"note: key 'torch_compile' is accepted and ignored ({NOT_IMPLEMENTED['torch_compile'][1]})",
                   f"note: key 'dataloader_num_workers' is accepted and ignored "
                   f"({NOT_APPLICABLE['dataloader_num_workers'][1]})"]
    assert ignored_reason("torch_compile", False) == "" and ignored_reason("model_name", "x") is None


def test_the_listed_keys_are_trls_and_none_is_a_field_of_every_trainer():
    """A listed name is a field of some TRL config (or a former TRL/transformers name); a name every trainer honours
    does not belong in the table."""
    every_trl = set().union(*(_trl_fields(t) for t in TRAINERS))
    former = {"vllm_device", "use_liger"}  # TRL's / open-r1's former keys, still in public recipes
    listed = {k for t in TABLES for k in t}
    assert listed - every_trl <= former, sorted(listed - every_trl - former)
    honoured_everywhere = set.intersection(*({k for k, v in classify(t).items() if v == "honoured"} for t in TRAINERS))
    assert not listed & honoured_everywhere, sorted(listed & honoured_everywhere)
