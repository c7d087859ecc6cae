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
a field wins), so `ppo_epochs` means something only to PPO. A target may be a section's key (`lora_r` ->
`lora.rank`, `dataset_name` -> `data.path`: TRL's flat ModelConfig and ScriptArguments keys). Giving an alias and
its key with different values is a one-line ConfigError, never a silent choice. TRL's keys that have no effect
here are left out of the config with one note line (the table and its reasons: rl.config.trl_keys).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import typing
from typing import Any

from rl.config.trl_keys import ignored_reason
from rl.errors import ConfigError

# alias -> candidate keys, in order. Silent: each is a documented API (the reference's or TRL's). A dotted key
# names a key of a section (`lora_r` -> `lora.rank`): TRL's flat ModelConfig/ScriptArguments keys.
ALIASES: dict[str, tuple[str, ...]] = {
    # the reference module docs' config keywords (PPOConfig, DPOConfig, RewardModelConfig)
    "batch_size": ("per_device_train_batch_size",), "num_epochs": ("num_train_epochs",),
    "save_every": ("save_steps",), "eval_every": ("eval_steps",),
    "max_new_tokens": ("max_completion_length",), "kl_penalty_coef": ("beta",), "clip_ratio": ("epsilon",),
    "value_coef": ("vf_coef",), "ppo_epochs": ("num_ppo_epochs",),
    "use_lora": ("lora.enabled",), "lora_rank": ("lora.rank",),
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
    "per_device_eval_batch_size": ("eval_batch_size",),
    "vllm_importance_sampling_cap": ("vllm_importance_sampling_clip_max",),  # TRL 1.16's deprecated name
    "reward_model_name_or_path": ("reward_model_path",),  # TRL's GRPO script
    # TRL's ModelConfig (a TRL CLI recipe is ScriptArguments + ModelConfig + the trainer's config in one file)
    "model_name_or_path": ("model_name",), "torch_dtype": ("dtype",),
    "use_peft": ("lora.enabled",), "lora_r": ("lora.rank",), "lora_alpha": ("lora.alpha",),
    "lora_dropout": ("lora.dropout",), "lora_target_modules": ("lora.target_modules",),
    "lora_target_parameters": ("lora.target_parameters",), "lora_modules_to_save": ("lora.modules_to_save",),
    "use_rslora": ("lora.use_rslora",), "use_dora": ("lora.use_dora",),
    # TRL's ScriptArguments, and open-r1's script keys beside them
    "dataset_name": ("data.path",), "dataset_config": ("data.name",), "dataset_train_split": ("data.split",),
    "dataset_test_split": ("data.eval_split",), "dataset_streaming": ("data.streaming",),
    "dataset_text_field": ("data.text_column",), "dataset_prompt_column": ("data.prompt_column",),
    # transformers' and TRL's former names: max_seq_length (SFT), evaluation_strategy, overwrite_output_dir, and
    # transformers 5's activation_checkpointing* for gradient_checkpointing*
    "max_seq_length": ("max_length",), "evaluation_strategy": ("eval_strategy",),
    "overwrite_output_dir": ("overwrite",), "activation_checkpointing": ("gradient_checkpointing",),
    "activation_checkpointing_kwargs": ("gradient_checkpointing_kwargs",),
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

UNSET = object()  # a VALUE_ALIASES value that sets nothing (`bf16:` with no value, `fp16: false`)


def _one_config(value):
    """open-r1's `dataset_configs: [all]` (a list) -> data.name `all`; more than one config is one error line."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"a list of one config (data.name); {len(value)} configs are a data.mixture here")
        value = value[0]
    return UNSET if value is None else value


def _checkpoint(value):
    """transformers' resume_from_checkpoint: a path, or true for the newest checkpoint (resume=auto)."""
    flag = _as_bool(value) if not isinstance(value, str) or value.lower() in TRUE_WORDS | FALSE_WORDS else None
    if value is None or flag is False:
        return UNSET
    return "auto" if flag else value


# A key whose value is mapped too: key -> (the key it sets, {value: the value it sets} or a function of the value
# raising ValueError for a value it does not take). UNSET sets nothing. TRL's precision flags: `bf16:` with no
# value is "not set" (TRL then means bf16 unless fp16, our dtype default `auto` means bf16 where the GPU has it);
# TRL's scale_rewards picks GRPO's group estimator.
VALUE_ALIASES: dict[str, tuple[str, object]] = {
    "bf16": ("dtype", {True: "bfloat16", False: "float32", None: UNSET}),
    "fp16": ("dtype", {True: "float16", False: UNSET, None: UNSET}),
    "scale_rewards": ("advantage_estimator", {"group": "grpo", True: "grpo", "batch": "grpo_batch",
                                              "none": "dr_grpo", False: "dr_grpo"}),
    "dataset_configs": ("data.name", _one_config),
    "resume_from_checkpoint": ("resume", _checkpoint),
    "use_cpu": ("device", {True: "cpu", False: UNSET, None: UNSET}),
}

_warned: set[str] = set()


def _main_process() -> bool:
    # accelerate/torchrun set RANK; before the Accelerator exists this is the only cheap signal
    return os.environ.get("RANK", "0") in ("", "0")


def _once(key: str, line: str) -> None:
    """Print `line` once per key per process, on the main process only."""
    if key in _warned:
        return
    _warned.add(key)
    if _main_process():
        print(line, file=sys.stderr, flush=True)


def warn_deprecated(old: str, new: str) -> None:
    """Print `warning: key 'old' is deprecated; use 'new'` once per key per process (main process only)."""
    _once(old, f"warning: key '{old}' is deprecated; use '{new}'")


def note_ignored(key: str, reason: str) -> None:
    """Print `note: key 'x' is accepted and ignored (why)` once per key per process (main process only): a TRL key
    with no effect in this package (rl.config.trl_keys)."""
    _once(key, f"note: key '{key}' is accepted and ignored ({reason})")


def reset_warnings() -> None:
    """Forget which keys were warned about (a new run in the same process warns again)."""
    _warned.clear()


def field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


@functools.lru_cache(maxsize=None)
def section_type(cls: type, name: str) -> type | None:
    """The dataclass type of `cls`'s section field `name` (`lora` -> LoraSection), or None."""
    if name not in field_names(cls):
        return None
    tp = typing.get_type_hints(cls).get(name)
    return tp if dataclasses.is_dataclass(tp) else None


def has_key(cls: type, key: str) -> bool:
    """Whether `key` (dotted for a section's key: `lora.rank`) is a field of schema `cls`."""
    head, dot, rest = key.partition(".")
    if not dot:
        return key in field_names(cls)
    sub = section_type(cls, head)
    return sub is not None and has_key(sub, rest)


@functools.lru_cache(maxsize=None)
def aliases_of(cls: type) -> dict[str, str]:
    """This schema's other key names -> its keys (dotted for a section's key: `lora_r` -> `lora.rank`): ALIASES,
    VALUE_ALIASES, DEPRECATED and the schema's own `ALIASES` mapping (rare; it wins). A name that is a field
    itself is never an alias there."""
    fields = field_names(cls)
    out = {a: next(t for t in targets if has_key(cls, t)) for a, targets in ALIASES.items()
           if a not in fields and any(has_key(cls, t) for t in targets)}
    out.update({a: t for a, (t, _) in VALUE_ALIASES.items() if a not in fields and has_key(cls, t)})
    out.update({old: new for old, new in DEPRECATED.items() if new in fields and old not in fields})
    out.update(getattr(cls, "ALIASES", {}))
    return out


def names_of(cls: type, key: str) -> str:
    """`key` and its other names in schema `cls`, for a message about a key whose spelling the message cannot know
    (a run-time note): `eval_steps/eval_every`."""
    return "/".join([key, *sorted(a for a, k in aliases_of(cls).items() if k == key)])


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    return None


def _mapped(how: Any, value: Any) -> Any:
    """`value` through a VALUE_ALIASES mapping or function; ValueError (what it takes) for another value."""
    if callable(how):
        return how(value)
    if isinstance(value, str) and value.lower() in ("none", "null"):
        value = None
    if isinstance(value, str) and value.lower() in how:
        return how[value.lower()]
    flag = value if value is None else _as_bool(value)
    if flag is None and value is not None or flag not in how:
        words = [k for k in how if not isinstance(k, bool) and k is not None]
        raise ValueError(" or ".join(map(repr, words)) + " or a bool" if words else "bool (true or false)")
    return how[flag]


def _value(raw_key: str, key: str, value: Any, fields, where: str, shown: str) -> Any:
    """The value a VALUE_ALIASES key stands for (`bf16: true` -> `bfloat16`; UNSET: nothing)."""
    if raw_key not in VALUE_ALIASES or raw_key in fields or VALUE_ALIASES[raw_key][0] != key:
        return value
    try:
        return _mapped(VALUE_ALIASES[raw_key][1], value)
    except ValueError as e:
        raise ConfigError(f"{where}: key '{shown}' has value {value!r}, expected {e}") from None


def _clash(where: str, key: str, first: str, second: str, prefix: str) -> ConfigError:
    a, b = sorted((first, second), key=lambda name: name == prefix + key)  # the schema's own name last
    if b == prefix + key:
        return ConfigError(f"{where}: keys '{a}' and '{b}' are the same setting with different values; keep only "
                           f"one ('{b}' is the name here)")
    return ConfigError(f"{where}: keys '{a}' and '{b}' are the same setting ('{prefix}{key}') with different "
                       f"values; keep only one")


def _ignored(cls: type, raw_key: str, value: Any, prefix: str) -> bool:
    """A TRL key with no effect here (rl.config.trl_keys): True (and one note line when its value asks for
    something, i.e. is not TRL's default) for a trainer's schema that has no key of that name."""
    if not isinstance(cls, AcceptsAliases):
        return False  # only a trainer's schema takes TRL's flat keys (not its sections)
    reason = ignored_reason(raw_key, value)
    if reason is None:
        return False
    if reason:
        note_ignored(prefix + raw_key, reason)
    return True


def canonical(data: dict, cls: type, where: str = "config", prefix: str = "",
              given: dict[str, str] | None = None) -> dict:
    """`data` with every alias of schema `cls` replaced by its key (a deprecated one warned about once; a dotted
    one put into its section: `lora_r: 8` -> `lora: {rank: 8}`), and the TRL keys that have no effect here left
    out (one note line each, rl.config.trl_keys). Unknown keys pass through (build reports them). Two names of
    one key with different values are one ConfigError line; with equal values they are one setting, and a name
    given null beside another sets nothing. `given` (if
    passed) receives key (dotted for a section's) -> the name it was typed as, with `prefix`, so that a message
    can name what the user wrote."""
    aliases, fields = aliases_of(cls), field_names(cls)
    given = {} if given is None else given
    out: dict = {}
    dotted: list[tuple[str, str, Any]] = []
    for raw_key, value in data.items():
        key = aliases.get(raw_key, raw_key)
        shown = prefix + raw_key
        if key not in fields and "." not in key and _ignored(cls, raw_key, value, prefix):
            continue
        if raw_key in DEPRECATED and key == DEPRECATED[raw_key]:
            warn_deprecated(shown, prefix + key)
        value = _value(raw_key, key, value, fields, where, shown)
        if value is UNSET:
            continue
        if "." in key:
            dotted.append((raw_key, key, value))
            continue
        if key in out and out[key] != value:
            if value is None:  # another name of it said null: that name sets nothing (TRL's "unset")
                continue
            if out[key] is not None:
                raise _clash(where, key, given[key], shown, prefix)
            given[key] = shown
        out[key] = value
        given.setdefault(key, shown)
    for raw_key, key, value in dotted:  # after the sections' own mappings, whatever their order in `data`
        head, sub = key.split(".", 1)
        section = out.get(head)
        if dataclasses.is_dataclass(section) and not isinstance(section, type):  # Python: replace() semantics
            out[head] = dataclasses.replace(section, **{sub: value})
            continue
        section = dict(section) if isinstance(section, dict) else {}
        section = canonical(section, section_type(cls, head), where, f"{prefix}{head}.")
        if sub in section and section[sub] != value:
            raise _clash(where, key, given.get(key, f"{prefix}{key}"), prefix + raw_key, prefix)
        section[sub] = value
        out[head] = section
        given.setdefault(key, prefix + raw_key)
    return out


class AcceptsAliases(type):
    """Metaclass of TrainConfig: `PPOConfig(batch_size=16, ppo_epochs=4)` is built by its keys' names
    (the reference docs build configs so), silently for the reference's and TRL's names; a section given as
    a mapping (what a dotted alias such as `use_lora=True` makes) is its dataclass with those keys set."""

    def __call__(cls, *args, **kw):
        if kw and dataclasses.is_dataclass(cls):
            if field_names(cls) <= set(kw):  # dataclasses.replace(cfg, alias=...): the alias is the change
                targets = aliases_of(cls)
                kw = {k: v for k, v in kw.items() if not any(targets.get(a) == k for a in kw)}
            kw = canonical(kw, cls, cls.__name__)
            for name, value in kw.items():
                sub = section_type(cls, name)
                if sub is not None and isinstance(value, dict):
                    default = next(f for f in dataclasses.fields(cls) if f.name == name).default_factory()
                    kw[name] = dataclasses.replace(default, **canonical(value, sub, cls.__name__, f"{name}."))
        return super().__call__(*args, **kw)


def _path(obj, key: str):
    """(the object holding dotted `key`, its last name): `lora.rank` -> (obj.lora, "rank")."""
    *heads, last = key.split(".")
    for head in heads:
        obj = getattr(obj, head)
    return obj, last


class AliasAttributes:
    """Reading or setting an alias as an attribute (`cfg.batch_size`, `cfg.ppo_epochs`, `cfg.lora_r`) reaches its
    field, so code written against the reference's or TRL's names works unchanged (a deprecated name says so
    once)."""

    def __getattr__(self, name: str):
        # only called when normal lookup fails: no cost for the real fields
        key = aliases_of(type(self)).get(name)
        if key is not None and name not in VALUE_ALIASES:
            if DEPRECATED.get(name) == key:
                warn_deprecated(name, key)
            return getattr(*_path(self, key))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name not in type(self).__dataclass_fields__:
            key = aliases_of(type(self)).get(name)
            if key is not None and name not in VALUE_ALIASES:
                if DEPRECATED.get(name) == key:
                    warn_deprecated(name, key)
                if "." in key:
                    setattr(*_path(self, key), value)
                    return
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
