"""Bounded staleness for asynchronous rollouts (issue 41): generation batches tagged with the policy version
they were sampled with, admitted for training only while they are at most k versions old.

The version of the policy is the number of optimizer steps it has taken (the trainer's `pipeline.step`).
The batch of step t is sampled by the policy of version `sample_version(t, k, start)` = max(start, t - k):
the producer runs k steps ahead of the trainer and never further, so the batch of step t can be sampled
while steps t - k .. t - 1 train. That one schedule is used in both places rollouts run (in the trainer's
own process or on a vLLM server, rl.rollout.ahead, and in rollout processes, rl.rollout.channel), which is why
they give the same samples.
k = 0 is the synchronous loop (each batch sampled by the policy that trains on it).

A batch older than k versions when its step comes (`admit`) is dropped and counted, never trained on: with
the schedule above that happens only on a resume with a smaller k than the checkpoint was written with, or
when a producer falls behind its schedule. Pure code: no torch.distributed, no model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def sample_version(step: int, k: int, start: int = 0) -> int:
    """The policy version that samples the batch of `step`: k versions behind it, never before `start` (the
    version a run began or resumed at: the weights that exist)."""
    return max(start, step - k)


def admit(version: int, version_now: int, k: int) -> bool:
    """A batch sampled by policy `version` may train the policy of `version_now` when it is at most k older."""
    return version_now - version <= k


@dataclass
class Tagged:
    """A generation batch with the step it is for and the policy version that sampled it."""

    step: int
    version: int
    batch: dict
    samples: int  # completions in it (what dropping it costs)


@dataclass
class StalenessBuffer:
    """The batches sampled ahead, oldest first, with the drop count of the run.

    `put` appends a batch; `take(step, version_now)` removes every batch for an earlier step (skipped) and
    every batch too old to admit (dropped and counted), and returns the one for `step` or None (the caller
    samples it afresh, by the current policy)."""

    k: int
    items: deque = field(default_factory=deque)
    dropped_batches: int = 0
    dropped_samples: int = 0

    def put(self, item: Tagged) -> None:
        self.items.append(item)

    def next_step(self, default: int) -> int:
        """The first step no batch was sampled for yet: the rollout position."""
        return self.items[-1].step + 1 if self.items else default

    def take(self, step: int, version_now: int) -> Tagged | None:
        found = None
        while self.items and self.items[0].step <= step:
            item = self.items.popleft()
            if item.step == step and admit(item.version, version_now, self.k):
                found = item
            elif item.step == step:
                self._drop(item)
        # a batch further ahead may already be too old for its own step (a smaller k after a resume)
        while self.items and not admit(self.items[0].version, self.items[0].step, self.k):
            self._drop(self.items.popleft())
        return found

    def _drop(self, item: Tagged) -> None:
        self.dropped_batches += 1
        self.dropped_samples += item.samples

    def state(self) -> dict:
        """What a checkpoint holds (the batches themselves go per process)."""
        return {"dropped_batches": self.dropped_batches, "dropped_samples": self.dropped_samples}

    def load(self, state: dict, items: list[Tagged]) -> None:
        self.dropped_batches = state.get("dropped_batches", 0)
        self.dropped_samples = state.get("dropped_samples", 0)
        self.items = deque(sorted(items, key=lambda i: i.step))


def staleness_metrics(item: Tagged, version_now: int, k: int, buffer: StalenessBuffer) -> dict:
    """A step's async/* metrics: the trained batch's staleness, its histogram over 0..k (samples at each
    staleness this step), the policy version that sampled it, and the run's dropped samples so far."""
    s = version_now - item.version
    row = {"async/staleness": s, "async/policy_version": item.version,
           "async/dropped_samples": buffer.dropped_samples, "async/dropped_batches": buffer.dropped_batches}
    for j in range(k + 1):
        row[f"async/staleness/{j}"] = item.samples if j == s else 0
    return row


def last_needed_version(steps: list[int], k: int, start: int) -> int:
    """The newest policy version a producer of the batches of `steps` needs: the trainer sends it no
    version after that (a send nobody receives would never complete)."""
    return max((sample_version(t, k, start) for t in steps), default=start)
