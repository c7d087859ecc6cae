"""Batch arithmetic of the epoch-based trainers (SFT, reward model, DPO), computed once from the config, and the
logging/evaluation/checkpoint cadence of every trainer (`cadence`: TRL's *_strategy and *_steps keys). `epoch_plan`
gives the global batch (per_device_train_batch_size x gradient_accumulation_steps x processes), the steps
per epoch (ceil(n / global batch): an incomplete last batch is a smaller last step, as a data loader
without drop_last) and the total optimizer steps (`max_steps` wins over `num_train_epochs`), with the one
warning line to print when the data does not fill the global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rl.errors import ConfigError


def prompts_step_problem(cfg, n_prompts: int, world: int, num_generations: int = 1) -> str | None:
    """The one-line refusal of a trainer whose every step draws distinct prompts (GRPO, online DPO,
    distillation) when the data holds fewer than one step's (per_device_train_batch_size x gradient_accumulation_steps x
    world / num_generations: GRPO's batch counts completions); None when they suffice. The launch and its
    --dry-run (rl.scripts.dryrun) print this same line."""
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // num_generations * world
    if n_prompts >= per_step:
        return None
    groups = f" / num_generations {num_generations}" if num_generations != 1 else ""
    return (f"{n_prompts} training prompts are fewer than one step's {per_step} (per_device_train_batch_size {cfg.per_device_train_batch_size} x "
            f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} x {world} processes{groups}); add "
            f"prompts or lower per_device_train_batch_size")


def epoch_plan(cfg, n_examples: int, world: int, what: str = "examples") -> dict:
    """Derived sizes of an epoch-based trainer, computed once: global batch, steps per epoch and
    total optimizer steps (`max_steps` wins over `num_train_epochs`).

    As a data loader without drop_last: an incomplete last global batch (or an only one, when the data
    is smaller than a global batch) is a smaller last step, steps_per_epoch = ceil(n / global_batch).
    The trainers weight it so that its loss is still the mean over the examples it holds, and every
    process still runs gradient_accumulation_steps micro-batches in it (ZeRO-3). `warning` is the one
    line to print about it, or None."""
    if n_examples < 1:
        raise ConfigError(f"no training {what}")
    global_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world
    steps_per_epoch = math.ceil(n_examples / global_batch)
    last = n_examples - (steps_per_epoch - 1) * global_batch
    warning = None
    if last < global_batch:
        warning = (f"warning: {n_examples} training {what} do not fill the global batch of {global_batch} "
                   f"(per_device_train_batch_size {cfg.per_device_train_batch_size} x gradient_accumulation_steps {cfg.gradient_accumulation_steps} "
                   f"x {world} processes): the last step of each epoch trains on {last}")
    total = cfg.max_steps or steps_per_epoch * cfg.num_train_epochs
    return {"global_batch": global_batch, "steps_per_epoch": steps_per_epoch, "total_steps": total,
            "last_batch": last, "warning": warning}


@dataclass(frozen=True)
class Cadence:
    """When the lifecycle (rl.trainers.base.Trainer.fit) logs, evaluates and checkpoints, in optimizer steps."""
    logging: int  # log every N steps (0: only evaluations; the last step when logging is on)
    first: bool  # log step 1 too (logging_first_step)
    evaluate: bool  # any evaluation at all (eval_strategy != no)
    eval: int  # evaluate every N steps (0: at the end only)
    save: int  # checkpoint every N steps (0: none but on a stop signal; the final model is saved anyway)
    eval_start: bool  # evaluate before the first step (eval_on_start)
    eval_delay: int = 0  # no evaluation before this step but the final one (eval_delay)

    def log_at(self, step: int, total: int) -> bool:
        return bool(self.logging and (step % self.logging == 0 or step == total)) or (self.first and step == 1)

    def eval_at(self, step: int, total: int) -> bool:
        return self.evaluate and (step == total or bool(self.eval and step % self.eval == 0 and step >= self.eval_delay))

    def save_at(self, step: int) -> bool:
        return bool(self.save and step % self.save == 0)


def _steps(value, total: int) -> int:
    """A cadence key as optimizer steps: a count, or below 1 a fraction of the run (ceil, as transformers)."""
    if not value:
        return 0
    return math.ceil(value * total) if value < 1 else int(value)


def cadence(cfg, total_steps: int, steps_per_epoch: int | None = None) -> Cadence:
    """The run's cadence from TRL's keys: logging/eval/save_strategy ('no', 'steps', 'epoch'; null: as the *_steps
    key says) and logging/eval/save_steps (a count, or below 1 a fraction of the run). An epoch is
    `steps_per_epoch` optimizer steps (the epoch trainers know it; else total_steps / num_train_epochs)."""
    per_epoch = steps_per_epoch or max(1, math.ceil(total_steps / max(1, getattr(cfg, "num_train_epochs", 1))))
    logging = {"no": 0, "epoch": per_epoch}.get(getattr(cfg, "logging_strategy", "steps"),
                                                _steps(cfg.logging_steps, total_steps))
    evaluation = getattr(cfg, "eval_strategy", None)
    eval_every = _steps(getattr(cfg, "eval_steps", 0), total_steps)
    if evaluation == "steps":
        eval_every = eval_every or logging  # transformers: eval_steps unset is logging_steps
    elif evaluation == "epoch":
        eval_every = per_epoch
    saving = getattr(cfg, "save_strategy", None)
    save_every = {"no": 0, "epoch": per_epoch}.get(saving, _steps(getattr(cfg, "save_steps", 0), total_steps))
    delay = getattr(cfg, "eval_delay", 0) or 0
    return Cadence(logging=logging, first=bool(getattr(cfg, "logging_first_step", False)), evaluate=evaluation != "no",
                   eval=eval_every, save=save_every, eval_start=bool(getattr(cfg, "eval_on_start", False)),
                   eval_delay=math.ceil(delay * per_epoch) if evaluation == "epoch" else math.ceil(delay))
