"""GRPO's asynchronous rollouts (issue 41; `max_staleness`, `rollout_processes`; docs/rollout.md).

The batch of step t is sampled by the policy of version max(start, t - k) (`rl.rollout.staleness`), either
here, in the trainer's process, k steps ahead of the step that trains (`max_staleness=k`,
`rollout_processes=0`: the same samples as a rollout process would give, deterministic, no overlap on
one device), or by a rollout process (`rollout_processes=N`, rl.rollout.async_workers) while this one trains.

The loss: a batch sampled by an older policy (staleness s > 0) has the log-probs its sampler recorded for
its tokens as the old policy, so the clipped ratio pi_theta / pi_behaviour does the off-policy correction
(AReaL's decoupled PPO with the behaviour policy as the proximal one; TRL's async GRPO). A batch of
staleness 0 was sampled by the very weights that train on it: its old policy is the current one, detached
(ratio 1), exactly the synchronous loop, so k = 0 through this path equals the plain loop bit for bit.
"""

from __future__ import annotations

import time

from rl.engine.state import PER_PROCESS
from rl.rollout.staleness import StalenessBuffer, Tagged, sample_version, staleness_metrics


class AsyncRollouts:
    """Mixed into GRPOTrainer: the buffered generation batches, their checkpoint part, and the step's batch."""

    _buffer: StalenessBuffer | None = None
    _start_version = 0  # the first version this process's run has weights of (0, or the resumed step)
    _restored_items: list | None = None
    _channel = None  # rl.rollout.async_workers.TrainerChannel with rollout_processes

    @property
    def buffered(self) -> bool:
        """Whether steps take their batch from the staleness buffer (k > 0, or rollout processes)."""
        return bool(self.cfg.max_staleness or self.cfg.rollout_processes or getattr(self, "_force_buffer", False))

    def _buffer_now(self) -> StalenessBuffer:
        if self._buffer is None:
            self._buffer = StalenessBuffer(self.cfg.max_staleness)
        return self._buffer

    def _tag(self, step: int, version: int, gb: dict) -> Tagged:
        return Tagged(step=step, version=version, batch=gb, samples=int(gb["batch"]["input_ids"].shape[0]) * self.world)

    def _fill_in_process(self, step: int) -> None:
        """Sample every batch up to step + k whose sampling version has come (the current one)."""
        buf, k, version = self._buffer_now(), self.cfg.max_staleness, self.pipeline.step
        nxt = buf.next_step(step)
        while nxt <= step + k and sample_version(nxt, k, self._start_version) <= version:
            buf.put(self._tag(nxt, version, self._generation_batch(nxt)))
            nxt += 1

    def async_generation_batch(self) -> tuple[dict, dict]:
        """This step's generation batch from the buffer (sampled ahead here, or received from a rollout
        process), with the loss's old policy set as the module docstring says, and the step's async/* and
        time/waiting_* metrics."""
        cfg, step = self.cfg, self.pipeline.step
        buf = self._buffer_now()
        t0 = time.time()
        if self._channel is not None:
            self._channel.receive_into(buf, step, self._tag)
        else:
            self._fill_in_process(step)
        waited = time.time() - t0
        item = buf.take(step, step)
        if item is None:  # dropped as too old (or never sampled): the current policy samples it now
            item = self._tag(step, step, self._generation_batch(step))
        gb = item.batch
        batch = dict(gb["batch"])
        batch.pop("behaviour", None)  # the behaviour policy is the old one here, not a second correction
        if item.version != step:
            batch["old"] = batch["old_logprobs"]
        gb = {**gb, "batch": batch}
        if self._channel is not None:
            gb = self._channel.localize(gb, self)
        metrics = staleness_metrics(item, step, cfg.max_staleness, buf)
        # in-process sampling is the wait; a rollout process's own generation time comes with its batch
        metrics["time/waiting_trainer"] = waited if self._channel is not None else 0.0
        if "t_wait" in gb:
            metrics["time/waiting_rollout"] = gb["t_wait"]
        return gb, metrics

    # ------------------------------------------------------------------ checkpoint part
    def async_checkpoint(self, extra: dict) -> dict:
        """The rollout position (the first step no batch was sampled for) and the drop counts; the batches
        sampled ahead go per process, so a resume trains on exactly them (in-process sampling)."""
        if not self.buffered:
            return extra
        buf, step = self._buffer_now(), self.pipeline.step
        extra["async"] = {"next_step": buf.next_step(step), **buf.state()}
        if self._channel is None and buf.items:
            own = extra.setdefault(PER_PROCESS, {})
            own["async_items"] = [vars(i) for i in buf.items]
        return extra

    def async_restore(self, extra: dict) -> None:
        state = extra.get("async")
        self._start_version = self.pipeline.step
        if state is None or not self.buffered:
            return
        items = []
        for it in extra.get(PER_PROCESS, {}).get("async_items", []):
            if it["batch"]["world"] != self.world:
                items = []  # another number of processes splits the batches otherwise: sampled afresh
                break
            dev = self.accelerator.device
            gb = {**it["batch"], "batch": {k: v.to(dev) for k, v in it["batch"]["batch"].items()}}
            items.append(Tagged(**{**it, "batch": gb}))
        # the versions the stored batches were sampled with are older than the resumed weights: kept
        self._start_version = min([self.pipeline.step] + [i.version for i in items])
        self._buffer_now().load(state, items)

