"""Rollout processes (`rollout_processes=N`, issue 41): the last N processes of one `accelerate launch` only
sample, the others train; torch.distributed (gloo, point to point) carries weights one way and generation
batches the other. No orchestration layer: the launch's own processes and its rendezvous store.

How the world is split (`split_world`, before the Accelerator exists): every process joins one gloo group of
the whole launch on a prefix of the launcher's store (the channel); then each process's environment is
rewritten so that accelerate sees only its side: the M = world - N training processes form an ordinary
M-process run among themselves (DDP or ZeRO-2 all-reduce only among them, unchanged code), and each
rollout process is a 1-process world that never builds an optimizer.

Messages (tags): the trainer's header (start step, total steps), the trainable parameters flattened into
one tensor per policy version (LoRA: only the adapters), and per generation batch its size and its bytes
(torch.save). Every send is asynchronous and kept alive until it completes; every wait is bounded
(RL_DIST_TIMEOUT, default 600 s), and a peer that died ends the waiting side with one RunError line.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl.engine.dist import dist_timeout
from rl.errors import ConfigError, RunError, first_line

HEADER, SIZE, PAYLOAD, WEIGHTS = 1, 2, 3, 4


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


def send_object(role: Role, obj, dst: int, pending: list) -> None:
    """`obj` (torch.save-able) to global rank `dst`, asynchronously: size then bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    pending += [(role.group.send([size], dst, SIZE), size), (role.group.send([data], dst, PAYLOAD), data)]


def recv_object(role: Role, src: int, what: str):
    size = torch.zeros(1, dtype=torch.long)
    _wait(role.group.recv([size], src, SIZE), what)
    data = torch.empty(int(size), dtype=torch.uint8)
    _wait(role.group.recv([data], src, PAYLOAD), what)
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)  # tensors and plain containers only


def trainable(model) -> list[torch.Tensor]:
    """The parameters a training step changes, in one fixed order on both sides."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


def send_weights(role: Role, model, version: int, dst: int, pending: list) -> None:
    flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in trainable(model)])
    tag = torch.tensor([version], dtype=torch.long)
    pending += [(role.group.send([tag], dst, HEADER), tag), (role.group.send([flat], dst, WEIGHTS), flat)]


def recv_weights(role: Role, model) -> int:
    """The next policy version from training process 0, copied into `model`'s trainable parameters."""
    params = trainable(model)
    tag = torch.zeros(1, dtype=torch.long)
    _wait(role.group.recv([tag], 0, HEADER), "the training processes stopped answering the rollout process")
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
    _wait(role.group.recv([flat], 0, WEIGHTS), "the training processes stopped answering the rollout process")
    with torch.no_grad():
        for p, chunk in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(chunk.view_as(p).to(p.dtype))
    return int(tag)


def finish(pending: list, what: str) -> None:
    """Wait (bounded) for this process's sends to be received."""
    for work, _ in pending:
        _wait(work, what)
    pending.clear()


def prune(pending: list) -> None:
    """Forget the sends already received (their buffers may go)."""
    pending[:] = [(w, t) for w, t in pending if not w.is_completed()]
