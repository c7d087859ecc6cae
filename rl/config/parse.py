"""Parsing a trainer's config from the command line: a YAML recipe as the base, overrides on top.

`parse_config(Schema, argv)` reads `--config recipe.yaml`, applies `--key value`, `--key=value` and
`key=value` overrides (dotted keys such as `lora.rank=16` reach nested sections; a value is read as
YAML would read it, '3' -> 3, '[1,2]' -> a list, with the field's type deciding what a bare flag
means), and builds the dataclass with rl.config.fields.build. Mistakes become one `ConfigError` line;
`cli_config` prints it as `error: ...` and exits with 2, as the launch scripts do. `--help` lists
every key with its type, default and help text (`help_text`). A reward source given on the command
line replaces the recipe's reward sources rather than clashing with them.

Why not plain argparse or HfArgumentParser: neither merges a YAML base with overrides of nested
sections, nor suggests the closest key for a typo, which is most of what goes wrong with recipes.
`save_config` writes the resolved config (defaults included) beside a run's outputs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from rl.config.fields import REQUIRED, build, fields_of, hints_of, type_name
from rl.config.vocabulary import DEPRECATED, FALSE_WORDS, TRUE_WORDS, aliases_of, canonical
from rl.errors import ConfigError, RunError, disk_full

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


def field_type(cls: type, dotted: str) -> Any:
    """Type of a dotted key, or None when the key is unknown (reported later by `build`)."""
    tp: Any = cls
    parts = dotted.split(".")
    while parts:
        if not dataclasses.is_dataclass(tp):
            return None
        head, *rest = aliases_of(tp).get(parts[0], parts[0]).split(".")  # an alias may name a section's key
        parts = rest + parts[1:]
        hints = hints_of(tp)
        if head not in hints:
            return None
        tp = hints[head]
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
                tp = field_type(cls, key)
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                takes_flag = tp is bool and (nxt is None or nxt.startswith("--") or "=" in nxt
                                             or nxt.lower() not in TRUE_WORDS | FALSE_WORDS)
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


def recipe_environment(data: dict, cls: type, where: str) -> dict:
    """A TRL recipe's `env:` mapping (TRL's CLI sets these environment variables before anything runs, e.g.
    WANDB_PROJECT) applied to os.environ; `data` without it. A schema with a key `env` of its own keeps it."""
    if "env" not in data or "env" in fields_of(cls):
        return data
    env = data["env"]
    if not isinstance(env, dict):
        raise ConfigError(f"{where}: key 'env' must be a mapping of environment variables (VAR: value)")
    for name, value in env.items():
        os.environ[str(name)] = str(value)
    return {k: v for k, v in data.items() if k != "env"}


def help_text(cls: type, prog: str, description: str = "") -> str:
    lines = [f"usage: {prog} [--config RECIPE.yaml] [--key VALUE | key=VALUE ...]", ""]
    if description:
        lines += [description.strip(), ""]
    lines += ["Every key below can be set in the recipe and overridden on the command line;",
              "nested keys use dots (lora.rank=16). Booleans accept --flag or --flag false.", "",
              "  --config PATH    YAML recipe used as the base (default: none, all defaults)"]

    def walk(c: type, prefix: str) -> None:
        hints = hints_of(c)
        for name, f in fields_of(c).items():
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
            lines.append(f"  --{prefix}{name} {type_name(tp)}  (default: {default})")
            lines.append(f"        {f.metadata.get('help', '')}")
        al = {a: t for a, t in aliases_of(c).items() if a not in DEPRECATED}  # not our own former names
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
    data = recipe_environment(data, cls, where)
    build(cls, data, where, require=False)  # a mistake in the recipe names the recipe file and the key as typed
    build(cls, overrides, "command line", require=False)
    # every name becomes the schema's own before the merge, so that an override by any name replaces the recipe's
    typed: dict[str, str] = {}
    data = _canonical_tree(cls, data, where, typed=typed)
    overrides = _canonical_tree(cls, overrides, "command line", typed=typed)
    data = _cli_replaces_reward_sources(cls, data, overrides)
    data = _cli_replaces_alternatives(cls, data, overrides)
    return build(cls, _merge(data, overrides), "command line" if overrides else where, typed=typed)


def _canonical_tree(cls: type, tree: dict, where: str, prefix: str = "", typed: dict | None = None) -> dict:
    """`tree` in the schema's own key names (rl.config.vocabulary.canonical) at every level: its sections, and
    the mappings a schema builds into another schema later (`NESTED_SCHEMAS`: the pipeline's sft and grpo)."""
    tree = canonical(tree, cls, where, prefix, typed if not prefix else None)
    hints, nested = hints_of(cls), getattr(cls, "NESTED_SCHEMAS", {})
    out = {}
    for k, v in tree.items():
        sub = nested.get(k) or (hints.get(k) if dataclasses.is_dataclass(hints.get(k)) else None)
        out[k] = _canonical_tree(sub, v, where, f"{prefix}{k}.") if sub is not None and isinstance(v, dict) else v
    return out


def _cli_replaces_reward_sources(cls: type, recipe: dict, overrides: dict) -> dict:
    """A reward source given on the command line (a key of cls.REWARD_SOURCE_KEYS) replaces the recipe's
    reward sources and their reward_weights, rather than clashing with them (`reward_model_path=runs/rm`
    over a recipe with `reward_fn: custom`). With reward_weights on the command line too the sources
    combine, as reward_weights asks for explicitly."""
    sources = set(getattr(cls, "REWARD_SOURCE_KEYS", ()))
    aliases = aliases_of(cls)
    # switching a source off (env_type=null) gives none: the recipe's other sources stay
    given = {aliases.get(k, k) for k, v in overrides.items() if v not in (None, [], "null", "none")}
    if not sources & given or "reward_weights" in given:
        return recipe
    dropped = sources | {"reward_weights", "custom_reward"}
    return {k: v for k, v in recipe.items() if aliases.get(k, k) not in dropped}


def _cli_replaces_alternatives(cls: type, recipe: dict, overrides: dict) -> dict:
    """Keys that are alternative ways to say one thing (`cls.ALTERNATIVES`, e.g. PPO's run length as
    num_iterations rounds or max_steps optimizer steps): one given on the command line replaces the recipe's
    others instead of clashing with them."""
    for group in getattr(cls, "ALTERNATIVES", ()):
        if any(overrides.get(k) is not None for k in group):
            recipe = {k: v for k, v in recipe.items() if k not in group or k in overrides}
    return recipe


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
    """Write the resolved config (every field, defaults included) as YAML next to the outputs. A full disk
    is one `RunError` line naming the file: this is a run's first write, before any model is built."""
    d = Path(directory)
    path = d / name
    try:
        d.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    except OSError as e:
        if not disk_full(e):
            raise
        raise RunError(f"no space left on {d} while writing {path}; free space there or choose another "
                       f"output_dir") from None
    return path
