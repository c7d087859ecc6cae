"""Optimizer and learning-rate schedule of every trainer.

`build_optimizer`: the recipe's `optim` (HF/TRL's names: adamw_torch_fused by default, as TRL's, adamw_torch,
bitsandbytes' adamw_8bit / paged_adamw_8bit / paged_adamw_32bit, transformers' Adafactor, SGD) over the
trainable parameters, with no weight decay on biases and norms.
`build_scheduler`: transformers' `get_scheduler` by its name (TRL's `lr_scheduler_type` and `lr_scheduler_kwargs`:
linear, cosine, cosine_with_min_lr, cosine_with_restarts, polynomial, constant, constant_with_warmup,
inverse_sqrt, warmup_stable_decay, ...), its warmup `warmup_steps` (below 1 a fraction of the run, as
transformers reads it) or `warmup_ratio` of the run (rounded; it wins when above 0), stepped once per optimizer
step (the pipeline steps it itself, not through accelerate's wrapper).
"""

from __future__ import annotations

import ast
import importlib
import math

import torch

from rl.errors import ConfigError, first_line

BNB_OPTIMS = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")


def bitsandbytes_problem(key: str, value, instead: str) -> str | None:
    """Why bitsandbytes, which `key`=`value` needs, cannot be used here (not installed, or its native
    library does not load), or None: checked before the run starts (the launch scripts' preflight), not at
    the first optimizer step."""
    try:
        importlib.import_module("bitsandbytes")  # its kernels-community lines are filtered by rl/__init__.py
    except Exception as e:  # noqa: BLE001 - ImportError, OSError of its native library, RuntimeError: all one line
        reason = (str(e).strip().splitlines() or [""])[0][:160]
        return (f"key '{key}': {key}={value} needs bitsandbytes, which cannot be loaded here ({type(e).__name__}: "
                f"{reason}); pip install bitsandbytes, or use {instead}")
    return None


def optim_problem(optim: str | None) -> str | None:
    """`bitsandbytes_problem` for an `optim` that is one of bitsandbytes' optimizers; None for the others."""
    return bitsandbytes_problem("optim", optim, "optim=adamw_torch") if optim in BNB_OPTIMS else None


def optimizer_arguments(text: str | None) -> dict:
    """transformers' optim_args, 'amsgrad=True,foreach=False', as keywords (each value read as a Python literal)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"key 'optim_args': {item!r} is not key=value; write e.g. 'amsgrad=True,foreach=False'")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def build_optimizer(model, learning_rate: float, weight_decay: float = 0.0, optim: str = "adamw_torch_fused",
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, optim_args: str | None = None):
    """`optim` over trainable parameters; no decay on biases and norms (the usual transformer recipe). `betas` and
    `eps` are AdamW's (TRL's adam_beta1, adam_beta2, adam_epsilon; the 8-bit AdamWs take them too); `optim_args`
    more keywords of the optimizer (`optimizer_arguments`)."""
    extra = optimizer_arguments(optim_args)
    try:
        return _optimizer(model, learning_rate, weight_decay, optim, betas, eps, extra)
    except TypeError as e:  # a keyword the optimizer does not take
        raise ConfigError(f"key 'optim_args' {optim_args!r}: {first_line(e)} (optim={optim})") from None


def _optimizer(model, learning_rate, weight_decay, optim, betas, eps, extra):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    adam = dict(lr=learning_rate, betas=tuple(betas), eps=eps, **extra)
    if optim in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW(groups, fused=True if optim.endswith("fused") else None, **adam)
    if optim in BNB_OPTIMS:
        import bitsandbytes as bnb  # its 8-bit and paged optimizers run on the CPU too

        cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
               "paged_adamw_32bit": bnb.optim.PagedAdamW32bit}[optim]
        return cls(groups, **adam)
    if optim == "adafactor":
        from transformers.optimization import Adafactor

        # an explicit learning rate, as HF's Trainer runs it (no relative step, no warmup of its own)
        return Adafactor(groups, lr=learning_rate, **{"scale_parameter": False, "relative_step": False,
                                                      "warmup_init": False, **extra})
    if optim == "sgd":
        return torch.optim.SGD(groups, lr=learning_rate, **extra)
    raise ValueError(f"unknown optim {optim!r}")


def warmup_count(total_steps: int, warmup_ratio: float = 0.0, warmup_steps: int | float | None = None) -> int:
    """Warmup optimizer steps: round(warmup_ratio x total) when the ratio is above 0, else `warmup_steps` (below 1:
    ceil(fraction x total), transformers' reading), else 0."""
    if warmup_ratio:
        return int(round(warmup_ratio * total_steps))
    if warmup_steps is None:
        return 0
    return math.ceil(warmup_steps * total_steps) if warmup_steps < 1 else int(warmup_steps)


def build_scheduler(optimizer, kind: str, total_steps: int, warmup_ratio: float = 0.0,
                    warmup_steps: int | float | None = None, kwargs: dict | None = None):
    """transformers' schedule `kind` over `total_steps` optimizer steps with `warmup_count` warmup steps and the
    schedule's own `kwargs` (lr_scheduler_kwargs); a LambdaLR (or torch's scheduler) stepped once per step.
    transformers' `constant` has no warmup (the config says so in one line when one is given)."""
    from transformers import get_scheduler

    warmup = warmup_count(total_steps, warmup_ratio, warmup_steps)
    try:
        return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=max(total_steps, 1),
                             scheduler_specific_kwargs=dict(kwargs or {}))
    except (TypeError, ValueError) as e:  # an argument the schedule does not take, or lacks
        raise ConfigError(f"key 'lr_scheduler_kwargs' {kwargs}: {first_line(e)} (lr_scheduler_type={kind})") from None
