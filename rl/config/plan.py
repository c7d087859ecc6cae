"""Batch arithmetic of the epoch-based trainers (SFT, reward model, DPO), computed once from the config:
`epoch_plan` gives the global batch (per_device_train_batch_size x gradient_accumulation_steps x processes), the steps
per epoch (ceil(n / global batch): an incomplete last batch is a smaller last step, as a data loader
without drop_last) and the total optimizer steps (`max_steps` wins over `num_train_epochs`), with the one
warning line to print when the data does not fill the global batch.
"""

from __future__ import annotations

import math

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
