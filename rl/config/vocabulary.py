"""The one table of key names that are not a schema's own fields, and how a mapping of keys is brought to
the schema's names (`canonical`).

Two languages are first class and never warn (docs/vocabulary.md):
* the reference docs' names (`shared/reference/`: `PPOConfig(batch_size=16, ppo_epochs=4, clip_ratio=0.2,
  kl_penalty_coef=0.01, value_coef=0.5, max_new_tokens=128, num_iterations=100, save_every=10, ...)`, the
  CLI's `rl_*` flags), with the reference's meanings;
* TRL's names (`per_device_train_batch_size`, `num_ppo_epochs`, `cliprange`, `kl_coef`, ...), with TRL's
  meanings.
A schema's fields carry TRL's name where a key means what TRL's key means; the reference's name is then an
alias (`ALIASES`). Where the two disagree for one trainer (PPO's `num_iterations`: the reference's rollout
rounds, a word TRL's PPO does not have), the reference's meaning wins for that trainer.

`DEPRECATED` holds only our own former names, which are neither the reference's nor TRL's: they still work
and print one line per key per run (main process). `VALUE_ALIASES` maps a key and its value (TRL's
`bf16: true` is `dtype: bfloat16`).

An alias applies in a schema that does not have it as a field and has one of its targets (the first that is
a field wins), so `ppo_epochs` means something only to PPO. Giving an alias and its key with different
values is a one-line ConfigError, never a silent choice.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any

from rl.errors import ConfigError

# alias -> candidate keys, in order. Silent: each is a documented API (the reference's or TRL's).
ALIASES: dict[str, tuple[str, ...]] = {
    # the reference module docs' config keywords (PPOConfig, DPOConfig, RewardModelConfig)
    "batch_size": ("per_device_train_batch_size",), "num_epochs": ("num_train_epochs",),
    "save_every": ("save_steps",), "eval_every": ("eval_steps",),
    "max_new_tokens": ("max_completion_length",), "kl_penalty_coef": ("beta",), "clip_ratio": ("epsilon",),
    "value_coef": ("vf_coef",), "ppo_epochs": ("num_ppo_epochs",),
    # the reference's generic names (its CLI's LLMTrainingParams)
    "lr": ("learning_rate",), "epochs": ("num_train_epochs",), "model": ("model_name",),
    "project_name": ("output_dir",),
    # the reference CLI's rl_* names
    "rl_gamma": ("gamma",), "rl_gae_lambda": ("lam",), "rl_kl_coef": ("beta",),
    "rl_value_loss_coef": ("vf_coef",), "rl_clip_range": ("epsilon",),
    "rl_value_clip_range": ("value_clip",), "rl_num_ppo_epochs": ("num_ppo_epochs", "num_iterations"),
    "rl_mini_batch_size": ("mini_batch_size",), "rl_max_new_tokens": ("max_completion_length",),
    "rl_top_k": ("top_k",), "rl_top_p": ("top_p",), "rl_temperature": ("temperature",),
    "rl_reward_model_path": ("reward_model_path",), "rl_reward_fn": ("reward_fn",),
    "rl_multi_objective": ("multi_objective",), "rl_reward_weights": ("reward_weights",),
    "rl_env_type": ("env_type",), "rl_env_config": ("env_config",), "model_ref": ("ref_model",),
    "dpo_beta": ("beta",),
    # TRL's other names for our keys (its PPOConfig's, DPOConfig's)
    "group_size": ("num_generations",), "kl_coef": ("beta",), "cliprange": ("epsilon",),
    "cliprange_value": ("value_clip",), "num_ppo_epochs": ("num_iterations",), "gae_lambda": ("lam",),
    "precompute_ref_log_probs": ("precompute_ref_logps",), "padding_free": ("packing",),
}

# Our own former names (neither the reference's nor TRL's) -> the key now: one line per key per run.
DEPRECATED: dict[str, str] = {
    "log_every": "logging_steps",
    "lr_scheduler": "lr_scheduler_type",
    "ref_model_name": "ref_model",
    "add_eos": "append_eos",
    "epsilon_low": "epsilon",
}

# What a bool key accepts as text (any case), on the command line and in a recipe (rl.config.fields too).
TRUE_WORDS = {"true", "yes", "on", "1"}
FALSE_WORDS = {"false", "no", "off", "0"}

# A key whose value is mapped too: TRL's boolean precision flag.
VALUE_ALIASES: dict[str, tuple[str, dict]] = {"bf16": ("dtype", {True: "bfloat16", False: "float32"})}

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
    """Forget which keys were warned about (a new run in the same process warns again)."""
    _warned.clear()


def field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


@functools.lru_cache(maxsize=None)
def aliases_of(cls: type) -> dict[str, str]:
    """This schema's other key names -> its keys: ALIASES, VALUE_ALIASES, DEPRECATED and the schema's own
    `ALIASES` mapping (rare; it wins). A name that is a field itself is never an alias there."""
    fields = field_names(cls)
    out = {a: next(t for t in targets if t in fields) for a, targets in ALIASES.items()
           if a not in fields and any(t in fields for t in targets)}
    out.update({a: t for a, (t, _) in VALUE_ALIASES.items() if a not in fields and t in fields})
    out.update({old: new for old, new in DEPRECATED.items() if new in fields and old not in fields})
    out.update(getattr(cls, "ALIASES", {}))
    return out


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    return None


def _value(raw_key: str, key: str, value: Any, fields, where: str, prefix: str) -> Any:
    """The value a VALUE_ALIASES key stands for (`bf16: true` -> `bfloat16`)."""
    if raw_key not in VALUE_ALIASES or raw_key in fields or VALUE_ALIASES[raw_key][0] != key:
        return value
    flag = _as_bool(value)
    if flag is None:
        raise ConfigError(f"{where}: key '{prefix}{raw_key}' has value {value!r}, expected bool (true or false)")
    return VALUE_ALIASES[raw_key][1][flag]


def canonical(data: dict, cls: type, where: str = "config", prefix: str = "",
              given: dict[str, str] | None = None) -> dict:
    """`data` with every alias of schema `cls` replaced by its key (a deprecated one warned about once).
    Unknown keys pass through (build reports them). Two names of one key with different values are one
    ConfigError line; with equal values they are one setting. `given` (if passed) receives key -> the name
    it was typed as, so that a message can name what the user wrote."""
    aliases, fields = aliases_of(cls), field_names(cls)
    given = {} if given is None else given
    if not any(k in aliases for k in data):
        return data
    out: dict = {}
    for raw_key, value in data.items():
        key = aliases.get(raw_key, raw_key)
        if raw_key in DEPRECATED and key == DEPRECATED[raw_key]:
            warn_deprecated(prefix + raw_key, prefix + key)
        value = _value(raw_key, key, value, fields, where, prefix)
        if key in out and out[key] != value:
            a, b = sorted((given[key], raw_key), key=lambda name: name == key)  # the schema's own name last
            raise ConfigError(f"{where}: keys '{prefix}{a}' and '{prefix}{b}' are the same setting with different "
                              f"values; keep only one ('{prefix}{b}' is the name here)" if b == key else
                              f"{where}: keys '{prefix}{a}' and '{prefix}{b}' are the same setting ('{prefix}{key}') "
                              f"with different values; keep only one")
        out[key] = value
        given.setdefault(key, raw_key)
    return out


class AcceptsAliases(type):
    """Metaclass of TrainConfig: `PPOConfig(batch_size=16, ppo_epochs=4)` is built by its keys' names
    (the reference docs build configs so), silently for the reference's and TRL's names."""

    def __call__(cls, *args, **kw):
        if kw and dataclasses.is_dataclass(cls):
            kw = canonical(kw, cls, cls.__name__)
        return super().__call__(*args, **kw)


class AliasAttributes:
    """Reading or setting an alias as an attribute (`cfg.batch_size`, `cfg.ppo_epochs`) reaches its field, so
    code written against the reference's names works unchanged (a deprecated name says so once)."""

    def __getattr__(self, name: str):
        # only called when normal lookup fails: no cost for the real fields
        key = aliases_of(type(self)).get(name)
        if key is not None and name not in VALUE_ALIASES:
            if DEPRECATED.get(name) == key:
                warn_deprecated(name, key)
            return getattr(self, key)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name not in type(self).__dataclass_fields__:
            key = aliases_of(type(self)).get(name)
            if key is not None and name not in VALUE_ALIASES:
                if DEPRECATED.get(name) == key:
                    warn_deprecated(name, key)
                name = key
        object.__setattr__(self, name, value)


def add_alias_flag(parser, alias: str, flag: str) -> None:
    """An argparse option `alias` kept as a hidden, silent alias of the option `flag` (the inference tools'
    `--max-new-tokens` and `--batch-size`, the reference's and generate's names)."""
    import argparse

    dest = flag.lstrip("-").replace("-", "_")
    target = next(a for a in parser._actions if a.dest == dest)

    class Alias(argparse.Action):
        def __call__(self, p, namespace, values, option_string=None):
            setattr(namespace, dest, target.type(values) if target.type else values)

    parser.add_argument(alias, dest=f"_alias_{dest}", action=Alias, help=argparse.SUPPRESS)
