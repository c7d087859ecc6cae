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
from types import SimpleNamespace

from rl.engine import segments
from rl.engine.dist import zero_stage
from rl.engine.state import PER_PROCESS
from rl.errors import ConfigError
from rl.rollout.async_workers import (
    finish,
    prune,
    recv_object,
    recv_weights,
    send_object,
    send_weights,
    split_world,
)
from rl.rollout.staleness import StalenessBuffer, Tagged, last_needed_version, sample_version, staleness_metrics


class AsyncRollouts:
    """Mixed into GRPOTrainer: the buffered generation batches, their checkpoint part, and the step's batch."""

    _buffer: StalenessBuffer | None = None
    _start_version = 0  # the first version this process's run has weights of (0, or the resumed step)
    _channel = None  # TrainerChannel (below) on a training process with rollout_processes
    _role = None  # rl.rollout.async_workers.Role with rollout_processes

    def async_setup(self, cfg) -> None:
        """Before the accelerator: this process's side of the launch (rollout_processes)."""
        self._role = split_world(cfg.rollout_processes)

    def async_built(self) -> None:
        """After the accelerator and the policy: the training side's channel, or the rollout side's marks."""
        if self._role is None:
            return
        if not self._role.rollout:
            if zero_stage(self.accelerator) == 3:
                raise ConfigError("rollout_processes does not support ZeRO-3 yet (a rollout process holds whole "
                                  "weights): use DDP or ZeRO-2, or rollout_processes=0")
            self._channel = TrainerChannel(self._role, self.cfg)
        else:  # a 1-process world of its own: not the run's main process (no files, no final line)
            self.accelerator = _RolloutSide(self.accelerator)

    @property
    def is_rollout_process(self) -> bool:
        return self._role is not None and self._role.rollout

    def async_train(self, fit):
        """`fit()` on a training process, the rollout loop on a rollout process."""
        if self.is_rollout_process:
            return rollout_loop(self)
        history = fit()
        if self._channel is not None:
            self._channel.close()
        return history

    def save(self, out_dir=None):
        if self.is_rollout_process:  # the training processes write the model
            return out_dir or self.cfg.output_dir
        return super().save(out_dir)

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
            if not self._channel.started:
                self._channel.start(self.pipeline, self._plan["total_steps"])
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
        # in-process the trainer samples rather than waits (that time is step_time - time/training)
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


# ------------------------------------------------------------------ rollout processes

class _RolloutSide:
    """A rollout process's accelerator: its own, except that it is never the run's main process."""

    is_main_process = False
    is_local_main_process = False

    def __init__(self, acc):
        self._acc = acc

    def __getattr__(self, name):
        return getattr(self._acc, name)


class TrainerChannel:
    """A training process's end of the channel (rl.rollout.async_workers): its share of each step's batches
    from the rollout processes; training process 0 also sends the header and every policy version."""

    def __init__(self, role, cfg):
        self.role, self.k, self.pending, self.started = role, cfg.max_staleness, [], False
        self.first = self.total = 0

    def _steps_of(self, w: int) -> list[int]:
        r = self.role
        return [t for t in range(self.first, self.total) for i in range(r.trainers) if r.producer(t, i) == w]

    def start(self, pipe, total: int) -> None:
        """At the first step (after a resume): the rollout position and the weights the run starts from."""
        self.first, self.total, self.started = pipe.step, total, True
        if self.role.index == 0:
            for w in range(self.role.rollouts):
                send_object(self.role, {"start": pipe.step, "total": total}, self.role.rank_of_rollout(w), self.pending)
            self._send(pipe)

    def _send(self, pipe) -> None:
        for w in range(self.role.rollouts):
            # a version no batch of w's is sampled by would never be received: not sent
            if pipe.step <= last_needed_version(self._steps_of(w), self.k, self.first):
                send_weights(self.role, pipe.unwrapped_model, pipe.step, self.role.rank_of_rollout(w), self.pending)
        prune(self.pending)

    def send_weights(self, pipe) -> None:
        if self.role.index == 0 and pipe.step < self.total:
            self._send(pipe)

    def receive_into(self, buf, step: int, tag) -> None:
        w = self.role.producer(step, self.role.index)
        gb = recv_object(self.role, self.role.rank_of_rollout(w),
                         f"rollout process {w} (rank {self.role.rank_of_rollout(w)}) stopped answering")
        buf.put(tag(step, gb.pop("version"), gb))

    def localize(self, gb: dict, trainer) -> dict:
        """A received batch on this process's device; with several training processes the token count of
        token_mean and the scalar metrics over all of them (the rollout process saw one share)."""
        dev = trainer.accelerator.device
        gb = {**gb, "batch": {k: v.to(dev) for k, v in gb["batch"].items()}, "world": trainer.world}
        if trainer.world > 1:
            n = trainer.accelerator.reduce(gb["batch"]["labels"][:, 1:].ne(-100).sum().float(), "sum")
            gb["num_items"] = float(n.clamp(min=1)) / (trainer.world * trainer.cfg.gradient_accumulation_steps)
            gb["metrics"] = trainer.reduce(gb["metrics"])
        return gb

    def close(self) -> None:
        finish(self.pending, "a rollout process did not take its last weights")


def rollout_loop(trainer) -> list[dict]:
    """A rollout process's whole run: for its items (step t, trainer share i) in order, the weights of version
    max(start, t - k) (received in order), then the generation batch, sent to training process i. The batch
    of (t, i) is sampled as generation t * M + i of a 1-process run, i.e. the prompts of share i of step t
    (rl.rollout.prompts.prompt_order counts rows by position)."""
    role, cfg = trainer._role, trainer.cfg
    header = recv_object(role, 0, "the training processes stopped answering the rollout process")
    start, total, k, M = header["start"], header["total"], cfg.max_staleness, role.trainers
    model = trainer._model.to(trainer.accelerator.device)
    trainer.pipeline = SimpleNamespace(model=model, unwrapped_model=model, accelerator=trainer.accelerator, step=start)
    trainer._plan = trainer.plan()
    trainer.reference.place(trainer.accelerator)
    trainer._share = cfg.share_prompt_forward and segments.prefix_sharing(model)
    version, pending = None, []
    for t in range(start, total):
        for i in range(M):
            if role.producer(t, i) != role.index:
                continue
            t0 = time.time()
            while version is None or version < sample_version(t, k, start):
                version = recv_weights(role, model)
            waited = time.time() - t0
            trainer.pipeline.step = version
            gb = trainer._generation_batch(t * M + i)
            gb.update(version=version, t_wait=waited)
            send_object(role, gb, i, pending)
            prune(pending)
    finish(pending, "the training processes stopped taking batches")
    return []
