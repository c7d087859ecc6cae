"""The offline trainers' layer (SFT, DPO, reward models): a fixed dataset, a seeded shuffle per epoch,
one global batch per optimizer step; the data position is what a checkpoint holds beside the engine's."""

from __future__ import annotations

import torch

from rl.trainers.base import Trainer


class EpochTrainer(Trainer):
    """The offline trainers' layer (SFT, DPO): a fixed dataset, a seeded shuffle per epoch, one global
    batch per optimizer step; the data position is what a checkpoint holds beside the engine's state.
    Subclasses set `self._plan` (with `global_batch` and `steps_per_epoch`) and define `evaluate(data)`."""

    def start_epochs(self, n_train: int, eval_data=None) -> None:
        self._n_train, self._eval = n_train, eval_data
        self._epoch, self._batch_index, self._order = 0, 0, None

    def next_global_batch(self) -> list[int]:
        """Indices (into the training data) of this step's global batch, all processes together."""
        plan = self._plan
        if self._batch_index == plan["steps_per_epoch"]:
            self._epoch, self._batch_index, self._order = self._epoch + 1, 0, None
        if self._order is None:
            self._order = torch.randperm(self._n_train,
                                         generator=torch.Generator().manual_seed(self.cfg.seed + self._epoch))
        g = plan["global_batch"]
        ids = self._order[self._batch_index * g:(self._batch_index + 1) * g].tolist()
        self._batch_index += 1
        return ids

    @property
    def epoch_progress(self) -> float:
        return self._epoch + self._batch_index / self._plan["steps_per_epoch"]

    def checkpoint_extra(self) -> dict:
        return {"epoch": self._epoch, "batch_index": self._batch_index}

    def restore(self, extra: dict) -> None:
        self._epoch, self._batch_index, self._order = extra["epoch"], extra["batch_index"], None

    def evaluate_now(self) -> dict | None:
        return self.evaluate(self._eval) if self._eval is not None and len(self._eval) else None
