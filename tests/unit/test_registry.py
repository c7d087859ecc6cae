"""The trainer registry (rl/trainers/registry.py) is the one place a trainer is registered: every entry resolves,
has its launcher and tiny recipe, is exported from `rl`, offered by rl-train and shown in the docs table; and
nothing else names a trainer that is not registered. The lifecycle and failure tests take their parametrisation
from it (tests/unit/trainers/test_lifecycle.py, tests/integration/test_failures.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

import rl
from rl.config.parse import field_type
from rl.scripts import cli
from rl.scripts.train import SHAPES, script
from rl.trainers.base import Trainer
from rl.trainers.registry import SHAPE_NAMES, TRAINERS, docs_table, entry, exports, resolve

ROOT = Path(__file__).resolve().parents[2]
SHIM = (ROOT / "launch" / "sft.py").read_text()


def test_shapes_are_the_registered_shape_names():
    assert sorted(SHAPES) == sorted(SHAPE_NAMES)


@pytest.mark.parametrize("name", TRAINERS)
def test_entry_resolves(name):
    e = entry(name)
    assert e.name == name and e.shape in SHAPE_NAMES, e
    schema, trainer = resolve(e.config), resolve(e.trainer)
    assert dataclasses.is_dataclass(schema), f"{e.config} is not a dataclass schema"
    assert isinstance(trainer, type), e.trainer
    if e.shape in ("epoch", "online", "reward", "ppo"):
        assert callable(getattr(trainer, "load_data", None)), f"{e.trainer} has no load_data(cfg)"
    if e.shape == "epoch":
        assert e.dataset and callable(resolve(e.dataset).from_records), f"{name}: an epoch trainer names its dataset"
    if e.plan:
        assert callable(resolve(e.plan)), e.plan
    if isinstance(e.prompt_group, str):
        assert field_type(schema, e.prompt_group) is not None, f"{name}: prompt_group names no key of {e.config}"
    assert any("{n}" in a for a in e.short_run), f"{name}: short_run sets no run length ({{n}})"
    for key in (a.split("=", 1)[0] for a in e.short_run):
        assert field_type(schema, key) is not None, f"{name}: short_run key {key!r} is not in {e.config}"
    if e.text_column:
        assert field_type(schema, e.text_column) is not None, f"{name}: text_column {e.text_column!r} unknown"
    assert e.doc.strip() and f"launch/{name}.py" in e.doc


@pytest.mark.parametrize("name", TRAINERS)
def test_every_trainer_has_its_launcher_and_tiny_recipe(name):
    launcher, recipe = ROOT / "launch" / f"{name}.py", ROOT / "recipes" / "tiny" / f"{name}.yaml"
    assert launcher.is_file(), f"launch/{name}.py is missing: copy launch/sft.py (every launcher is that file)"
    assert launcher.read_text() == SHIM, f"launch/{name}.py differs from launch/sft.py: make it a copy"
    assert recipe.is_file(), f"recipes/tiny/{name}.yaml is missing: the lifecycle and failure tests run it"


def test_every_registry_launcher_is_registered():
    """A launcher that reads the registry under a name nobody registered would fail at run time."""
    shims = sorted(p.stem for p in (ROOT / "launch").glob("*.py") if p.read_text() == SHIM)
    assert shims == sorted(TRAINERS)


def test_rl_exports_every_trainer_and_config():
    for name, module in exports().items():
        assert name in rl.__all__, name
        assert getattr(rl, name).__module__ == module, name
    for e in TRAINERS.values():
        assert issubclass(resolve(e.trainer), Trainer), e.trainer
        assert getattr(rl, e.trainer.split(":")[1]) is resolve(e.trainer)


def test_rl_train_offers_exactly_the_registry(capsys):
    assert f"--trainer {{{','.join(TRAINERS)}}}" in cli.usage()
    for name in TRAINERS:
        assert cli.command(name, ["--config", "x.yaml"]) == [sys.executable, "-m", "rl.scripts.train", name,
                                                             "--config", "x.yaml"]
        assert cli._schema(name) is resolve(TRAINERS[name].config)
    with pytest.raises(SystemExit) as e:
        cli.main(["--trainer", "nope"])
    assert e.value.code == 2 and f"choose one of {', '.join(TRAINERS)}" in capsys.readouterr().err


def test_docs_table_is_the_registry():
    text = (ROOT / "docs" / "trainers.md").read_text()
    begin, end = "<!-- registry table: begin -->\n", "\n<!-- registry table: end -->"
    assert begin in text and end in text, "docs/trainers.md lost its registry table markers"
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == docs_table(), ("docs/trainers.md's trainer table differs from the registry; paste the output of "
                                   "python -c 'from rl.trainers.registry import docs_table; print(docs_table())'")


def test_help_of_every_trainer(capsys):
    """`--help` is the registry entry's doc and the schema's keys, exit 0 (the in-process form of
    `python launch/<name>.py --help`)."""
    for name, e in TRAINERS.items():
        with pytest.raises(SystemExit) as ex:
            script(name)(["--help"])
        out = capsys.readouterr().out
        assert ex.value.code == 0 and f"launch/{name}.py" in out and "--output_dir" in out, (name, out[-500:])


def test_summaries_say_nothing_for_an_empty_run_or_one_line():
    """A run that logged no row prints no summary (or a line that does not index the empty history)."""
    plan = {"total_steps": 0}

    class Fake:
        history, current_step = [], 0

    for e in TRAINERS.values():
        line = e.summary({} if e.shape == "reward" else [], plan, Fake())
        assert line is None or "\n" not in line, e.name


def test_unregistered_name_is_a_key_error_naming_the_choices():
    with pytest.raises(KeyError, match="registered: sft, reward"):
        entry("nope")
