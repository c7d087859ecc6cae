"""Sampling ahead of the trainer in the training processes themselves (`max_staleness=k`, rollout_processes=0):
the producers that fill the staleness buffer (`rl.rollout.staleness`) on the schedule there, the batch of step t
sampled by the policy of version max(start, t - k). Rollout processes have their own channel
(`rl.rollout.channel`).

* `InProcess`: our sampler (or a colocated vLLM engine) samples, at step t and before it trains, every batch up
  to t + k whose version has come. Deterministic and resume-exact; on one device nothing overlaps.
* `ServerAhead`: a vLLM server samples while this process trains. At step t (the weights of version t just
  made): the server's last request is collected (the batches sampled while step t - 1 trained, scored here),
  the weights of version t are pushed to the server, and the request for the batches that version samples
  (step t + k) goes out on a worker thread; step t then trains while the server generates. One request is
  on its way at a time, since the server holds one version. Only the main process talks to the server (one
  request for every process's prompts); each process gets its own share through `share` (a broadcast).

Both are handed callables, never a trainer: `sample(index, version[, rollout])` makes a generation batch
(sampled now, or scored from the rollout sampled elsewhere), `tag(step, version, batch)` wraps it for the
buffer; the server producer also `request(index)` (the prompts of every process and the sampler's keywords),
`fetch(request)` (the server's rollouts, one per process: worker thread, main process only), `sync(version)`
(push the weights: every process, a collective under ZeRO-3) and `share(result)`: the main process's
(rollouts per step per process, seconds) to every process as (its rollout per step, seconds).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from rl.rollout.staleness import StalenessBuffer, sample_version


class InProcess:
    """Sample every batch up to step + k whose sampling version has come (the current one), in order."""

    def __init__(self, k: int, sample: Callable[[int, int], dict], tag: Callable):
        self.k, self.sample, self.tag = k, sample, tag
        self.waited = 0.0  # nothing to wait for: the trainer samples (that time is step_time - time/training)

    def fill(self, buf: StalenessBuffer, step: int, version: int, start: int, end: int) -> None:
        """Before step `step` trains (with the weights of `version`); `end`: the run's last step + 1."""
        nxt = buf.next_step(step)
        while nxt < min(step + self.k + 1, end) and sample_version(nxt, self.k, start) <= version:
            buf.put(self.tag(nxt, version, self.sample(nxt, version)))
            nxt += 1

    def drain(self, buf: StalenessBuffer) -> None:
        """Nothing is on its way: every batch sampled ahead is in the buffer."""


class ServerAhead:
    """The batches of steps t + 1 .. t + k sampled by a vLLM server while this process trains step t
    (module docstring)."""

    def __init__(self, k: int, *, sample: Callable, tag: Callable, request: Callable, fetch: Callable,
                 sync: Callable[[int], None], share: Callable, main: bool):
        self.k, self.sample, self.tag, self.request, self.fetch = k, sample, tag, request, fetch
        self.sync, self.share, self.main = sync, share, main
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rl-server-ahead") if main else None
        self.flight: tuple[list[int], int, Future | None] | None = None  # (steps, version, main's future)
        self.waited = self.synced = 0.0  # this step's seconds waiting for the server / pushing weights

    def _timed_fetch(self, requests: list) -> tuple[list, float]:
        t0 = time.time()
        out = [self.fetch(r) for r in requests]
        return out, time.time() - t0

    def _submit(self, steps: list[int], version: int) -> None:
        # the requests are made here, not on the worker: the tokenizer is this thread's
        fut = self.pool.submit(self._timed_fetch, [self.request(i) for i in steps]) if self.main else None
        self.flight = (steps, version, fut)

    def _collect(self, buf: StalenessBuffer) -> None:
        """Wait for the request on its way; score its batches into the buffer (every process its share)."""
        steps, version, fut = self.flight
        self.flight = None
        t0 = time.time()
        rollouts, seconds = self.share(fut.result() if self.main else None)
        self.waited += time.time() - t0
        for step, per_process in zip(steps, rollouts):
            gb = self.sample(step, version, per_process)
            gb["t_gen"] = seconds / len(steps)  # the server's time, not the scoring's
            buf.put(self.tag(step, version, gb))

    def fill(self, buf: StalenessBuffer, step: int, version: int, start: int, end: int) -> None:
        self.waited = self.synced = 0.0
        if self.flight is not None:
            self._collect(buf)  # sampled by the previous version while the previous step trained
        todo = [t for t in range(buf.next_step(step), min(step + self.k + 1, end))
                if sample_version(t, self.k, start) <= version]
        if not todo:  # the run's last steps: nothing more to sample, no weights to push
            return
        t0 = time.time()
        self.sync(version)
        self.synced = time.time() - t0
        if todo[0] == step:  # needed now (the first step, a resume, a dropped batch): wait for it alone
            self._submit([step], version)
            self._collect(buf)
            todo = todo[1:]
        if todo:
            self._submit(todo, version)

    def drain(self, buf: StalenessBuffer) -> None:
        """Before a checkpoint: the batches on their way into the buffer (so the checkpoint holds them)."""
        if self.flight is not None:
            self._collect(buf)

    def close(self, wait: bool = True) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=True)
