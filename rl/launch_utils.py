"""Small pieces every launch script shares: one-line failures and the --dry-run report."""

from __future__ import annotations

import sys

import yaml

from rl.config import to_dict


def fail(message: str, code: int = 2):
    """Print one `error:` line (no traceback) and exit: for mistakes in the user's input."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def dry_run_report(cfg, n_examples: int | None = None, models: dict[str, str] | None = None) -> dict:
    """Print the resolved config and the derived sizes without building any model."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = cfg.batch_size
    global_batch = per_device * cfg.gradient_accumulation_steps * world
    info = {
        "world_size": world,
        "per_device_batch": per_device,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "global_batch": global_batch,
        "deepspeed": cfg.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
    }
    if n_examples is not None:
        info["examples"] = n_examples
        info["steps_per_epoch"] = n_examples // global_batch
    if models:
        info["models"] = models
    print(yaml.safe_dump({"config": to_dict(cfg), "plan": info}, sort_keys=False))
    return info
