"""Rollout processes (`rollout_processes=N`): the last N processes of one `accelerate launch` only sample, the
others train. Both ends of the channel are here: what a training process sends and receives (`TrainerEnd`)
and the rollout process's whole program (`serve_rollouts`). torch.distributed (gloo, point to point) carries
weights one way and generation batches the other; no orchestration layer: the launch's own processes and its
rendezvous store.

What the trainer hands over: a `sample(index, version) -> batch` callable (the generation batch of `index`,
sampled by the weights of `version`, already loaded into the model the rollout process samples with) and that
model. Nothing else of the trainer crosses into this module.

How the world is split (`split_world`, before the Accelerator exists): every process joins one gloo group of
the whole launch on a prefix of the launcher's store (the channel); then each process's environment is
rewritten so that accelerate sees only its side: the M = world - N training processes form an ordinary
M-process run among themselves (DDP or ZeRO-2 all-reduce only among them, unchanged code), and each
rollout process is a 1-process world that never builds an optimizer.

The schedule (`rl.rollout.staleness`): the batch of step t is sampled by the policy of version max(start, t - k).
Rollout process w samples the items (t, i) whose `Role.producer(t, i)` is w (round robin), in order; item
(t, i) is share i of step t: generation index t * M + i of a 1-process run, i.e. the prompt rows of training
process i at step t. Training process 0 sends every version some rollout process needs, after its optimizer step.

Messages (tags): the trainer's header (start step, total steps); per policy version a header object (the
version and each bucket's layout: tensor names, dtypes, shapes, offsets) and then each bucket's bytes
(`rl.engine.weight_sync.pack_buckets`: every tensor in its own dtype, bf16 stays bf16; LoRA: only the adapters;
`BUCKET_BYTES` at most, a larger tensor alone); per generation batch its size
and its bytes (torch.save, read back with weights_only=True). Every send is asynchronous and kept alive until
it completes; every wait is bounded (RL_DIST_TIMEOUT, default 600 s), and a peer that died ends the waiting side
with one RunError line.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rl.engine.dist import dist_timeout
from rl.engine.weight_sync import Bucket, pack_buckets, unpack_bucket
from rl.errors import ConfigError, RunError, first_line
from rl.rollout.staleness import last_needed_version, sample_version

HEADER, SIZE, PAYLOAD, WEIGHTS = 1, 2, 3, 4
BUCKET_BYTES = 256 << 20  # one message per this many bytes of weights (what a send holds at once)
SILENT_TRAINER = "the training processes stopped answering the rollout process"


@dataclass
class Role:
    """This process's side: `index` among the trainers (0..M-1) or among the rollout processes (0..N-1)."""

    rollout: bool
    index: int
    trainers: int
    rollouts: int
    group: object  # the channel: a gloo group of the whole launch (global ranks)

    def rank_of_rollout(self, w: int) -> int:
        return self.trainers + w

    def producer(self, step: int, share: int) -> int:
        """The rollout process that samples `share` (a trainer's index) of `step`: round robin over items."""
        return (step * self.trainers + share) % self.rollouts


def _timeout() -> datetime.timedelta:
    return dist_timeout() or datetime.timedelta(seconds=600)


def split_world(n: int) -> Role | None:
    """Join the channel and rewrite this process's launcher environment to its side (module docstring)."""
    if not n:
        return None
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world <= n:
        raise ConfigError(f"rollout_processes={n} needs a launch of more processes than that (got {world}): "
                          f"accelerate launch --num_processes {n + 1} ..., or rollout_processes=0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        raise ConfigError("rollout_processes needs the processes of accelerate launch (or torchrun): its store "
                          "carries the rollout channel")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=_timeout())
    group = dist.ProcessGroupGloo(dist.PrefixStore("rl-rollout-channel/", store), rank, world, _timeout())
    trainers = world - n
    role = Role(rollout=rank >= trainers, index=rank - trainers if rank >= trainers else rank, trainers=trainers,
                rollouts=n, group=group)
    single_node = os.environ.get("LOCAL_WORLD_SIZE", str(world)) == str(world)
    if role.rollout:
        local = os.environ.get("LOCAL_RANK", "0")
        if torch.cuda.is_available() and "CUDA_VISIBLE_DEVICES" not in os.environ:
            os.environ["CUDA_VISIBLE_DEVICES"] = local  # its own device, seen as device 0 of a 1-process world
        # A 1-process world needs a store of its own: on the launcher's store its rank 0 would race the training
        # processes' rank 0 for the same rendezvous keys, and training process 1 could connect to this process
        # (seen once in CI: training process 0 waited 300 s at its first barrier with 2 training processes).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          ACCELERATE_USE_DEEPSPEED="false", TORCHELASTIC_USE_AGENT_STORE="false",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    else:
        os.environ["WORLD_SIZE"] = str(trainers)
        if single_node:
            os.environ["LOCAL_WORLD_SIZE"] = str(trainers)
    return role


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(work, what: str) -> None:
    try:
        work.wait(_timeout())
    except RuntimeError as e:
        raise RunError(f"{what} ({first_line(e)}); the run stops here, its last checkpoint is kept") from None


# ------------------------------------------------------------------------------ the wire

def send_object(role: Role, obj, dst: int, pending: list, tag: int = PAYLOAD) -> None:
    """`obj` (tensors and plain containers) to global rank `dst`, asynchronously: size then bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    pending += [(role.group.send([size], dst, SIZE), size), (role.group.send([data], dst, tag), data)]


def recv_object(role: Role, src: int, what: str, tag: int = PAYLOAD):
    size = torch.zeros(1, dtype=torch.long)
    _wait(role.group.recv([size], src, SIZE), what)
    data = torch.empty(int(size), dtype=torch.uint8)
    _wait(role.group.recv([data], src, tag), what)
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)  # tensors and plain containers only


def trainable(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, parameter) of what a training step changes, in one fixed order on both sides."""
    return ((n, p.detach()) for n, p in model.named_parameters() if p.requires_grad)


def send_weights(role: Role, model, version: int, dst: int, pending: list) -> None:
    """The trainable parameters of `model` (policy `version`) to rollout process rank `dst`: a header (the
    version, each bucket's layout) then each bucket's bytes (`rl.engine.weight_sync.pack_buckets`: every tensor
    in its dtype, bit for bit)."""
    parts = [(b.header(), b.buffer.cpu()) for b in pack_buckets(trainable(model), BUCKET_BYTES)]
    send_object(role, {"version": version, "buckets": [(h, buf.numel()) for h, buf in parts]}, dst, pending,
                tag=HEADER)
    for _, buf in parts:
        pending.append((role.group.send([buf], dst, WEIGHTS), buf))


def recv_weights(role: Role, model) -> int:
    """The next policy version from training process 0, copied into `model`'s trainable parameters."""
    params = dict(trainable(model))
    meta = recv_object(role, 0, SILENT_TRAINER, tag=HEADER)
    for header, nbytes in meta["buckets"]:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        _wait(role.group.recv([buf], 0, WEIGHTS), SILENT_TRAINER)
        with torch.no_grad():
            for name, t in unpack_bucket(Bucket.from_header(header, buf)):
                params[name].copy_(t)
    return int(meta["version"])


def finish(pending: list, what: str) -> None:
    """Wait (bounded) for this process's sends to be received."""
    for work, _ in pending:
        _wait(work, what)
    pending.clear()


def prune(pending: list) -> None:
    """Forget the sends already received (their buffers may go)."""
    pending[:] = [(w, t) for w, t in pending if not w.is_completed()]


# ------------------------------------------------------------------------------ the two ends

class TrainerEnd:
    """A training process's end: its share of each step's batches from the rollout processes; training
    process 0 also sends the header and every policy version a rollout process needs."""

    def __init__(self, role: Role, k: int):
        self.role, self.k, self.pending, self.started = role, k, [], False
        self.first = self.total = 0

    def _steps_of(self, w: int) -> list[int]:
        r = self.role
        return [t for t in range(self.first, self.total) for i in range(r.trainers) if r.producer(t, i) == w]

    def start(self, step: int, total: int, model) -> None:
        """At the first step (after a resume): the rollout position and the weights the run starts from."""
        self.first, self.total, self.started = step, total, True
        if self.role.index == 0:
            for w in range(self.role.rollouts):
                send_object(self.role, {"start": step, "total": total}, self.role.rank_of_rollout(w), self.pending)
            self._send(model, step)

    def _send(self, model, version: int) -> None:
        for w in range(self.role.rollouts):
            # a version no batch of w's is sampled by would never be received: not sent
            if version <= last_needed_version(self._steps_of(w), self.k, self.first):
                send_weights(self.role, model, version, self.role.rank_of_rollout(w), self.pending)
        prune(self.pending)

    def after_step(self, model, version: int) -> None:
        """After an optimizer step: the weights of `version` to the rollout processes that need them."""
        if self.role.index == 0 and version < self.total:
            self._send(model, version)

    def receive(self, step: int) -> tuple[int, dict]:
        """(the policy version that sampled it, this process's generation batch of `step`)."""
        w = self.role.producer(step, self.role.index)
        gb = recv_object(self.role, self.role.rank_of_rollout(w),
                         f"rollout process {w} (rank {self.role.rank_of_rollout(w)}) stopped answering")
        return gb.pop("version"), gb

    def close(self) -> None:
        finish(self.pending, "a rollout process did not take its last weights")


def serve_rollouts(role: Role, model, sample: Callable[[int, int], dict], k: int) -> None:
    """A rollout process's whole run: for its items (step t, trainer share i) in order, the weights of version
    max(start, t - k) (received in order, loaded into `model`), then `sample(t * M + i, version)`, sent to
    training process i with its version and the time this process waited for the weights."""
    header = recv_object(role, 0, SILENT_TRAINER)
    start, total, M = header["start"], header["total"], role.trainers
    version, pending = None, []
    for t in range(start, total):
        for i in range(M):
            if role.producer(t, i) != role.index:
                continue
            t0 = time.time()
            while version is None or version < sample_version(t, k, start):
                version = recv_weights(role, model)
            waited = time.time() - t0
            gb = sample(t * M + i, version)
            gb.update(version=version, t_wait=waited)
            send_object(role, gb, i, pending)
            prune(pending)
    finish(pending, "the training processes stopped taking batches")
