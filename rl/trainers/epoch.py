"""The offline trainers' layer (SFT, DPO, reward models): a fixed dataset, a seeded shuffle per epoch,
one global batch per optimizer step; the data position is what a checkpoint holds beside the engine's.

A short last step (`rl.config.plan.epoch_plan`: the data does not fill the last global batch) is a
smaller step, never padded with repeated examples. Its rule, shared by the offline trainers:
`micro_batches` gives each process every world-th example of the step in gradient_accumulation_steps
nearly equal micro-batches; a micro-batch left with none still runs one forward/backward on a dummy
that weighs 0 (ZeRO-3 needs every rank in every forward); and a per-example loss summed with the weight
`step_weight(n)` (= world * accumulation / n) is, after the engine's 1/accumulation and DDP's 1/world,
exactly the mean over the step's n examples (SFT normalises by the step's tokens instead)."""

from __future__ import annotations

import torch

from rl.engine.dist import zero_stage
from rl.trainers.base import Trainer


class EpochTrainer(Trainer):
    """The offline trainers' layer (SFT, DPO, reward models): a fixed dataset, a seeded shuffle per
    epoch, one global batch per optimizer step; the data position is what a checkpoint holds beside the
    engine's state. Subclasses set `self._plan` (with `global_batch` and `steps_per_epoch`) and define
    `evaluate(data)` (or their own `evaluate_now`)."""

    def announce(self, tracker, what: str, details: str = "") -> None:
        """The run's first line, one shape for the offline trainers: what and how much, then where (processes,
        ZeRO stage), the trainer's own details and the trainable parameters; then the plan's warning, if any."""
        details = f"{details}, " if details else ""
        tracker.write(f"{what} ({self.processes}, ZeRO stage {zero_stage(self.accelerator)}), {details}trainable "
                      f"{self.trainable:,}/{self.total_params:,} parameters")
        if self._plan["warning"]:
            tracker.write(self._plan["warning"])

    def start_epochs(self, n_train: int, eval_data=None) -> None:
        self._n_train, self._eval = n_train, eval_data
        self._epoch, self._batch_index, self._order = 0, 0, None

    def next_global_batch(self) -> list[int]:
        """Indices (into the training data) of this step's global batch, all processes together."""
        plan = self._plan
        if self._batch_index == plan["steps_per_epoch"]:
            self._epoch, self._batch_index, self._order = self._epoch + 1, 0, None
        if self._order is None:
            self._order = torch.randperm(self._n_train, generator=torch.Generator().manual_seed(
                self.cfg.order_seed + self._epoch)) if getattr(self.cfg, "shuffle", True) else torch.arange(self._n_train)
        g = plan["global_batch"]
        ids = self._order[self._batch_index * g:(self._batch_index + 1) * g].tolist()
        self._batch_index += 1
        return ids

    @property
    def steps_per_epoch(self) -> int | None:
        return self._plan["steps_per_epoch"]

    @property
    def epoch_progress(self) -> float:
        return self._epoch + self._batch_index / self._plan["steps_per_epoch"]

    def checkpoint_extra(self) -> dict:
        return {"epoch": self._epoch, "batch_index": self._batch_index}

    def restore(self, extra: dict) -> None:
        self._epoch, self._batch_index, self._order = extra["epoch"], extra["batch_index"], None

    def micro_batches(self, step_ids: list[int]) -> list[list[int]]:
        """This process's micro-batches of a step's global batch (see the module docstring): batch_size
        examples each in a full step, fewer in a short one, some empty when it has fewer than
        gradient_accumulation_steps."""
        return split_even(step_ids[self.accelerator.process_index::self.world], self.cfg.gradient_accumulation_steps)

    def step_weight(self, n_step: int) -> float:
        """The weight of one example in a step of `n_step` examples: world * accumulation / n_step."""
        return self.world * self.cfg.gradient_accumulation_steps / n_step

    def evaluate_now(self) -> dict | None:
        return self.evaluate(self._eval) if self._eval is not None and len(self._eval) else None


def split_even(items: list, n: int) -> list[list]:
    """n nearly equal consecutive chunks (the last ones empty when len(items) < n)."""
    k, r = divmod(len(items), n)
    chunks, start = [], 0
    for i in range(n):
        end = start + k + (1 if i < r else 0)
        chunks.append(items[start:end])
        start = end
    return chunks
