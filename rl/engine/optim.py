"""Optimizer and learning-rate schedule of every trainer.

`build_optimizer`: AdamW over the trainable parameters, with no weight decay on biases and norms.
`build_scheduler`: linear warmup (`warmup_steps`, or `warmup_ratio` of the total), then constant,
linear decay or cosine decay to zero over `total_steps`, as a `LambdaLR` stepped once per optimizer
step (the pipeline steps it itself, not through accelerate's wrapper).
"""

from __future__ import annotations

import math

import torch


def build_optimizer(model, learning_rate: float, weight_decay: float = 0.0):
    """AdamW over trainable parameters; no decay on biases and norms (the usual transformer recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=learning_rate)


def build_scheduler(optimizer, kind: str, total_steps: int, warmup_ratio: float = 0.0,
                    warmup_steps: int | None = None):
    """Linear warmup then constant / linear decay / cosine decay to zero over `total_steps`."""
    warmup = warmup_steps if warmup_steps is not None else int(round(warmup_ratio * total_steps))
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, 1.0 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
