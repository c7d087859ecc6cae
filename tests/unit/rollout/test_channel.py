"""The rollout-process channel's weights (rl.rollout.channel): every trainable parameter crosses in its own dtype
(bf16 stays bf16), in buckets of a bounded size (rl.engine.weight_sync.pack_buckets), and lands by name in the
receiver's model; frozen
parameters do not cross. Two ranks of a gloo group in two threads of this process."""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from rl.rollout import channel
from rl.rollout.channel import Role, finish, recv_weights, send_weights


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    m[0].to(torch.bfloat16)  # a bf16 layer beside a fp32 one
    m[1].bias.requires_grad_(False)  # frozen: never sent
    return m


def test_weights_cross_in_their_dtype_bucketed_and_by_name(monkeypatch):
    monkeypatch.setattr(channel, "BUCKET_BYTES", 100)  # 3 buckets: bf16 weight (128 bytes), bf16 bias, fp32 weight
    store = dist.HashStore()
    groups = [None, None]

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    sender, receiver = _model(0), _model(1)
    frozen = receiver[1].bias.detach().clone()
    pending, got = [], {}
    recv = threading.Thread(target=lambda: got.update(version=recv_weights(Role(True, 0, 1, 1, groups[1]), receiver)))
    recv.start()
    send_weights(Role(False, 0, 1, 1, groups[0]), sender, 7, 1, pending)
    recv.join(60)
    finish(pending, "the receiver did not take the weights")
    assert got["version"] == 7
    for (name, a), b in zip(sender.named_parameters(), receiver.parameters()):
        if name == "1.bias":
            assert torch.equal(b, frozen)  # not trainable: not sent
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_the_bytes_sent_are_bf16_not_a_fp32_copy(monkeypatch):
    """What goes on the wire for the bf16 layer: 2 bytes an element (bucket alignment aside), not 4."""
    sent = []

    class Group:
        def send(self, tensors, dst, tag):
            sent.append(tensors[0].numel())

    monkeypatch.setattr(channel, "send_object", lambda role, obj, dst, pending, tag=0: sent.append(obj))
    monkeypatch.setattr(channel, "BUCKET_BYTES", 100)  # one bucket per tensor here
    send_weights(Role(False, 0, 1, 1, Group()), _model(0), 3, 1, [])
    meta, sizes = sent[0], sent[1:]
    assert meta["version"] == 3 and [[m[0] for m in h] for h, _ in meta["buckets"]] == [["0.weight"], ["0.bias"],
                                                                                        ["1.weight"]]
    assert sizes == [8 * 8 * 2, 8 * 2, 8 * 4 * 4]
