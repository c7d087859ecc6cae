"""The config checks that need more than a field's type, each returning one line or None (or raising one
ConfigError): every float finite (`check_finite`), a metrics sink that exists and is installed
(`report_to_problem`, `SINKS`), a cadence that is a step count or a fraction of the run (`steps_problem`), 4-bit/8-bit
loading with LoRA (`quantization_problem`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

from rl.errors import ConfigError


def check_finite(cfg, prefix: str = "") -> None:
    """One rule for every float key of every schema, from a recipe, the command line or Python: the value is
    a finite number (a documented null stays null). NaN or inf would pass every range check (comparisons
    with NaN are false) and train nothing, or stop at step 1 with a NaN loss."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name, None)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{key}.")
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"key '{key}' must be a finite number, got {value!r}; give a number"
                                  f"{' (or null)' if 'None' in str(f.type) else ''}")


def steps_problem(cfg) -> str | None:
    """The first bad cadence key (logging_steps, eval_steps, save_steps, warmup_steps): a count >= 1, or a
    fraction of the run in (0, 1) as transformers reads it; eval/save 0 means never by steps."""
    for name, zero_ok in (("logging_steps", False), ("eval_steps", True), ("save_steps", True), ("warmup_steps", True)):
        v = getattr(cfg, name, None)
        if v is None or (zero_ok and v == 0):
            continue
        if v < 0 or (not zero_ok and v == 0) or (v > 1 and float(v) != int(v)):
            return (f"key '{name}' must be a whole number of steps, or a fraction of the run between 0 and 1, "
                    f"got {v}")
    return None


def quantization_problem(cfg) -> str | None:
    """Why load_in_4bit / load_in_8bit cannot be honoured as given (both, or without LoRA), or None."""
    if cfg.load_in_4bit and cfg.load_in_8bit:
        return "load_in_4bit and load_in_8bit are both true; choose one"
    if (cfg.load_in_4bit or cfg.load_in_8bit) and not cfg.lora.enabled:
        return ("load_in_4bit/load_in_8bit train LoRA adapters on quantized frozen weights (QLoRA): set "
                "lora.enabled=true (TRL: use_peft: true; the reference: use_lora=True)")
    return None


# report_to values -> the package each needs (jsonl needs none)
SINKS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow",
         "none": None}


def report_to_problem(report_to) -> str | None:
    """Why `report_to` cannot be honoured (an unknown sink, a sink whose package is not installed), or None."""
    for sink in report_to:
        if sink not in SINKS:
            return f"key 'report_to' has unknown sink {sink!r}; use any of {', '.join(SINKS)}"
        package = SINKS[sink]
        if package and importlib.util.find_spec(package) is None:
            return f"key 'report_to': {sink} needs the {package} package; pip install {package}, or drop {sink}"
    return None
