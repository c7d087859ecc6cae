"""The launch code of every registered trainer (rl.trainers.registry), one `main(name, argv)`:

    python launch/<name>.py --config recipes/tiny/<name>.yaml [key=value ...]
    python -m rl.scripts.train <name> --config ... [key=value ...]   # the same from an installed wheel (rl-train)

It reads top to bottom, as each launch script did: 1. parse (recipe + overrides, preflight) -> 2. setup (the
data validated before any model is built, or the --dry-run plan) -> 3. train -> 4. save (model + card) and one
summary line. What differs between trainers is the registry entry's: its schema and trainer, its data
shape (`SHAPES` below: how the data is loaded and handed to the trainer), its dry-run sizes and summary.
Exit status: 2 for a mistake in the input, 1 for a failure during the run, 128 + signal after a stop's
checkpoint (rl.scripts.common).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rl.config.parse import save_config
from rl.config.plan import prompts_step_problem
from rl.data.records import split_eval
from rl.data.sft import load_sft_records, tokenize_examples
from rl.engine.dist import run_as_program
from rl.errors import ConfigError, DataError, RunError
from rl.models.card import write_model_card
from rl.models.hub import HubPusher
from rl.scripts.common import fail, final_save, parse_recipe, run_training
from rl.scripts.dryrun import dry_run_data, dry_run_report
from rl.trainers.base import check_output_dir
from rl.trainers.ppo_config import check_reward_source, critic_problem
from rl.trainers.registry import TRAINERS, Entry, resolve, unread_data_key

# what a setup may raise that is the user's to fix: one `error:` line, exit 2
SETUP_ERRORS = (ConfigError, DataError, RunError, ValueError, FileNotFoundError)


@dataclass
class Run:
    """A built trainer and how to train it: `train(*args, **kwargs)` returns the history; `plan` the
    trainer's own (the summary line reads it)."""
    trainer: object
    train: Callable
    args: tuple = ()
    kwargs: dict | None = None
    plan: dict | None = None


# ------------------------------------------------------------------------------------ the shapes
# Each: load(entry, cls, cfg) -> the data (validated, no model), and build(entry, cls, cfg, data) -> Run.

def _load_sft(entry, cls, cfg):
    records = load_sft_records(cfg.data.path, cfg)
    evals = load_sft_records(cfg.data.eval_path, cfg, for_eval=True) if cfg.data.eval_path else None
    if evals is None:
        records, evals = split_eval(records, cfg.data.eval_fraction, cfg.seed)
    return records, evals


def _build_sft(entry, cls, cfg, data) -> Run:
    records, eval_records = data
    trainer = cls(cfg)
    train = tokenize_examples(records, trainer.tokenizer, cfg, cfg.data.path)
    evals = tokenize_examples(eval_records, trainer.tokenizer, cfg, cfg.data.eval_path or cfg.data.path)
    return Run(trainer, trainer.train, (train, evals or None))


def _load(entry, cls, cfg):
    return cls.load_data(cfg)


def _build_epoch(entry, cls, cfg, data) -> Run:
    records, eval_records = data
    dataset = resolve(entry.dataset)
    trainer = cls(cfg)
    train = dataset.from_records(records, trainer.tokenizer, cfg, cfg.data.path)
    evals = (dataset.from_records(eval_records, trainer.tokenizer, cfg, cfg.data.eval_path or cfg.data.path)
             if eval_records else None)
    trainer.plan(len(train))  # a dataset smaller than one global batch fails here, in one line
    return Run(trainer, trainer.train, (train, evals))


def _build_online(entry, cls, cfg, rows) -> Run:
    trainer = cls(cfg, train_prompts=rows)  # rows None: the environment supplies the prompts
    return Run(trainer, trainer.train, plan=trainer.plan())


def _build_reward(entry, cls, cfg, data) -> Run:
    trainer = cls.from_recipe(cfg)
    return Run(trainer, trainer.train_recipe, (cfg, *data))


def _load_ppo(entry, cls, cfg):
    if not (cfg.dry_run and cfg.reward_model_path and not Path(cfg.reward_model_path).exists()):
        check_reward_source(cfg)  # a dry run plans without the reward model that an earlier step writes
        problem = critic_problem(cfg)  # a critic from another directory reads the policy's token ids
        if problem:
            raise ConfigError(problem)
    return cls.load_data(cfg)


def _build_ppo(entry, cls, cfg, data) -> Run:
    prompts, metadata, eval_prompts, eval_metadata = data
    trainer = cls(cfg)
    return Run(trainer, trainer.train, (prompts,), dict(metadata=metadata, eval_prompts=eval_prompts,
                                                        eval_metadata=eval_metadata))


def _save(trainer, cfg) -> str:
    return trainer.save()


def _save_reward(trainer, cfg) -> str:
    out = trainer.save_model(cfg.output_dir)
    if trainer.accelerator.is_main_process:
        save_config(cfg, cfg.output_dir, "recipe.yaml")
    return out


@dataclass(frozen=True)
class Shape:
    load: Callable
    build: Callable
    save: Callable = _save
    card_history: Callable = lambda trainer, history: history  # the rows the model card's table reads


SHAPES = {
    "sft": Shape(_load_sft, _build_sft),
    "epoch": Shape(_load, _build_epoch),
    "online": Shape(_load, _build_online),
    "reward": Shape(_load, _build_reward, _save_reward, lambda trainer, metrics: trainer.history),
    "ppo": Shape(_load_ppo, _build_ppo),
}


# ------------------------------------------------------------------------------------ the dry run

def _count(data) -> int | None:
    """The examples a dry run plans for: the training rows of what the shape's load returned."""
    rows = data[0] if isinstance(data, tuple) else data
    return len(rows) if rows else None


def dry_run(entry: Entry, cls, cfg, shape: Shape) -> None:
    """Print the plan of the run (rl.scripts.dryrun): sizes, the trainer's own, memory; no weights read."""
    n = _count(dry_run_data(cfg, lambda c: shape.load(entry, cls, c)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = resolve(entry.plan)(cfg, world=world, n_prompts=n) if entry.plan else None
    group = getattr(cfg, entry.prompt_group) if isinstance(entry.prompt_group, str) else entry.prompt_group
    models = cls.dry_run_models(cfg) if hasattr(cls, "dry_run_models") else {"policy (trainable)": cfg.model_name}
    dry_run_report(cfg, n_examples=n, models=models, extra=extra, prompt_group=group)


# ------------------------------------------------------------------------------------------ main

def main(name: str, argv=None) -> None:
    """`python launch/<name>.py *argv` for the registered trainer `name`."""
    entry = TRAINERS[name]
    shape, cls = SHAPES[entry.shape], resolve(entry.trainer)
    # 1. parse: recipe + overrides; model names, deepspeed file, resume path, output_dir before any model
    cfg = parse_recipe(resolve(entry.config), argv, f"launch/{name}.py", entry.doc, require_data=entry.require_data)
    problem = unread_data_key(entry, cfg.data)  # a data key this trainer does not read would have no effect
    if problem:
        fail(problem)
    try:
        if cfg.dry_run:  # the data only when it is here: a plan needs the model's config
            return dry_run(entry, cls, cfg, shape)
        # 2. setup: the data is validated before any model is built, so a bad file fails in seconds
        data = shape.load(entry, cls, cfg)
        if entry.shape == "online" and data:  # fewer prompt rows than a step draws: said before the model loads
            group = getattr(cfg, entry.prompt_group) if isinstance(entry.prompt_group, str) else entry.prompt_group
            world = int(os.environ.get("WORLD_SIZE", "1")) - getattr(cfg, "rollout_processes", 0)
            problem = prompts_step_problem(cfg, len(data), max(world, 1), group or 1)
            if problem:
                fail(problem)
        check_output_dir(cfg)
        run = shape.build(entry, cls, cfg, data)
    except SETUP_ERRORS as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    history = run_training(run.trainer, run.train, *run.args, **(run.kwargs or {}))
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    trainer = run.trainer
    with final_save(cfg.output_dir):  # a full disk, a failed upload: one line, exit 1
        out = shape.save(trainer, cfg)
        if trainer.accelerator.is_main_process:
            write_model_card(out, cfg, shape.card_history(trainer, history), name)
            if cfg.push_to_hub:  # the model, its card and the run's files (rl.models.hub)
                url = (getattr(trainer, "hub", None) or HubPusher(cfg)).final(out)
                print(f"pushed {out} to {url}")
    line = entry.summary(history, run.plan, trainer) if trainer.accelerator.is_main_process else None
    if line is not None:
        print(f"{name} done: {line}; model saved to {out}")


def script(name: str):
    """`main` of launch/<name>.py, taking argv (for tests and drivers that run a trainer in this process)."""
    return lambda argv=None: main(name, argv)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in TRAINERS:
        print(f"usage: python -m rl.scripts.train {{{','.join(TRAINERS)}}} [--config RECIPE] [key=value ...]",
              file=sys.stderr)
        raise SystemExit(2)
    run_as_program(main, sys.argv[1], sys.argv[2:])
