"""rl.engine.host_memory: glibc's malloc keeps large freed blocks (applied once per process, on Linux/glibc)."""

import platform
import sys

import torch

from rl.engine import host_memory


def test_keep_freed_memory_applies_once_on_glibc():
    applies = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert host_memory.keep_freed_memory() is applies
    assert host_memory.keep_freed_memory() is applies  # a second call changes nothing
    x = torch.ones(8 << 20)  # 32 MiB, above glibc's default mmap threshold: still an ordinary tensor
    assert float(x.sum()) == 8 << 20


def test_cpu_training_keeps_freed_memory(monkeypatch):
    """An accelerator built for CPU training applies the tuning (its step's large blocks come back every step)."""
    from rl.engine.dist import build_accelerator

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    acc = build_accelerator(device="cpu")
    assert acc.device.type == "cpu" and calls == [1]
