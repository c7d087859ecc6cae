"""Typed recipe configs: a YAML recipe as the base, command-line overrides on top, strict validation.

Every trainer has one dataclass schema whose fields carry a one-line help text (`opt(default,
"help")`). `parse_config(Schema, argv)` reads `--config recipe.yaml`, applies `--key value`,
`--key=value` and `key=value` overrides (dotted keys such as `lora.rank=16` reach nested sections),
converts each value to the field's type and builds the dataclass. Mistakes become one `ConfigError`
line naming the key, the value and what was expected; the launch scripts print it and exit with 2.

Why not plain argparse or HfArgumentParser: neither merges a YAML base with overrides of nested
sections, nor suggests the closest key for a typo, which is most of what goes wrong with recipes.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from rl.tracking import report_to_problem

REQUIRED = dataclasses.MISSING


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line that says how to fix it."""


def opt(default: Any = REQUIRED, help: str = "", **kw) -> Any:
    """A schema field with a default (`REQUIRED` for none) and a one-line help text."""
    meta = {"help": help}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


def section(cls: type, help: str = "") -> Any:
    """A nested config section (itself a dataclass), filled from a YAML mapping or dotted keys."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


# --------------------------------------------------------------------------------------------------
# Type conversion
# --------------------------------------------------------------------------------------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _load_inline(text: str) -> Any:
    """An inline YAML/JSON value from the command line or a recipe string; a syntax error becomes a
    TypeError that says what was expected (build() names the key)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TypeError(f"valid inline YAML/JSON such as {{a: 1}} or [1, 2] ({problem}; quote the "
                        f"whole value in the shell)") from None


def _convert(value: Any, tp: Any) -> Any:
    """Convert a YAML/CLI value to `tp`, raising TypeError(expected-type) when it cannot."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a)
            except (TypeError, ValueError) as e:
                errors.append(e.args[0] if isinstance(e, TypeError) and e.args else _type_name(a))
        if len(errors) == 1 and type(None) in args:  # `X | None`: say what was wrong with X
            raise TypeError(f"{errors[0]}, or null")
        raise TypeError(_type_name(tp))
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        raise TypeError(_type_name(tp))
    if origin in (list, tuple):
        if isinstance(value, str):
            parsed = _load_inline(value) if value.strip().startswith("[") else value.split(",")
            value = parsed if isinstance(parsed, list) else [parsed]
        if not isinstance(value, (list, tuple)):
            raise TypeError(_type_name(tp))
        (inner, *_) = get_args(tp) or (Any,)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_convert(v, inner))
            except (TypeError, ValueError):
                raise TypeError(f"a list of {_type_name(inner)}, but item {i} is {v!r}") from None
        return out
    if origin is dict or tp is dict:
        if isinstance(value, str):
            value = _load_inline(value)
        if not isinstance(value, dict):
            raise TypeError(f"{_type_name(tp)} (a mapping such as {{a: 1, b: 2}})")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        out = {}
        for k, v in value.items():
            try:
                out[_convert(k, key_tp)] = _convert(v, val_tp)
            except (TypeError, ValueError):
                raise TypeError(f"{_type_name(val_tp)} for every value, but {k!r} is {v!r}") from None
        return out
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise TypeError("bool (true or false)")
    if tp is int:
        if isinstance(value, bool):
            raise TypeError("int")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                f = float(value)  # accepts "1e3"
                if f.is_integer():
                    return int(f)
        raise TypeError("int")
    if tp is float:
        if isinstance(value, bool):
            raise TypeError("float")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError("float")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError("str")
    return value


# --------------------------------------------------------------------------------------------------
# Building a schema from a nested mapping
# --------------------------------------------------------------------------------------------------

def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# The one alias table: the reference docs' and CLI's names and TRL's names, each mapped to our key. An
# alias lists candidate targets in order and a schema takes the first that is one of its fields (so
# `rl_kl_coef` is PPO's kl_penalty_coef and GRPO's beta); a name that is a field itself is never an alias
# there (GRPO's max_completion_length is its own key, PPO's alias for max_new_tokens). A schema's own
# ALIASES (rare) win.
ALIASES: dict[str, tuple[str, ...]] = {
    # the reference's generic names
    "lr": ("learning_rate",), "epochs": ("num_epochs",), "model": ("model_name",), "project_name": ("output_dir",),
    # the reference CLI's rl_* names
    "rl_gamma": ("gamma",), "rl_gae_lambda": ("lam",), "rl_kl_coef": ("kl_penalty_coef", "beta"),
    "rl_value_loss_coef": ("value_coef",), "rl_clip_range": ("clip_ratio", "epsilon_low"),
    "rl_value_clip_range": ("value_clip",), "rl_num_ppo_epochs": ("ppo_epochs",),
    "rl_mini_batch_size": ("mini_batch_size",), "rl_max_new_tokens": ("max_new_tokens", "max_completion_length"),
    "rl_top_k": ("top_k",), "rl_top_p": ("top_p",), "rl_temperature": ("temperature",),
    "rl_reward_model_path": ("reward_model_path",), "rl_reward_fn": ("reward_fn",),
    "rl_multi_objective": ("multi_objective",), "rl_reward_weights": ("reward_weights",),
    "rl_env_type": ("env_type",), "rl_env_config": ("env_config",), "model_ref": ("ref_model", "ref_model_name"),
    "dpo_beta": ("beta",),
    # TRL's names (TrainingArguments and the DPO/GRPO/PPO/Reward configs)
    "per_device_train_batch_size": ("batch_size",), "num_train_epochs": ("num_epochs",),
    "logging_steps": ("log_every",), "save_steps": ("save_every",), "eval_steps": ("eval_every",),
    "lr_scheduler_type": ("lr_scheduler",), "max_completion_length": ("max_new_tokens",),
    "max_new_tokens": ("max_completion_length",), "num_generations": ("num_generations",),
    "group_size": ("num_generations",), "epsilon": ("epsilon_low", "clip_ratio"), "kl_coef": ("kl_penalty_coef", "beta"),
    "vf_coef": ("value_coef",), "cliprange": ("clip_ratio",), "cliprange_value": ("value_clip",),
    "num_ppo_epochs": ("ppo_epochs",), "gae_lambda": ("lam",), "precompute_ref_log_probs": ("precompute_ref_logps",),
    "ref_model": ("ref_model_name",), "padding_free": ("packing",),
}
# TRL's boolean precision flags: an alias whose value is mapped too
VALUE_ALIASES: dict[str, tuple[str, dict]] = {"bf16": ("dtype", {True: "bfloat16", False: "float32"})}


def _aliases(cls: type) -> dict[str, str]:
    """This schema's alternative key names -> its keys (see ALIASES)."""
    fields = _fields(cls)
    out = {a: next(t for t in targets if t in fields) for a, targets in ALIASES.items()
           if a not in fields and any(t in fields for t in targets)}
    out.update({a: t for a, (t, _) in VALUE_ALIASES.items() if a not in fields and t in fields})
    out.update(getattr(cls, "ALIASES", {}))
    return out


def _all_keys(cls: type, prefix: str = "", aliases: bool = False) -> list[str]:
    """Every dotted key of `cls` (with `aliases`, the alias names instead)."""
    keys = [] if aliases else [prefix + name for name in _fields(cls)]
    if aliases:
        keys += [prefix + a for a in _aliases(cls)]
    hints = _hints(cls)
    for name in _fields(cls):
        if dataclasses.is_dataclass(hints[name]):
            keys += _all_keys(hints[name], f"{prefix}{name}.", aliases)
    return keys


def _unknown(key: str, cls: type, where: str) -> ConfigError:
    # our own keys first; an alias (a reference CLI or TRL name) only when no key is close
    close = (difflib.get_close_matches(key, _all_keys(cls), n=3, cutoff=0.6)
             or difflib.get_close_matches(key, _all_keys(cls, aliases=True), n=3, cutoff=0.6))
    hint = f" (did you mean {', '.join(close)}?)" if close else " (run with --help to list the keys)"
    return ConfigError(f"{where}: unknown key '{key}'{hint}")


def build(cls: type, data: dict, where: str = "config", prefix: str = "", root: type | None = None,
          require: bool = True):
    """Instantiate dataclass `cls` from a (possibly nested) mapping, validating every key.

    With `require=False` only the keys and types are checked (a recipe may leave a required key to
    the command line) and None is returned."""
    root = root or cls
    fields, hints, aliases = _fields(cls), _hints(cls), _aliases(cls)
    kwargs: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = aliases.get(raw_key, raw_key)
        if key not in fields:
            raise _unknown(prefix + raw_key, root, where)
        if raw_key in VALUE_ALIASES and key == VALUE_ALIASES[raw_key][0] and raw_key not in fields:
            try:
                value = VALUE_ALIASES[raw_key][1][_convert(value, bool)]
            except TypeError:
                raise ConfigError(f"{where}: key '{prefix}{raw_key}' has value {value!r}, expected bool "
                                  f"(true or false)") from None
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: key '{prefix}{raw_key}' is a section; give it a mapping "
                                  f"of keys, e.g. {prefix}{raw_key}.<key>=<value>")
            kwargs[key] = build(tp, value, where, f"{prefix}{key}.", root, require)
            continue
        try:
            kwargs[key] = _convert(value, tp)
        except (TypeError, ValueError) as e:
            expected = e.args[0] if isinstance(e, TypeError) and e.args else _type_name(tp)
            raise ConfigError(f"{where}: key '{prefix}{raw_key}' has value {value!r}, "
                              f"expected {expected}") from None
    if not require:
        return None
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is REQUIRED
               and f.default_factory is REQUIRED]
    if missing:
        name = prefix + missing[0]
        raise ConfigError(f"missing required key '{name}': set it in the recipe or pass --{name} VALUE")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[parts[-1]] = value


def _field_type(cls: type, dotted: str) -> Any:
    """Type of a dotted key, or None when the key is unknown (reported later by `build`)."""
    tp: Any = cls
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        part = _aliases(tp).get(part, part)
        hints = _hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _parse_scalar(text: str) -> Any:
    """A command-line value as YAML would read it ('3' -> 3, 'true' -> True, '[1,2]' -> list)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def split_argv(cls: type, argv: list[str]) -> tuple[str | None, dict, bool]:
    """Split argv into (recipe path, overrides tree, help requested)."""
    recipe, overrides, want_help = None, {}, False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            want_help = True
            i += 1
            continue
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            key = key.replace("-", "_")
            if not eq:
                tp = _field_type(cls, key)
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                takes_flag = tp is bool and (nxt is None or nxt.startswith("--") or "=" in nxt
                                             or nxt.lower() not in _TRUE | _FALSE)
                if takes_flag:
                    value = "true"
                elif nxt is None:
                    raise ConfigError(f"command line: option '--{key}' needs a value")
                else:
                    value, i = nxt, i + 1
        elif "=" in arg:
            key, _, value = arg.partition("=")
            key = key.replace("-", "_")
        else:
            raise ConfigError(f"command line: unexpected argument '{arg}'; use --key value or key=value")
        if key == "config":
            recipe = value
        else:
            _set_dotted(overrides, key, _parse_scalar(value))
        i += 1
    return recipe, overrides, want_help


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_recipe(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe file not found: {path} (pass --config recipes/<name>.yaml)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{line} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of key: value lines")
    return data


def help_text(cls: type, prog: str, description: str = "") -> str:
    lines = [f"usage: {prog} [--config RECIPE.yaml] [--key VALUE | key=VALUE ...]", ""]
    if description:
        lines += [description.strip(), ""]
    lines += ["Every key below can be set in the recipe and overridden on the command line;",
              "nested keys use dots (lora.rank=16). Booleans accept --flag or --flag false.", "",
              "  --config PATH    YAML recipe used as the base (default: none, all defaults)"]

    def walk(c: type, prefix: str) -> None:
        hints = _hints(c)
        for name, f in _fields(c).items():
            tp = hints[name]
            if dataclasses.is_dataclass(tp):
                lines.append(f"\n  [{prefix}{name}] {f.metadata.get('help', '')}")
                walk(tp, f"{prefix}{name}.")
                continue
            if f.default is not REQUIRED:
                default = f.default
            elif f.default_factory is not REQUIRED:
                default = f.default_factory()
            else:
                default = "REQUIRED"
            lines.append(f"  --{prefix}{name} {_type_name(tp)}  (default: {default})")
            lines.append(f"        {f.metadata.get('help', '')}")
        al = _aliases(c)
        if al:
            lines.append("  aliases: " + ", ".join(f"{prefix}{a} -> {prefix}{t}" for a, t in al.items()))

    walk(cls, "")
    return "\n".join(lines) + "\n"


def parse_config(cls: type, argv: list[str] | None = None, prog: str | None = None,
                 description: str = ""):
    """Recipe + overrides -> a validated `cls`. Raises ConfigError; prints help and exits on --help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    recipe, overrides, want_help = split_argv(cls, argv)
    if want_help:
        print(help_text(cls, prog or Path(sys.argv[0]).name, description))
        raise SystemExit(0)
    data = load_recipe(recipe) if recipe else {}
    where = recipe or "config"
    build(cls, data, where, require=False)  # so that a mistake in the recipe names the recipe file
    data = _cli_replaces_reward_sources(cls, data, overrides)
    return build(cls, _merge(data, overrides), "command line" if overrides else where)


def _cli_replaces_reward_sources(cls: type, recipe: dict, overrides: dict) -> dict:
    """A reward source given on the command line (a key of cls.REWARD_SOURCE_KEYS) replaces the recipe's
    reward sources and their reward_weights, rather than clashing with them (`reward_model_path=runs/rm`
    over a recipe with `reward_fn: custom`). With reward_weights on the command line too the sources
    combine, as reward_weights asks for explicitly."""
    sources = set(getattr(cls, "REWARD_SOURCE_KEYS", ()))
    aliases = _aliases(cls)
    # switching a source off (env_type=null) gives none: the recipe's other sources stay
    given = {aliases.get(k, k) for k, v in overrides.items() if v not in (None, [], "null", "none")}
    if not sources & given or "reward_weights" in given:
        return recipe
    dropped = sources | {"reward_weights", "custom_reward"}
    return {k: v for k, v in recipe.items() if aliases.get(k, k) not in dropped}


def cli_config(cls: type, argv: list[str] | None = None, prog: str | None = None,
               description: str = ""):
    """`parse_config` for launch scripts: a ConfigError becomes one `error:` line and exit code 2."""
    try:
        return parse_config(cls, argv, prog, description)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg, directory: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config (every field, defaults included) as YAML next to the outputs."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / name
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def epoch_plan(cfg, n_examples: int, world: int, what: str = "examples") -> dict:
    """Derived sizes of an epoch-based trainer, computed once: global batch, steps per epoch and
    total optimizer steps (`max_steps` wins over `num_epochs`).

    As a data loader without drop_last: an incomplete last global batch (or an only one, when the data
    is smaller than a global batch) is a smaller last step, steps_per_epoch = ceil(n / global_batch).
    The trainers weight it so that its loss is still the mean over the examples it holds, and every
    process still runs gradient_accumulation_steps micro-batches in it (ZeRO-3). `warning` is the one
    line to print about it, or None."""
    if n_examples < 1:
        raise ConfigError(f"no training {what}")
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps * world
    steps_per_epoch = math.ceil(n_examples / global_batch)
    last = n_examples - (steps_per_epoch - 1) * global_batch
    warning = None
    if last < global_batch:
        warning = (f"warning: {n_examples} training {what} do not fill the global batch of {global_batch} "
                   f"(batch_size {cfg.batch_size} x gradient_accumulation_steps {cfg.gradient_accumulation_steps} "
                   f"x {world} processes): the last step of each epoch trains on {last}")
    total = cfg.max_steps or steps_per_epoch * cfg.num_epochs
    return {"global_batch": global_batch, "steps_per_epoch": steps_per_epoch, "total_steps": total,
            "last_batch": last, "warning": warning}


# --------------------------------------------------------------------------------------------------
# Sections shared by the trainers
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoraSection:
    enabled: bool = opt(False, "train LoRA adapters instead of all weights")
    rank: int = opt(16, "LoRA rank r")
    alpha: int = opt(32, "LoRA scaling alpha (effective scale alpha / r)")
    dropout: float = opt(0.05, "dropout on the LoRA input")
    target_modules: str = opt("all-linear", "modules to adapt: 'all-linear' or a comma-separated list")


@dataclasses.dataclass
class DataSection:
    path: str | None = opt(None, "training data: a .jsonl/.json/.csv/.parquet file, a saved datasets dir, a "
                           "dataset folder laid out as on the Hub, or a Hub dataset id (trl-lib/Capybara)")
    name: str | None = opt(None, "config (subset) of a dataset folder or Hub dataset, as load_dataset's name")
    split: str = opt("train", "split of data.path to train on (dataset folders, Hub ids, saved DatasetDicts)")
    eval_path: str | None = opt(None, "optional evaluation data in the same forms (the same Hub id is fine)")
    eval_split: str = opt("test", "split of eval_path to evaluate on (dataset folders, Hub ids, DatasetDicts)")
    eval_fraction: float = opt(0.0, "fraction of the training data held out for evaluation when no eval_path")
    text_column: str = opt("text", "column with the full text (SFT) or the prompt text (PPO/GRPO)")
    prompt_column: str = opt("prompt", "column with the prompt")
    completion_column: str = opt("completion", "column with the completion (SFT prompt/completion data)")
    chosen_column: str = opt("chosen", "column with the preferred answer")
    rejected_column: str = opt("rejected", "column with the rejected answer")
    messages_column: str = opt("messages", "column with chat messages, rendered with the chat template")
    strict: bool = opt(False, "fail on examples longer than max_length instead of truncating them")
    max_examples: int | None = opt(None, "use only the first N examples (smoke tests); the number of rows "
                                   "data.streaming fetches, and the total of data.mixture")
    streaming: bool = opt(False, "stream a Hub id or dataset folder (load_dataset streaming=True) and fetch only "
                          "its first data.max_examples rows, so a huge dataset is not downloaded whole "
                          "(needs data.max_examples; applies to data.path, data.eval_path and mixture sources)")
    mixture: list[dict[str, Any]] | None = opt(
        None, "instead of data.path, several sources mixed by weight: [{path: a.jsonl, weight: 0.7}, {path: "
        "org/ds, name: x, split: train, weight: 0.3}] (name/split optional, as data.name/data.split). Exact "
        "proportions, each source's first rows, the order shuffled by seed; data.max_examples rows in all, "
        "or without it as many as the mixture holds until one source runs out at its weight")

    def __post_init__(self):
        if self.streaming and not self.max_examples:
            raise ConfigError("key 'data.streaming' fetches only the first data.max_examples rows; set "
                              "data.max_examples (e.g. --data.max_examples 10000) or drop data.streaming")
        if self.mixture is not None:
            problem = mixture_problem(self.mixture, self.path)
            if problem:
                raise ConfigError(problem)


MIXTURE_KEYS = ("path", "weight", "name", "split")


def mixture_problem(mixture: list[dict], path: str | None) -> str | None:
    """The first mistake in a data.mixture (with data.path beside it), as a one-line message, or None."""
    if path is not None:
        return ("keys 'data.path' and 'data.mixture' are alternatives: drop data.path, or put it in the "
                "mixture as {path: ..., weight: ...}")
    if not mixture:
        return "key 'data.mixture' is empty: list at least one {path: ..., weight: ...} (or use data.path)"
    for i, entry in enumerate(mixture):
        key = f"data.mixture[{i}]"
        unknown = sorted(set(entry) - set(MIXTURE_KEYS))
        if unknown:
            return f"key '{key}' has unknown key '{unknown[0]}' (allowed: {', '.join(MIXTURE_KEYS)})"
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            return f"key '{key}.path' must be a data file, dataset folder or hub id, got {entry.get('path')!r}"
        w = entry.get("weight")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            return f"key '{key}.weight' must be a positive number (the source's share of the rows), got {w!r}"
        for opt_key in ("name", "split"):
            if entry.get(opt_key) is not None and not isinstance(entry[opt_key], str):
                return f"key '{key}.{opt_key}' must be a string, got {entry[opt_key]!r}"
    return None


@dataclasses.dataclass
class TrainConfig:
    """Fields every trainer shares."""

    model_name: str = opt(REQUIRED, "HF model id or local path; 'tiny:llama' builds a tiny local model")
    output_dir: str = opt("runs/run", "where checkpoints, metrics, plots and the final model go")
    seed: int = opt(42, "random seed for initialisation, shuffling and sampling")
    learning_rate: float = opt(1e-5, "peak learning rate of AdamW")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    lr_scheduler: Literal["constant", "linear", "cosine"] = opt("linear", "schedule after warmup")
    warmup_ratio: float = opt(0.0, "fraction of the optimizer steps used for linear warmup")
    num_epochs: int = opt(1, "passes over the training data")
    max_steps: int | None = opt(None, "stop after this many optimizer steps (overrides num_epochs)")
    batch_size: int = opt(8, "examples per device per micro-batch")
    gradient_accumulation_steps: int = opt(1, "micro-batches accumulated per optimizer step")
    max_grad_norm: float | None = opt(1.0, "clip the global gradient norm to this (null: no clipping)")
    max_length: int = opt(512, "maximum tokens per example (prompt plus answer)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = opt(
        "auto", "weights/compute dtype; auto = bfloat16 on GPUs that support it, else float32")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    logprob_chunk_size: int | None = opt(None, "the LM head and log-softmax run over this many positions at a time "
                                         "in training (recomputed in backward) and scoring forwards, so the "
                                         "(B, T, V) logits never exist at once (null: automatic, chunked once "
                                         "B*T*V > 2**26; 0: never)")
    optimize_device_cache: bool = opt(False, "free the accelerator's cached memory between generation and "
                                      "training (lower peak memory, a little slower)")
    attn_implementation: str | None = opt(None, "attention kernel: sdpa, eager, flash_attention_2 (null: default)")
    trust_remote_code: bool = opt(False, "allow model code from the checkpoint (only if you trust it)")
    deepspeed: str | None = opt(None, "DeepSpeed config JSON (e.g. ds_configs/zero3.json) when not given to accelerate")
    log_every: int = opt(1, "log metrics every N optimizer steps")
    eval_every: int = opt(0, "evaluate every N optimizer steps (0: only at the end)")
    save_every: int = opt(0, "checkpoint every N optimizer steps (0: only the final model)")
    save_total_limit: int | None = opt(None, "keep only the newest N checkpoints (null: keep all)")
    resume: str | None = opt(None, "'auto' resumes from the newest complete checkpoint, or a checkpoint path")
    overwrite: bool = opt(False, "start a new run in an output_dir that holds a previous run (its metrics and "
                          "checkpoints are deleted); without it such a run is refused")
    save_merged: bool = opt(False, "LoRA runs: besides the adapter in output_dir, write the merged full "
                            "model to output_dir/merged")
    report_to: list[str] = opt(["jsonl"], "metric sinks: jsonl, tensorboard, wandb (offline unless configured), "
                               "trackio, mlflow, or none; each but jsonl needs its package installed")
    verbose: bool = opt(False, "show third-party warnings and loading bars (DeepSpeed, transformers)")
    run_name: str | None = opt(None, "name of the run in wandb and the plots (default: output_dir name)")
    dry_run: bool = opt(False, "print the resolved config and sizes, then exit without training")
    lora: LoraSection = section(LoraSection, "LoRA adapters")
    data: DataSection = section(DataSection, "training data and its columns")

    def __post_init__(self):
        for name in ("batch_size", "gradient_accumulation_steps", "num_epochs", "max_length", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"key '{name}' must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"key 'warmup_ratio' must be in [0, 1), got {self.warmup_ratio}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ConfigError(f"key 'learning_rate' must be a positive number, got {self.learning_rate}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 0:
            raise ConfigError(f"key 'logprob_chunk_size' must be at least 1, 0 (never chunk) or null (automatic), "
                              f"got {self.logprob_chunk_size}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ConfigError(f"key 'save_total_limit' must be at least 1 or null, got {self.save_total_limit}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"key 'max_steps' must be at least 1 or null, got {self.max_steps}")
        problem = report_to_problem(self.report_to)
        if problem:
            raise ConfigError(problem)
        if self.save_merged and not self.lora.enabled:
            raise ConfigError("key 'save_merged': only a LoRA run has an adapter to merge (lora.enabled is false; "
                              "a full fine-tune is saved whole already); drop save_merged or set lora.enabled=true")


@dataclasses.dataclass
class OnlineConfig(TrainConfig):
    """Keys of the trainers that sample completions from the policy and score them with the reward
    protocol (`rl.reward_sources`): GRPO and its variants, online DPO. One meaning each, in both."""

    max_completion_length: int = opt(64, "new tokens per completion at most")
    temperature: float = opt(1.0, "sampling temperature (log-probs in the loss use the same temperature)")
    top_k: int = opt(0, "sample from the k most likely tokens (0: all)")
    top_p: float = opt(1.0, "nucleus sampling mass (1.0: off)")
    reward_funcs: list[str] = opt([], "reward functions: rl.rewards names (correctness, default, length_penalty) "
                                  "or 'module:function' with TRL's signature (prompts, completions, **columns)")
    reward_model_path: str | None = opt(None, "reward model directory written by launch/reward.py (scores prompt + "
                                        "completion); one more reward source")
    reward_weights: list[float] | None = opt(None, "one weight per reward source (the environment first, then the "
                                             "reward model, then reward_funcs); default all 1.0")
    reward_timeout: float | None = opt(300.0, "seconds a reward source may take per batch (null or 0: no limit)")
    env_type: str | None = opt(None, "environment as prompt and reward source: math, code, text_generation, "
                               "multi_objective, preference_comparison")
    env_config: dict = opt({}, "keyword arguments of the environment (see rl.environments.make_env)")
    eval_env_config: dict | None = opt(None, "environment config for evaluation (e.g. {split: test}); greedy "
                                       "decoding, reports eval/accuracy and eval/reward")
    eval_num_prompts: int = opt(200, "evaluation prompts at most (duplicates removed)")
    chat_template: bool = opt(False, "render each prompt as a user turn with the tokenizer's chat template "
                              "(instruct models); reward functions still see the plain prompt")
    packing: bool = opt(False, "padding-free training forwards: each micro-batch's prompt+completion rows packed "
                        "into rows no longer than its longest, with per-row position_ids (rl.packing); same loss")

    # a reward source on the command line replaces the recipe's (the environment stays: it is the prompts)
    REWARD_SOURCE_KEYS = ("reward_model_path", "reward_funcs")

    def __post_init__(self):
        super().__post_init__()
        if self.max_completion_length < 1:
            raise ConfigError(f"key 'max_completion_length' must be at least 1, got {self.max_completion_length}")
        if self.max_length <= self.max_completion_length:
            raise ConfigError(f"max_length={self.max_length} leaves no room for the prompt next to "
                              f"max_completion_length={self.max_completion_length}; raise max_length")
        if self.reward_timeout is not None and not self.reward_timeout >= 0:
            raise ConfigError(f"key 'reward_timeout' must be >= 0 seconds or null, got {self.reward_timeout}")

    @property
    def prompt_budget(self) -> int:
        """Prompt tokens kept (from the right) so that prompt + completion fits max_length."""
        return self.max_length - self.max_completion_length
