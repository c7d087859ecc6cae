"""One vocabulary: the keys TRL users already type, one meaning each across every trainer.

`DEPRECATED` is the complete, machine-readable rename table: each former key of ours -> the key that
now carries its meaning (docs/vocabulary.md is the same table for people). An old key keeps working
wherever its new key is a field of the schema (in a recipe, on the command line, as a keyword of a
config class, and read or set as an attribute), and prints ONE line per key per process run
(`warn_deprecated`, on the main process only) naming the new key. Giving both the old and the new key
is a one-line ConfigError, never a silent choice.

TrainConfig (so every schema derived from it) takes the old keywords through the `DeprecatedNames`
metaclass and the old attributes through `DeprecatedAttributes`.

Where a meaning changed rather than a name (PPO's `num_iterations`: rounds before, TRL's "updates per
generation batch" now), the old key cannot be an alias; the help text and docs/vocabulary.md say what
it means now.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from rl.errors import ConfigError

# old key -> new key (TRL's name). The alias applies in a schema that has the new key as a field and
# not the old one, so e.g. `ppo_epochs` only means something to PPO and `epsilon_low` to GRPO.
DEPRECATED: dict[str, str] = {
    # TrainingArguments' names, every trainer
    "batch_size": "per_device_train_batch_size",
    "num_epochs": "num_train_epochs",
    "log_every": "logging_steps",
    "save_every": "save_steps",
    "eval_every": "eval_steps",
    "lr_scheduler": "lr_scheduler_type",
    # generation and the reference model (PPO, distillation; DPO, KTO, online DPO)
    "max_new_tokens": "max_completion_length",
    "ref_model_name": "ref_model",
    "add_eos": "append_eos",
    # policy-gradient keys (PPO and GRPO share GRPO's, which are TRL's)
    "kl_penalty_coef": "beta",
    "clip_ratio": "epsilon",
    "epsilon_low": "epsilon",
    "value_coef": "vf_coef",
    "ppo_epochs": "num_iterations",
}

# What to say when an old key and its new key are both given and the old one used to mean something else
# next to it (the reference docs' PPOConfig(ppo_epochs=4, num_iterations=100): 100 was the rounds).
CONFLICT_HINTS: dict[str, str] = {
    "ppo_epochs": "num_iterations now means the updates per rollout batch (TRL's meaning, formerly ppo_epochs), "
                  "not rollout rounds: drop ppo_epochs and give the run length as max_steps (optimizer steps) or "
                  "PPOTrainer.train(prompts, rounds=N)",
}

_warned: set[str] = set()


def _main_process() -> bool:
    # accelerate/torchrun set RANK; before the Accelerator exists this is the only cheap signal
    return os.environ.get("RANK", "0") in ("", "0")


def warn_deprecated(old: str, new: str) -> None:
    """Print `warning: key 'old' is deprecated; use 'new'` once per key per process (main process only)."""
    if old in _warned:
        return
    _warned.add(old)
    if _main_process():
        print(f"warning: key '{old}' is deprecated; use '{new}'", file=sys.stderr, flush=True)


def reset_warnings() -> None:
    """Forget which keys were warned about (tests)."""
    _warned.clear()


def deprecated_of(fields) -> dict[str, str]:
    """The old keys that translate for a schema with these field names: old -> new."""
    return {old: new for old, new in DEPRECATED.items() if new in fields and old not in fields}


def rename_deprecated(data: dict, fields, where: str = "config", prefix: str = "") -> dict:
    """`data` with every deprecated key of a schema (with these field names) renamed to its new key, each
    warned about once; both an old and its new key given is a one-line ConfigError."""
    renames = deprecated_of(fields)
    if not any(k in renames for k in data):
        return data
    out = {}
    for k, v in data.items():
        new = renames.get(k)
        if new is None:
            if k in out:
                old = next(o for o, n in renames.items() if n == k and o in data)
                raise ConfigError(f"{where}: keys '{prefix}{old}' and '{prefix}{k}' are the same setting; "
                                  f"keep only '{prefix}{k}' ('{prefix}{old}' is its deprecated name)")
            out[k] = v
            continue
        warn_deprecated(prefix + k, prefix + new)
        if new in data or new in out:
            hint = CONFLICT_HINTS.get(k) or f"keep only '{prefix}{new}' ('{prefix}{k}' is its deprecated name)"
            raise ConfigError(f"{where}: keys '{prefix}{k}' and '{prefix}{new}' are the same setting; {hint}")
        out[new] = v
    return out


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


class DeprecatedNames(type):
    """Metaclass of TrainConfig: `Config(batch_size=8)` is `Config(per_device_train_batch_size=8)` with one
    deprecation line (the reference docs build configs so)."""

    def __call__(cls, *args, **kw):
        if kw and dataclasses.is_dataclass(cls):
            kw = rename_deprecated(kw, _field_names(cls), cls.__name__)
        return super().__call__(*args, **kw)


class DeprecatedAttributes:
    """Reading or setting an old key's attribute (`cfg.batch_size`) reaches the new field, with one
    deprecation line, so code written against the old names keeps working while it is renamed."""

    def __getattr__(self, name: str):
        # only called when normal lookup fails: no cost for the real fields
        new = DEPRECATED.get(name)
        if new is not None and new in getattr(type(self), "__dataclass_fields__", {}):
            warn_deprecated(name, new)
            return getattr(self, new)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        new = DEPRECATED.get(name)
        if new is not None and name not in type(self).__dataclass_fields__ and new in type(self).__dataclass_fields__:
            warn_deprecated(name, new)
            name = new
        object.__setattr__(self, name, value)


def add_deprecated_flag(parser, old: str, new: str) -> None:
    """An argparse option `old` kept as a hidden alias of the option `new` (the inference tools' flags,
    launch/eval.py and launch/chat.py): it stores into new's destination with one deprecation line."""
    import argparse

    dest = new.lstrip("-").replace("-", "_")
    target = next(a for a in parser._actions if a.dest == dest)

    class Alias(argparse.Action):
        def __call__(self, p, namespace, values, option_string=None):
            warn_deprecated(old, new)
            setattr(namespace, dest, target.type(values) if target.type else values)

    parser.add_argument(old, dest=f"_deprecated_{dest}", action=Alias, help=argparse.SUPPRESS)
